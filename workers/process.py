"""One llama-server process: spawn pinned to its GPUs, pipe its output into the log, stop it.

Orphan protection: each child gets ``PR_SET_PDEATHSIG = SIGKILL`` (Linux prctl), so the
kernel kills it when the gateway dies, even by SIGKILL. A pid file per worker under the
state directory lets the next start find and clean up anything that still survived.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from gateway.logs import get_logger

PR_SET_PDEATHSIG = 1


def set_pdeathsig() -> None:
    """``preexec_fn`` of a llama-server child (runs between fork and exec): SIGKILL it when
    its parent dies (``PR_SET_PDEATHSIG``), in a process group of its own."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass
    # Own process group, so a terminal's Ctrl-C reaches the gateway only; the gateway
    # then stops the workers itself (and PDEATHSIG covers the gateway dying).
    os.setpgrp()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOG_VERBOSITY_ENV = "LLAMA_ARG_LOG_VERBOSITY"
"""llama-server's ``--log-verbosity`` as an environment variable (pinned build, common/arg.cpp;
read before the command line, so ``-lv`` in ``args`` wins; older builds ignore it).

:data:`QUIET_LOG_VERBOSITY` (2, warnings: ``LOG_LEVEL_WARN`` in common/log.h) keeps
llama-server's per-request info lines (slot selection, launch, timings, release: about nine
per request) from being written at all. The gateway logs those lines only at debug
(:meth:`WorkerProcess._emit`), so unless its own level is debug it would read and drop each
one, a wakeup of its event loop during the request. An operator's own verbosity
(:attr:`LaunchSpec.operator_verbosity`) wins, and its lines are logged at info."""

QUIET_LOG_VERBOSITY = 2

VERBOSITY_FLAGS = frozenset({"-lv", "--verbosity", "--log-verbosity",
                             "-v", "--verbose", "--log-verbose"})
"""llama-server's options that set its log verbosity (pinned build, common/arg.cpp: ``-lv N``
and its aliases; ``-v`` and its aliases for every message). Its parser takes an option's value
as the next argument only (no ``--opt=value``)."""

#: systemd's variables for the service's main process (sd_notify(3)): not passed to workers.
SD_NOTIFY_ENV = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})

IDLE_SLOTS_ENV = "LLAMA_ARG_CACHE_IDLE_SLOTS"
"""Workers run with ``--no-cache-idle-slots``, given as this environment variable (pinned
build, common/arg.cpp: read before the command line, so an operator's ``--cache-idle-slots``
in ``args`` still wins; builds without the option ignore the variable, where the flag would
stop them from starting).

llama-server's default (on) copies every idle slot's KV to the host prompt cache each time a
new task starts (tools/server/server-context.cpp); without it a slot is saved when a task takes
it for another prompt. The gateway does not use unified KV, so the eager copy frees nothing and
the slot keeps its KV anyway. Measured (README, "Worker flags"): on 2 real CPU workers with
``--cache-ram 2``, cached prompt tokens 0.794 → 0.804 of all prompt tokens through the gateway
and 0.734 → 0.793 with round-robin (``tests/bench/real_cache_idle.py``); simulated at 4 GPUs,
copy time per worker 103 → 62 s and TTFT p99 0.91 → 0.58 s on the conversation trace at equal
cached tokens (``tests/bench/cache_idle_slots.py``; the GPU copy rate there is an assumption)."""


