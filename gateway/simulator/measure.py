"""Measure one real llama-server for the simulator's calibration (``llama-gateway calibrate``).

Starts one llama-server (``-np slots``, ``-c slots*context``, ``-t threads``, ``--metrics``;
the same arguments and environment the gateway gives a CPU worker, from
``workers.process.LaunchSpec``, so ``LLAMA_ARG_FLASH_ATTN=off``, or with ``--gpu N`` those of a
GPU worker on GPU N; the document records the ``LLAMA_ARG_*`` variables as ``server.env``) and
sends streamed ``/completion`` requests (the gateway always streams from its workers, and
streaming costs the server CPU per token: with 8 streams on one core, flash attention on, the
step time seen was about 1.5 ms without streaming and 2.3-2.6 ms with it) whose prompts are
lists of token ids (printable byte tokens, so the length in tokens is exact; ``cache_prompt:
false`` and ``ignore_eos``, so every prompt is computed and every output runs to
``n_predict``). Figures come from llama-server's own ``timings`` object of each response,
wall-clock is recorded beside them:

- prefill: ``prompt_n`` / ``prompt_ms`` for a few prompt lengths, one request at a time;
- decode: ``predicted_per_token_ms`` (= ``predicted_ms / (predicted_n - 1)``, one decode
  step as that stream saw it) with ``streams`` concurrent requests. In a round of concurrent
  streams the smallest value counts: the stream whose prefill ended last saw only decode
  steps (for short prompts all streams start in the same step and agree).

The median over ``repeats`` rounds is fitted by ``gateway.simulator.calibration``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import secrets
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import httpx

from gateway.logs import get_logger
from gateway.simulator.calibration import (
    DecodePoint,
    PrefillPoint,
    fit_profile,
    profile_dict,
    step_s,
)
from workers.process import LaunchSpec, error_text, free_port, set_pdeathsig

log = get_logger(__name__)

PREFILL_LENGTHS = (128, 512, 1024, 2048)
"""Prompt lengths (tokens) of the prefill measurement."""

DECODE_PLAN = (  # (streams, prompt tokens, generated tokens, used in the fit)
    (1, 8, 256, True), (2, 8, 256, True), (4, 8, 256, True),
    (1, 1024, 128, True), (1, 2048, 128, True), (1, 3072, 128, True),
    (4, 1024, 512, False),  # check of the model: attention cost summed over the batch
    (8, 8, 256, False),  # check of the batch term beyond the fitted sizes (needs 8 slots)
)
"""Decode rounds: batch sizes at a short context, then one stream at long contexts; rounds
with more streams than slots are skipped."""


@dataclass
class Server:
    """A started llama-server: base ``url`` and the ``headers`` carrying its API key."""

    proc: subprocess.Popen
    url: str
    headers: dict
    argv: list[str]


@contextmanager
def start_server(spec: LaunchSpec) -> Iterator[Server]:
    """Run llama-server until the block ends (SIGTERM, then SIGKILL after 10 s).

    Raises ``RuntimeError`` when it exits before it is ready (with its first error line,
    ``workers.process.error_text``) and ``TimeoutError`` when it is not ready within 60 s."""
    port = free_port()
    key = secrets.token_hex(16)
    argv = spec.argv(port)
    out = tempfile.TemporaryFile()  # its output, read only for why it exited
    # dies with this process, as the gateway's workers do: calibrate stopped by SIGTERM (a
    # timeout, a cancelled job) left its llama-server running (a fresh tester's find)
    proc = subprocess.Popen(argv, env=spec.env(key), stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=set_pdeathsig)
    srv = Server(proc, f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}, argv)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                out.seek(0)
                lines = out.read().decode("utf-8", "replace").splitlines()
                why = next((e for ln in lines if (e := error_text(ln)) is not None),
                           lines[-1][:300] if lines else "no output")
                raise RuntimeError(f"llama-server exited with status {proc.returncode} before "
                                   f"it was ready: {why}")
            try:
                if httpx.get(srv.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("llama-server not ready after 60 s")
            time.sleep(0.1)
        log.info("calibrate.server_ready", pid=proc.pid, argv=" ".join(argv[1:]))
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def server_version(spec: LaunchSpec) -> str:
    """The first line of ``llama-server --version`` that names the version
    (``workers.provision.llama_server_version``, in the worker's environment), else ``unknown``."""
    from workers.provision import ProvisionError, llama_server_version

    try:
        return llama_server_version(spec.binary, env=spec.env(""))
    except ProvisionError:
        return "unknown"


def server_env(spec: LaunchSpec) -> dict[str, str]:
    """The ``LLAMA_ARG_*`` variables the server starts with (``LaunchSpec.env``: for a CPU worker
    ``LLAMA_ARG_FLASH_ATTN=off`` among them, and any the caller's environment sets), which
    llama-server reads as options but ``argv`` does not show; the API key is not included."""
    return {k: v for k, v in sorted(spec.env("").items()) if k.startswith("LLAMA_ARG_")}


def _complete(client: httpx.Client, srv: Server, prompt_tokens: int, n_predict: int,
              rng: random.Random) -> dict:
    """One streamed ``/completion`` (as the gateway always asks its workers); returns the
    ``timings`` of its last event."""
    body = {"prompt": [rng.randrange(33, 127) for _ in range(prompt_tokens)],
            "n_predict": n_predict, "cache_prompt": False, "ignore_eos": True, "stream": True}
    last = None
    with client.stream("POST", srv.url + "/completion", json=body, headers=srv.headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                last = line
    t = json.loads(last[5:])["timings"] if last else {}
    if t.get("predicted_n") != n_predict or t.get("prompt_n") != prompt_tokens:
        raise RuntimeError(f"asked {prompt_tokens}+{n_predict} tokens, server did "
                           f"{t.get('prompt_n')}+{t.get('predicted_n')}")
    return t


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux ``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def concurrent_round(srv: Server, streams: int, prompt_tokens: int, n_predict: int,
                     rng: random.Random) -> tuple[list[dict], float, float]:
    """``streams`` requests at once. Returns (their ``timings``, wall seconds, CPU seconds
    the server used meanwhile, its HTTP threads included)."""
    seeds = [rng.random() for _ in range(streams)]
    with httpx.Client(timeout=600) as c, cf.ThreadPoolExecutor(streams) as ex:
        cpu0, t0 = cpu_seconds(srv.proc.pid), time.perf_counter()
        ts = list(ex.map(lambda s: _complete(c, srv, prompt_tokens, n_predict, random.Random(s)),
                         seeds))
        return ts, time.perf_counter() - t0, cpu_seconds(srv.proc.pid) - cpu0


def measure(srv: Server, slots: int, repeats: int = 5, seed: int = 0) -> dict:
    """Raw measurements: ``{"prefill": [...], "decode": [...]}`` (times in ms).

    The whole plan is repeated ``repeats`` times (rather than each point ``repeats`` times in
    a row), so that a slow spell of a shared machine spreads over all points."""
    rng = random.Random(seed)
    concurrent_round(srv, 1, 64, 64, rng)  # warm-up, not counted
    plan = [(b, p, n, fitted) for b, p, n, fitted in DECODE_PLAN if b <= slots]
    prefill = {n: [] for n in PREFILL_LENGTHS}
    step_ms = {k: [] for k in plan}
    wall_tps = {k: [] for k in plan}
    cores = {k: [] for k in plan}
    for rep in range(repeats):
        for n in PREFILL_LENGTHS:
            prefill[n].append(concurrent_round(srv, 1, n, 1, rng)[0][0]["prompt_ms"])
        for k in plan:
            ts, wall, cpu = concurrent_round(srv, k[0], k[1], k[2], rng)
            step_ms[k].append(min(t["predicted_per_token_ms"] for t in ts))
            wall_tps[k].append(sum(t["predicted_n"] for t in ts) / wall)
            cores[k].append(cpu / wall)
        log.info("calibrate.round", round=rep + 1, of=repeats)
    return {"prefill": [{"prompt_tokens": n, "prompt_ms": ms,
                         "tokens_per_s": n / (statistics.median(ms) / 1000)}
                        for n, ms in prefill.items()],
            "decode": [{"streams": k[0], "prompt_tokens": k[1], "predicted": k[2], "fitted": k[3],
                        "step_ms": step_ms[k], "step_ms_median": statistics.median(step_ms[k]),
                        "wall_tokens_per_s": wall_tps[k], "server_cores": cores[k]}
                       for k in plan]}


def fit(raw: dict, name: str, source: str):
    """The profile fitted to ``measure``'s output; adds each decode row's ``model_ms``."""
    pre = [PrefillPoint(r["prompt_tokens"], statistics.median(r["prompt_ms"]) / 1000)
           for r in raw["prefill"]]
    rows = raw["decode"]
    pts = [DecodePoint(r["streams"], r["prompt_tokens"], r["predicted"], r["step_ms_median"] / 1000)
           for r in rows]
    prof = fit_profile(name, pre, [p for p, r in zip(pts, rows) if r["fitted"]], source)
    for p, r in zip(pts, rows):
        r["model_ms"] = step_s(prof, p.streams, p.kv_tokens) * 1000
    return prof


def calibrate(binary: Path, model: Path, *, name: str, command: str, out: str, slots: int = 8,
              context: int = 4096, threads: int | None = 1, repeats: int = 7,
              seed: int = 0, gpus: tuple[int, ...] = ()) -> dict:
    """Start a server, measure, fit. Returns the calibration document (``profile`` +
    raw measurements) that ``GpuProfile.from_json`` reads.

    ``gpus`` (NVML indices) starts the server as the gateway starts a GPU worker on them
    (``CUDA_VISIBLE_DEVICES``, no forced ``LLAMA_ARG_FLASH_ATTN``); the document's ``machine``
    then names them (``workers.gpu.read_gpu_stats``). Empty: a CPU worker."""
    t0 = time.time()
    spec = LaunchSpec("calibrate", Path(binary), Path(model), "demo", tuple(gpus), slots, context,
                      threads)
    with start_server(spec) as srv:
        raw = measure(srv, slots, repeats, seed)
        argv = srv.argv
    source = f"{out}, measured by `{command}`"
    prof = fit(raw, name, source)
    return {"profile": profile_dict(prof), "command": command,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - t0, 1),
            "server": {"version": server_version(spec), "argv": [Path(argv[0]).name] + argv[1:],
                       "env": server_env(spec)},
            "machine": {"cpus": os.cpu_count(), "loadavg_after": list(os.getloadavg()),
                        "gpus": _gpu_names(gpus)},
            **raw}


def _gpu_names(gpus: tuple[int, ...]) -> list[str]:
    """NVML's name of each GPU the server ran on (``"?"`` where NVML gives none)."""
    if not gpus:
        return []
    from workers.gpu import read_gpu_stats
    stats = read_gpu_stats()
    return [stats[g].name if g in stats else "?" for g in gpus]


def _median(xs: list[float] | None) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(doc: dict) -> str:
    """Markdown tables of a calibration document: fitted figures, prefill, decode."""
    p = doc["profile"]
    out = ["| figure | value |", "|---|---:|",
           f"| prefill_tps (tokens/s) | {p['prefill_tps']:,.0f} |",
           f"| decode_s1 (ms per step, 1 sequence) | {p['decode_s1'] * 1000:.4f} |",
           f"| batch_slope (per extra sequence) | {p['batch_slope']:.3f} |",
           f"| attn_s_per_token (µs per KV token per step) | {p['attn_s_per_token'] * 1e6:.4f} |",
           "", "| prompt tokens | prompt ms (median) | prefill tokens/s |", "|---:|---:|---:|"]
    out += [f"| {r['prompt_tokens']} | {statistics.median(r['prompt_ms']):.2f} | "
            f"{r['tokens_per_s']:,.0f} |" for r in doc["prefill"]]
    out += ["", "| streams | prompt tokens | generated | step ms (median) | model ms | "
            "tokens/s (wall, median) | server CPU cores (median) | fitted |",
            "|---:|---:|---:|---:|---:|---:|---:|---|"]
    out += [f"| {r['streams']} | {r['prompt_tokens']} | {r['predicted']} | "
            f"{r['step_ms_median']:.4f} | {r['model_ms']:.4f} | "
            f"{statistics.median(r['wall_tokens_per_s']):,.0f} | "
            f"{_median(r.get('server_cores')):.2f} | "
            f"{'yes' if r['fitted'] else 'no (check)'} |" for r in doc["decode"]]
    return "\n".join(out) + "\n"