FLASH_ATTN_ENV = "LLAMA_ARG_FLASH_ATTN"
"""CPU workers (no GPU) run with ``--flash-attn off``, given as this environment variable (pinned
build, common/arg.cpp: read before the command line, so ``-fa``/``--flash-attn`` in ``args``
wins). GPU workers keep llama-server's default (``auto``: on where the backend supports it).

In the pinned build the CPU flash-attention kernel is slow for a batch of few new tokens over a
long KV: a prompt whose head is cached and whose new part is under about 64 tokens (a chat turn,
a short question under a shared system prompt) and every decode step. Measured on one core with
the demo model (``tests/bench/cpu_flash_attn.py``; README, "Worker flags: --flash-attn off on
CPU workers"): 50 new tokens after 1,689 cached took 83.5 ms with it and 5.0 ms without (the
whole 1,684-token prompt, cold: 57.7 ms with it); a decode step at 1,908 tokens of context
2.04 ms and 0.76 ms. A cold prompt is faster with it (1,684 tokens: 57.7 and 130.6 ms). With
it, a cache hit with a short new part cost more than computing the whole prompt, so prefix
affinity could not pay off on CPU workers. Other CPUs and models differ (llama.cpp#27086: on
Arm Neoverse-V CPUs ``-fa auto`` halves prefill of a real 1.5B model); the bench takes
``--model`` to measure one.

Not set when ``args`` give ``-ctv``/``--cache-type-v`` or the environment has
:data:`CACHE_TYPE_V_ENV`: llama-server refuses to load a quantized V cache without flash
attention ("quantized V cache requires flash_attn to be enabled")."""

CACHE_TYPE_V_ENV = "LLAMA_ARG_CACHE_TYPE_V"
"""``-ctv`` as an environment variable (pinned build, common/arg.cpp)."""

FLASH_ATTN_FLAGS = frozenset({"-fa", "--flash-attn", "-ctv", "--cache-type-v"})
"""Options in ``args`` that leave the flash-attention choice to the operator (the first two set
it, the others may need it)."""

@dataclass
class LaunchSpec:
    """Everything needed to start one worker.

    Attributes:
        worker_id: e.g. ``demo-gpu0``.
        binary: llama-server path.
        model_path: GGUF file.
        alias: name llama-server reports as its model (the Ollama full name).
        gpus: GPU indices for ``CUDA_VISIBLE_DEVICES`` (empty = CPU worker, variable set to "").
        slots: ``-np``.
        context_per_slot: tokens; ``-c`` is ``slots * context_per_slot``.
        threads: ``-t`` or None to let llama-server decide.
        embeddings: pass ``--embeddings``.
        extra_args: appended last (operator's args win).
        log_verbosity: llama-server's ``--log-verbosity``, given as :data:`LOG_VERBOSITY_ENV`,
            or None for its default (3, info: about nine lines per request). The operator's
            own (:attr:`operator_verbosity`) wins.
    """

    worker_id: str
    binary: Path
    model_path: Path
    alias: str
    gpus: tuple[int, ...]
    slots: int
    context_per_slot: int
    threads: int | None = None
    embeddings: bool = False
    extra_args: list[str] = field(default_factory=list)
    log_verbosity: int | None = None

    @property
    def total_context(self) -> int:
        """Tokens of the worker's whole context (``-c``): slots * context_per_slot."""
        return self.slots * self.context_per_slot

    @property
    def operator_verbosity(self) -> bool:
        """Whether the operator chose the worker's log verbosity: one of
        :data:`VERBOSITY_FLAGS` in ``extra_args`` (the model's ``args`` or
        ``llama_server.extra_args``), or :data:`LOG_VERBOSITY_ENV` in the gateway's
        environment (which :meth:`env` then passes on unchanged)."""
        return (LOG_VERBOSITY_ENV in os.environ
                or any(a in VERBOSITY_FLAGS for a in self.extra_args))

    @property
    def gpu_label(self) -> str:
        """The worker's GPUs as its logs and metrics name them: ``"0"``, ``"1,3"``, or ``"cpu"``."""
        return ",".join(map(str, self.gpus)) or "cpu"

    def argv(self, port: int) -> list[str]:
        args = [str(self.binary), "-m", str(self.model_path), "--host", "127.0.0.1",
                "--port", str(port), "-np", str(self.slots),
                "-c", str(self.total_context), "--metrics", "--slots",
                "--alias", self.alias, "--no-webui"]
        if self.threads:
            args += ["-t", str(self.threads)]
        if self.embeddings:
            args += ["--embeddings"]
        return args + list(self.extra_args)

    def env(self, api_key: str) -> dict[str, str]:
        """The worker's environment: the gateway's (less systemd's :data:`SD_NOTIFY_ENV`, which
        are the gateway's own, as sd_notify(3) advises), plus ``CUDA_VISIBLE_DEVICES`` (with
        ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the indices are NVML's), the per-start
        key, the binary's library folder, and ``LLAMA_ARG_CACHE_IDLE_SLOTS=0`` (see
        :data:`IDLE_SLOTS_ENV`), for a CPU worker ``LLAMA_ARG_FLASH_ATTN=off`` (see
        :data:`FLASH_ATTN_ENV`; not when ``extra_args`` hold one of
        :data:`FLASH_ATTN_FLAGS`) and the log verbosity (:data:`LOG_VERBOSITY_ENV`) unless the
        environment already sets them (or, for the verbosity, ``extra_args`` do). The variables
        of :data:`GATEWAY_ENV` are left out."""
        env = {k: v for k, v in os.environ.items()
               if k not in SD_NOTIFY_ENV and k not in GATEWAY_ENV}
        env.setdefault(IDLE_SLOTS_ENV, "0")
        if not self.gpus and CACHE_TYPE_V_ENV not in env and not any(
                a in FLASH_ATTN_FLAGS for a in self.extra_args):
            env.setdefault(FLASH_ATTN_ENV, "off")
        if self.log_verbosity is not None and not self.operator_verbosity:
            # not beside an operator's -lv: llama-server would warn at every start that the
            # variable is overwritten by the command line
            env.setdefault(LOG_VERBOSITY_ENV, str(self.log_verbosity))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        # The gateway's GPU indices are NVML's (nvidia-smi's), in PCI bus order; CUDA's own
        # default order is fastest first (CUDA C Programming Guide, "CUDA Environment
        # Variables"), so on a box of mixed cards CUDA_VISIBLE_DEVICES=0 could be another card
        # than the one NVML reports as GPU 0, its telemetry and slots_per_gpu then wrong.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # The per-start key travels in the environment (readable by this user only via
        # /proc/PID/environ), not on the command line that every local user can read.
        env["LLAMA_API_KEY"] = api_key
        lib_dir = str(Path(self.binary).resolve().parent)
        env["LD_LIBRARY_PATH"] = lib_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        return env


#: Text of output lines without llama-server's log prefix that report why the process dies:
#: the dynamic loader's (a binary copied out of its build folder without its libraries), a
#: ggml assertion (``ggml.c:3354: GGML_ASSERT(ggml_can_mul_mat(a, b)) failed``, then SIGABRT),
#: a C++ exception that ends it. Such a worker's start-up failure was "exited during startup
#: with status 127" (or -6) with the cause only at debug level (a fresh tester's find).
CRASH_MARKS = ("error while loading shared libraries", "GGML_ASSERT", "GGML_ABORT",
               "terminate called", "Illegal instruction", "Segmentation fault")


def error_text(line: str) -> str | None:
    """The error a llama-server output line reports (at most 300 characters), or None: a line
    with the level letter E after its timestamp (``0.00.009.380 E llama_model_load: …``, the
    text after the letter), or one without a prefix that starts with ``error`` (its
    command-line parser's ``error: invalid argument: --x``, pinned build common/arg.cpp) or
    holds one of :data:`CRASH_MARKS`."""
    parts = line.split(" ", 2)
    level = parts[1] if len(parts) > 2 and len(parts[1]) == 1 else ""
    if level == "E":
        return parts[2][:300]
    if not level and (line.startswith("error") or any(m in line for m in CRASH_MARKS)):
        return line[:300]
    return None


# llama-server 'W' lines that are routine per-request chatter, logged like its info lines:
# a prompt that is all in the slot's cache (a repeated or regenerated prompt) gets two
# (server-context.cpp, [TAG_PROMPT_LOGITS]: "need to evaluate at least 1 token …" and "n_past
# was set to …"), and a model with context checkpoints (SWA, hybrid) drops its oldest one
# ("erasing old context checkpoint") as a matter of course, and a request whose connection the
# gateway closed before its end (the client left, or the watchdog gave up on it, both logged by
# the gateway itself) is cancelled (server-queue.cpp ``server_response_reader::stop``:
# "cancel task, id_task = N").
ROUTINE_WARNINGS = ("need to evaluate at least 1 token for each active slot", "n_past was set to ",
                    "erasing old context checkpoint", "cancel task, id_task = ")


#: llama-server's environment forms of the flags the gateway owns (gateway.config
#: ``GATEWAY_FLAGS``: how it reaches a worker, which model it loads and names, ``/slots``) and
#: of its router mode, left out of a worker's environment: ``LLAMA_ARG_API_PREFIX`` in the
#: gateway's service environment moved every route of every worker, which then never became
#: ready, with no hint why (a fresh tester's find). Each start logs the names it left out
#: (``worker.env_ignored``).
GATEWAY_ENV = frozenset({
    "LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_API_PREFIX", "LLAMA_ARG_API_KEY_FILE",
    "LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "LLAMA_ARG_MODEL", "LLAMA_ARG_ALIAS",
    "LLAMA_ARG_MODEL_URL", "LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE", "LLAMA_ARG_DOCKER_REPO",
    "LLAMA_ARG_ENDPOINT_SLOTS", "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_PRESET",
    "LLAMA_ARG_MODELS_MAX", "LLAMA_ARG_MODELS_AUTOLOAD"})

#: Environment variable each worker is started with: ``<state directory>/<worker id>``; every
#: process the worker starts inherits it, so a gateway finds what an earlier one on the same
#: state directory left running (:func:`reap_stale_workers`).
WORKER_MARKER_ENV = "LLAMA_GATEWAY_WORKER"

#: Seconds after the first SIGTERM at which a worker still running gets a second one
#: (:meth:`WorkerProcess.stop`).
SECOND_SIGTERM_S = 1.5


class WorkerProcess:
    """A started llama-server. ``url`` and ``api_key`` are what the upstream client needs."""

    def __init__(self, spec: LaunchSpec, state_dir: Path | None = None):
        self.spec = spec
        self.state_dir = state_dir
        self.port = 0
        self.api_key = ""
        self.proc: asyncio.subprocess.Process | None = None
        self._pipes: list[asyncio.Task] = []
        self._exit_logged = False  # worker.exited was logged (wait)
        self._escapees: list[int] | None = None  # _group_alive's processes outside the group
        #: The first error line llama-server wrote (its timestamp and level letter removed),
        #: usually the most specific reason it gives for exiting (``error: invalid argument:
        #: --x``; ``llama_model_load: error loading model: …``, before the lines that repeat it
        #: less precisely); None while it wrote none.
        self.first_error: str | None = None
        #: the last output line without llama-server's log prefix (at most 300 characters): the
        #: reason of a start-up failure that wrote no error line (a wrapper script's message)
        self.last_plain: str | None = None
        self.log = get_logger("workers.process", worker=spec.worker_id, gpu=spec.gpu_label)
        self._operator_verbosity = spec.operator_verbosity

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def has_exited(self) -> bool:
        """Whether the process has ended: reaped (``returncode``), or, before asyncio's child
        watcher reaps it, a zombie in ``/proc/<pid>/stat`` (Linux; state ``Z``). A worker that
        crashes closes its connections in the same instant, so a request that sees its
        connection close can tell a crash from a lost connection (``Upstream.request``)."""
        if self.proc is None or self.proc.returncode is not None:
            return True
        if not os.path.isdir("/proc/self"):
            return False  # without /proc: unknown, taken as alive
        return _running_group(self.proc.pid) is None

    async def start(self) -> None:
        """Spawn the process. Raises OSError if the binary cannot be executed or its pid file
        cannot be written (the process is then killed and reaped)."""
        self.port = free_port()
        self.api_key = secrets.token_urlsafe(24)
        argv = self.spec.argv(self.port)
        env = self.spec.env(self.api_key)
        ignored = sorted(GATEWAY_ENV.intersection(os.environ))
        if ignored:
            self.log.warning("worker.env_ignored", names=ignored,
                             reason="the gateway sets these itself")
        if self.state_dir is not None:  # found by the next gateway's reap_stale_workers
            env[WORKER_MARKER_ENV] = os.fsdecode(self._marker())
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, preexec_fn=set_pdeathsig)
        self.log.info("worker.spawned", pid=self.proc.pid, port=self.port, argv=" ".join(argv[1:]))
        try:
            self._write_pidfile()
        except OSError:
            # the caller sees a failed spawn and tries again: this process must not run on,
            # untracked (a fresh tester's unwritable cache left one per try, each a loaded model)
            self.kill(signal.SIGKILL)
            await self.proc.wait()
            raise
        self._pipes = [asyncio.create_task(self._pipe(self.proc.stdout, "stdout")),
                       asyncio.create_task(self._pipe(self.proc.stderr, "stderr"))]

    async def _pipe(self, stream: asyncio.StreamReader, name: str) -> None:
        while True:
            try:
                line = await stream.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip()
            if text:
                self._emit(name, text)

    def _emit(self, stream: str, text: str) -> None:
        """Log one worker output line (``worker.output``) at the level llama-server gave it.

        llama-server prefixes its log lines with a timestamp and a level letter
        (``0.00.009.380 E llama_model_load…``): E → error, W → warning, and a line without a
        prefix that starts with ``error`` → error too (its command-line parser writes
        ``error: invalid argument: --x`` or ``error while handling argument "-c": stoi`` to
        stderr without one, pinned build common/arg.cpp, and then exits); everything else
        (per-request chatter, including the routine 'W' lines of :data:`ROUTINE_WARNINGS`,
        trace and debug lines, other lines without a prefix) → debug, so the gateway's info log
        stays readable; but → info when the operator set the worker's
        verbosity (:attr:`LaunchSpec.operator_verbosity`): they asked the worker for those
        lines, so they appear at the gateway's default level, as ``-lv`` gives them in
        llama-server's own output.
        """
        parts = text.split(" ", 2)
        level = parts[1] if len(parts) > 2 and len(parts[1]) == 1 else ""
        error = error_text(text)
        if not level and error is None:
            self.last_plain = text[:300]
        if error is not None:
            self.log.error("worker.output", stream=stream, line=text)
            if self.first_error is None:
                self.first_error = error
        elif level == "W" and not any(b in text for b in ROUTINE_WARNINGS):
            self.log.warning("worker.output", stream=stream, line=text)
        elif self._operator_verbosity:
            self.log.info("worker.output", stream=stream, line=text)
        else:
            self.log.debug("worker.output", stream=stream, line=text)

    async def wait(self) -> int:
        """Wait for exit; returns the exit status (negative = killed by that signal). The first
        wait to see it logs ``worker.exited`` (pid, status): the process is reaped then, so
        its port is free, and a restart spawns its successor only after it."""
        assert self.proc is not None
        rc = await self.proc.wait()
        if not self._exit_logged:
            self._exit_logged = True
            self.log.info("worker.exited", pid=self.proc.pid, status=rc)
            self._end_leftovers()
        for t in self._pipes:
            try:
                # what it wrote last (often why it exited) is still being read: 2 s lost a
                # line on a loaded machine once; the limit is for pipes a grandchild holds open
                await asyncio.wait_for(t, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()
        self._remove_pidfile()
        return rc

    def _end_leftovers(self) -> None:
        """The process has exited and been reaped: SIGKILL what it left running, in its group
        or outside it with the worker's marker. A wrapper that started llama-server detached
        and exited was seen as a worker that exited, restarted while the detached server lived
        on, one more per restart (a fresh tester's find: 5 in 60 s, then crash-loop "failed")."""
        self._escapees = None
        if self._group_alive():
            self.log.warning("worker.leftovers_killed", pids=self._escapees or [])
            self.kill(signal.SIGKILL)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker's whole process group (its own, ``set_pdeathsig``): a
        ``binary`` that is a wrapper script starting llama-server without ``exec`` has it as a
        child, which a signal to the wrapper alone left running, with its port and memory, on
        every restart and stop (a fresh tester's find). Linux does not hand out a pid that is
        still a group's id, so the group is ours as long as one of its processes lives."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # not ours (cannot happen for a group we made): the leader only
            if self.proc.returncode is None:
                self.proc.send_signal(sig)
        for pid in self._escaped():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def _escaped(self) -> list[int]:
        """Processes of this worker outside its process group: a wrapper that started
        llama-server with ``setsid`` left one loaded server per restart and one at every stop
        (a fresh tester's find). Found by the worker's environment marker (``_marker``)."""
        marker = self._marker()
        if marker is None or self.proc is None:
            return []
        return [pid for pid in _marked_pids(marker, exact=True)
                if _running_group(pid) not in (None, self.proc.pid)]

    def _marker(self) -> bytes | None:
        """This worker's ``WORKER_MARKER_ENV`` value (None without a state directory)."""
        if self.state_dir is None:
            return None
        return _marker_prefix(self.state_dir) + self.spec.worker_id.encode()

    def _group_alive(self) -> bool:
        """Whether a process of the worker's group other than a zombie still runs, or one of
        its processes that left the group (:meth:`_escaped`, looked up once per stop in
        ``/proc`` and then followed by pid: this is polled every 20 ms)."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
            in_group = any(_running_group(pid) == self.proc.pid for pid in _proc_pids())
        except ProcessLookupError:
            in_group = False
        except PermissionError:
            in_group = True
        if in_group:
            return True
        if self._escapees is None:
            self._escapees = self._escaped()
        self._escapees = [pid for pid in self._escapees if _running_group(pid) is not None]
        return bool(self._escapees)

    async def _ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the process and every process of its group
        (a wrapper script's llama-server) to end; returns whether they did."""
        assert self.proc is not None
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout_s)
        except asyncio.TimeoutError:
            return False
        while self._group_alive():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM; a second SIGTERM after SECOND_SIGTERM_S (or half the grace, if shorter)
        if the process is still there; SIGKILL once ``grace_s`` seconds have passed since the
        first. Returns the exit status once reaped.

        The second signal is llama-server's own way out of a hung shutdown ("Received second
        interrupt, terminating immediately", tools/server/server.cpp ``signal_handler``). Its
        SIGTERM handler locks the task queue's mutex (``server_queue::terminate``); when the
        signal lands on the main thread while that thread holds the lock (it was processing a
        task: the cancel of a stream the gateway just closed, a ``/slots`` poll), the handler
        waits for itself for good. Seen here in about 1 of 10 restarts whose drain ran out:
        the worker sat out the whole grace and was SIGKILLed. The second SIGTERM reaches
        another thread (the first handler keeps the signal blocked on its own), which exits.
        A worker that is only slow to stop is not cut short: llama-server otherwise exits
        within its 1 s HTTP polling interval (``HTTP_POLLING_SECONDS``)."""
        if self.proc is None:
            return None
        self._escapees = None  # looked up again for this stop
        if self.proc.returncode is None or self._group_alive():
            self.kill(signal.SIGTERM)
            first = min(SECOND_SIGTERM_S, grace_s / 2)
            if not await self._ended(first):
                self.log.info("worker.stop_second_signal", after_s=first)
                self.kill(signal.SIGTERM)
                if not await self._ended(grace_s - first):
                    self.log.warning("worker.stop_timeout", grace_s=grace_s)
                    self.kill(signal.SIGKILL)
                    await self._ended(5.0)
        return await self.wait()

    # ---- pid files: clean-up of survivors from an earlier gateway --------------------------
    def _pidfile(self) -> Path | None:
        return self.state_dir / f"{self.spec.worker_id}.pid" if self.state_dir else None

    def _write_pidfile(self) -> None:
        p = self._pidfile()
        if p and self.proc:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"{self.proc.pid}\n{self.spec.binary}\n")

    def _remove_pidfile(self) -> None:
        p = self._pidfile()
        if p:
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def _proc_pids() -> list[int]:
    """Pids of every process in ``/proc`` (Linux)."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _marked_pids(marker: bytes, exact: bool = False) -> list[int]:
    """Pids of the live processes (zombies aside) whose environment has a
    ``WORKER_MARKER_ENV`` value starting with ``marker`` (equal to it with ``exact``); those of
    other users cannot be read and are skipped."""
    found = []
    for pid in _proc_pids():
        if pid == os.getpid():
            continue
        marks = _marks_of(pid)
        if ((marker in marks) if exact else any(m.startswith(marker) for m in marks)) \
                and _running_group(pid) is not None:
            found.append(pid)
    return found


def _marks_of(pid: int) -> list[bytes]:
    """The ``WORKER_MARKER_ENV`` values in ``pid``'s environment (none when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return []
    key = WORKER_MARKER_ENV.encode() + b"="
    return [v[len(key):] for v in env if v.startswith(key)]


def _running_group(pid: int) -> int | None:
    """Process group of ``pid`` from ``/proc/PID/stat``; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 3 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[2])


def reap_stale_workers(state_dir: Path) -> list[int]:
    """Kill llama-server processes of an earlier gateway on ``state_dir`` still running.

    A recorded pid counts only if ``/proc/PID/exe`` still is the recorded binary (pids get
    reused); any process whose environment names a worker of ``state_dir``
    (``WORKER_MARKER_ENV``) counts too: a wrapper script's llama-server, which the kernel's
    parent-death signal does not reach (only the wrapper gets it), outlived a gateway killed
    with SIGKILL and was not recognised by the pid file (a fresh tester's find). Returns the
    pids killed.
    """
    killed = []
    log = get_logger("workers.process")
    pidfiles = list(state_dir.glob("*.pid")) if state_dir.is_dir() else []
    stale = [(pid, str(pf)) for pf in pidfiles if (pid := _live_pid(pf)) is not None]
    stale += [(pid, None) for pid in _marked_pids(_marker_prefix(state_dir))
              if pid not in {p for p, _ in stale}]
    for pid, pf in stale:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            log.warning("worker.stale_killed", pid=pid, pidfile=pf)
        except OSError:
            pass
    for pf in pidfiles:
        try:
            pf.unlink()
        except FileNotFoundError:
            pass
    return killed


def _marker_prefix(state_dir: Path) -> bytes:
    return os.fsencode(str(state_dir.resolve())) + b"/"


def _live_pid(pidfile: Path) -> int | None:
    """The pid a pid file records when that process still runs the recorded binary
    (``/proc/PID/exe``; pids get reused) and, when its environment names a worker
    (``WORKER_MARKER_ENV``), names one of the pid file's state directory, else None. The
    binary alone matched a worker of another gateway that had been given the recorded pid
    (a fresh tester's find, with pids of 15 bits); a worker of a gateway version without the
    marker is matched by its binary as before."""
    try:
        pid_s, binary = pidfile.read_text().splitlines()[:2]
        pid = int(pid_s)
        exe = os.readlink(f"/proc/{pid}/exe")
    except (ValueError, OSError):
        return None
    if Path(exe).resolve() != Path(binary).resolve():
        return None
    marks = _marks_of(pid)
    if marks and not marks[0].startswith(_marker_prefix(pidfile.parent)):
        return None
    return pid


def remove_state_dir(state_dir: Path) -> bool:
    """On a clean stop: remove the gateway's state directory (``run/<host>_<port>``) unless a
    pid file in it still names a live llama-server; pid files of dead processes go with it.
    Returns True when the directory is gone (or never existed)."""
    if not state_dir.is_dir():
        return True
    pidfiles = list(state_dir.glob("*.pid"))
    if any(_live_pid(pf) is not None for pf in pidfiles):
        return False
    try:
        for pf in pidfiles:
            pf.unlink(missing_ok=True)
        state_dir.rmdir()  # fails (and is kept) when anything else is in it
    except OSError as e:
        get_logger("workers.process").info("gateway.state_dir_kept", path=str(state_dir),
                                           error=str(e))
        return False
    return True
