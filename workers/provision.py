"""Find or build the ``llama-server`` binary that the gateway's workers run.

Lookup order (``find_llama_server``): an explicit configured path, then ``$LLAMA_SERVER``, then
``llama-server`` on ``PATH``, then a binary this module built earlier into the cache.

Building (``build_llama_server``) needs no network beyond PyPI: the sdist of
``llama-cpp-python==LLAMA_CPP_PYTHON_VERSION`` carries the complete llama.cpp tree (commit
``LLAMA_CPP_COMMIT``) under ``vendor/llama.cpp``. The result, ``bin/llama-server`` plus the shared
libraries beside it, is cached outside the checkout under
``cache_root()/llama-server/<version>-<commit>-<backend>-<cpu>/bin/`` so later runs on the same
machine reuse it; ``<cpu>`` names the x86 instruction sets the build targets (``cpu_build_flags``),
so a cache moved to a CPU without them is built again instead of crashing the workers.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gateway.logs import get_logger

log = get_logger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e570"
# sha256 of llama_cpp_python-0.3.36.tar.gz as served by PyPI.
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

_SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
_PROGRESS_RE = re.compile(r"^\[\s*(\d{1,3})%\]")
_LOG_TAIL_LINES = 60
#: Lines of a failed build step that say what failed (CMake's ``CMake Error at …`` block, a
#: compiler's ``error:``), quoted before the log's tail: with no CUDA toolkit the configure
#: step's cause was above 60 lines of git's warnings about the sdist having no repository.
_ERROR_RE = re.compile(r"CMake Error|Could NOT find|No CMAKE_\w+_COMPILER|\berror:|"
                       r"\bError \d+\b|fatal error", re.IGNORECASE)
_GIT_NOISE_RE = re.compile(r"^(fatal|warning): .*(git|repository)", re.IGNORECASE)
_ERROR_LINES = 24  # at most this many quoted lines (each match and the 3 lines after it)


class ProvisionError(RuntimeError):
    """llama-server could not be found, verified or built."""


# --------------------------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """The gateway's cache directory, outside the checkout.

    ``$LLAMA_GATEWAY_CACHE`` if set, else ``$XDG_CACHE_HOME/llama-gateway``, else
    ``~/.cache/llama-gateway``.
    """
    explicit = os.environ.get("LLAMA_GATEWAY_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "llama-gateway"
    return Path.home() / ".cache" / "llama-gateway"


def _build_key(backend: str) -> str:
    flags = cpu_build_flags()
    if flags is None:  # -march=native: the build machine's own CPU
        return f"{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_CPP_COMMIT}-{backend}-native"
    on = ",".join(sorted(name for name, enabled in flags.items() if enabled))
    tag = hashlib.sha256(on.encode()).hexdigest()[:8]
    return f"{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_CPP_COMMIT}-{backend}-x86-{tag}"


def cached_binary_path(backend: str) -> Path:
    """Where a binary built by ``build_llama_server(backend)`` lives, keyed by version, backend
    and the CPU instruction sets it targets (``cpu_build_flags``)."""
    return cache_root() / "llama-server" / _build_key(backend) / "bin" / "llama-server"


# ----------------------------------------------------------------------------------------- CPU ISA

#: ggml's CMake options for x86 instruction sets (ggml/CMakeLists.txt, ggml-cpu/CMakeLists.txt of
#: the pinned commit) and the /proc/cpuinfo flags each needs: all of them present turns it on.
#: AMX (GGML_AMX_TILE/INT8/BF16) is never turned on: ggml's AMX kernels take q4_0, q4_1, q8_0
#: and the k-quants, and with ``-march=native`` on a host whose CPU reports AMX a q4_0 model's
#: llama-server died of SIGILL while f32 and f16 models ran (CI's fresh-clone run of 2026-12-01,
#: ``test_a_bigger_shape_runs_in_llama_server[q4_0]``, a Firecracker guest). Public reports show
#: the same: "AMX is not ready to be used!" then "Illegal instruction" in a container
#: (unslothai/unsloth#4535), and a SIGILL on a guest whose CPUID reports AMX that the hypervisor
#: does not enable (ggml-org/llama.cpp#28756, #28328).
X86_ISA_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
    "GGML_AMX_TILE": (),
    "GGML_AMX_INT8": (),
    "GGML_AMX_BF16": (),
}


def _cpuinfo_flags(text: str) -> set[str] | None:
    """The ``flags`` of the first processor in a /proc/cpuinfo text (None when it has none)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return None


def cpu_build_flags(cpuinfo: str | None = None) -> dict[str, bool] | None:
    """ggml's x86 ISA options (``X86_ISA_OPTIONS`` name -> on) for a build on this CPU, read off
    ``cpuinfo`` (default: /proc/cpuinfo), with ``GGML_NATIVE=OFF``. Every option is given, on or
    off (with NATIVE off, ggml's own defaults turn AVX2, FMA and others on). None where the
    machine is not x86-64 or /proc/cpuinfo has no flags: the build is then ``-march=native``."""
    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = _cpuinfo_flags(cpuinfo)
    if flags is None:
        return None
    return {name: bool(needs) and all(f in flags for f in needs)
            for name, needs in X86_ISA_OPTIONS.items()}


# ------------------------------------------------------------------------------------------- backend


def _find_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    fallback = Path("/usr/local/cuda/bin/nvcc")
    if fallback.is_file() and os.access(fallback, os.X_OK):
        return str(fallback)
    return None


def _nvidia_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the NVIDIA cards present; empty if there is no usable driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        caps = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            caps.append((int(major), int(minor)))
        return caps
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvidia_driver_usable() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass
    except Exception:
        return False


def detect_backend() -> str:
    """Which llama.cpp backend to build and use on this machine: ``"cuda"`` or ``"cpu"``.

    Rule: ``"cuda"`` only when BOTH hold:
      1. the CUDA compiler is present (``nvcc`` on ``PATH`` or ``/usr/local/cuda/bin/nvcc``), and
      2. an NVIDIA driver is usable: ``pynvml.nvmlInit()`` succeeds and reports at least one device.
    Anything else (no nvcc, no driver, no card, any exception from NVML) gives ``"cpu"``. A machine
    with the CUDA toolkit installed but no GPU (a typical dev box or CI runner) is therefore ``"cpu"``.
    """
    if _find_nvcc() is None:
        return "cpu"
    return "cuda" if _nvidia_driver_usable() else "cpu"


# -------------------------------------------------------------------------------------------- lookup


def _check_executable(path: Path, source: str) -> Path:
    if not path.is_file():
        raise ProvisionError(f"llama-server from {source} does not exist or is not a file: {path}")
    if not os.access(path, os.X_OK):
        raise ProvisionError(f"llama-server from {source} is not executable: {path}")
    return path


def find_llama_server(configured: str | None = None, backend: str | None = None) -> Path | None:
    """Locate an existing llama-server binary; build nothing.

    Order: ``configured`` (e.g. ``llama_server.binary`` from the config), then ``$LLAMA_SERVER``,
    then ``llama-server`` on ``PATH``, then the cached build for ``backend`` (default
    ``detect_backend()``). An explicit configured or environment path that is missing or not
    executable raises ``ProvisionError`` rather than silently falling through. Returns ``None`` when
    nothing is found.
    """
    if configured:
        path = _check_executable(Path(configured).expanduser(), "config (llama_server.binary)")
        log.debug("llama_server.found", path=str(path), source="config")
        return path
    env = os.environ.get("LLAMA_SERVER")
    if env:
        path = _check_executable(Path(env).expanduser(), "$LLAMA_SERVER")
        log.debug("llama_server.found", path=str(path), source="env")
        return path
    which = shutil.which("llama-server")
    if which:
        log.debug("llama_server.found", path=which, source="path")
        return Path(which)
    cached = cached_binary_path(backend or detect_backend())
    try:
        found = cached.is_file() and os.access(cached, os.X_OK)
    except PermissionError:  # a build made by another user (root) in a shared cache
        raise ProvisionError(
            f"cannot look at the cached llama-server {cached} (permission denied for user "
            f"{_user()}); give this user the cache, e.g. chown -R it, or set "
            "$LLAMA_GATEWAY_CACHE to a directory of its own") from None
    if found:
        log.debug("llama_server.found", path=str(cached), source="cache")
        return cached
    return None


def _user() -> str:
    """This process's user name (its uid when it has none)."""
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_name
    except (KeyError, ImportError):
        return str(os.getuid())


def ensure_llama_server(
    configured: str | None = None, backend: str | None = None, allow_build: bool = True
) -> Path:
    """Find llama-server, else build it into the cache (if ``allow_build``), else raise."""
    found = find_llama_server(configured, backend)
    if found is not None:
        return found
    backend = backend or detect_backend()
    if not allow_build:
        raise ProvisionError(
            "llama-server not found (looked at llama_server.binary, $LLAMA_SERVER, PATH and "
            f"{cached_binary_path(backend)}). Run `llama-gateway install-llama-server` to build it "
            "from source, or set `llama_server.binary` in the config (or $LLAMA_SERVER) to an "
            "existing llama-server."
        )
    return build_llama_server(backend)


def _run_version(binary: Path, timeout_s: float,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``binary --version`` in its own process group; return its exit status and output.

    Raises ``subprocess.TimeoutExpired`` after ``timeout_s`` seconds, with the whole group
    killed first (a wrapper script's children too, which ``subprocess.run`` would leave
    running), and ``OSError`` when it cannot be executed at all. ``env``: its environment
    (default: this process's).
    """
    proc = subprocess.Popen([str(binary), "--version"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def llama_server_version(binary: Path, timeout_s: float = 30,
                         env: dict[str, str] | None = None) -> str:
    """The version line of ``binary --version``, e.g. ``version: 1 (0c1e570)``.

    llama-server prints it on stderr; both streams are searched. Raises ProvisionError when it
    cannot be run within ``timeout_s`` seconds or prints no version line. ``env``: the
    environment it runs with (default: this process's).
    """
    try:
        proc = _run_version(binary, timeout_s, env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProvisionError(f"could not run {binary} --version: {exc}") from exc
    text = (proc.stderr or "") + "\n" + (proc.stdout or "")
    for line in text.splitlines():
        if "version" in line.lower():
            return line.strip()
    raise ProvisionError(
        f"{binary} --version printed no version line (exit {proc.returncode}): {text.strip()[-2000:]}"
    )


def check_runs(binary: Path, timeout_s: float = 30) -> None:
    """Raise ProvisionError (``<binary> does not run: <why>``) when ``binary --version`` cannot
    be executed or exits non-zero: a llama-server copied without its shared libraries (the
    dynamic loader's ``error while loading shared libraries: …``, exit 127), a build for
    another CPU (SIGILL) or a wrapper that fails. ``check-config`` found such a binary fine and
    every worker start then failed. ``why`` is the last line the binary wrote (stderr, else
    stdout) or its exit status; ``timeout_s`` bounds the run (seconds), after which the binary
    and everything it started are killed."""
    try:
        proc = _run_version(binary, timeout_s)
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"{binary} does not run: `--version` gave no answer within "
                             f"{timeout_s:g} s") from None
    except OSError as exc:
        raise ProvisionError(f"{binary} does not run: {exc.strerror or exc}") from None
    if proc.returncode == 0:
        return
    lines = [ln.strip() for ln in ((proc.stderr or "") or (proc.stdout or "")).splitlines()
             if ln.strip()]
    status = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
              else f"exit status {proc.returncode}")
    why = f"{lines[-1]} ({status})" if lines else status
    raise ProvisionError(f"{binary} does not run: `--version` ended with {why}")


# --------------------------------------------------------------------------------------------- build


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("llama_server.build.waiting_for_lock", lock=str(path))
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tail(path: Path, n: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(deque(fh, maxlen=n))
    except OSError:
        return ""


def _error_lines(lines: list[str]) -> str:
    """The lines of a failed step's output that name its errors (``_ERROR_RE``, each with the
    3 lines after it, as CMake's message continues on indented lines; git's own ``fatal:`` /
    ``warning:`` lines are not errors here), at most ``_ERROR_LINES``; "" when none."""
    keep: list[int] = []
    for i, line in enumerate(lines):
        if _ERROR_RE.search(line) and not _GIT_NOISE_RE.match(line):
            keep.extend(j for j in range(i, min(i + 4, len(lines))) if not keep or j > keep[-1])
        if len(keep) >= _ERROR_LINES:
            break
    return "".join(lines[j] for j in keep[:_ERROR_LINES])


def _run_logged(cmd: list[str], log_path: Path, step: str, *, progress: bool = False) -> None:
    """Run ``cmd``, appending its output to ``log_path``; raise ProvisionError with the tail on failure.

    With ``progress``, ``[ NN%]`` lines from the build are logged as ``llama_server.build.progress``
    (once per change of percentage).
    """
    log.info("llama_server.build.step", step=step, cmd=" ".join(cmd))
    last_pct = -1
    started = time.monotonic()
    with open(log_path, "a", errors="replace") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                bufsize=1,
            )
        except OSError as exc:
            raise ProvisionError(f"llama-server build step {step!r} could not start: {exc}") from exc
        assert proc.stdout is not None
        seen: deque[str] = deque(maxlen=20000)  # this step's output, for _error_lines
        for line in proc.stdout:
            out.write(line)
            seen.append(line)
            if progress:
                m = _PROGRESS_RE.match(line)
                if m:
                    pct = int(m.group(1))
                    if pct != last_pct:
                        last_pct = pct
                        log.info(
                            "llama_server.build.progress",
                            percent=pct,
                            elapsed_s=round(time.monotonic() - started, 1),
                        )
        rc = proc.wait()
        out.write(f"# exit {rc}\n")
    if rc != 0:
        tail = _tail(log_path)
        errors = _error_lines(list(seen))
        log.error("llama_server.build.failed", step=step, rc=rc, log=str(log_path),
                  errors=errors.splitlines()[:4] or None)
        quoted = f"--- errors ---\n{errors}" if errors and errors not in tail else ""
        raise ProvisionError(
            f"llama-server build step {step!r} failed (exit {rc}); full log: {log_path}\n"
            f"{quoted}--- last lines ---\n{tail}"
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_sdist(src_dir: Path, log_path: Path) -> Path:
    """The llama-cpp-python sdist tarball in ``src_dir``, downloaded with pip if not already there.

    The tarball is checked against ``LLAMA_CPP_PYTHON_SDIST_SHA256`` whether reused or downloaded.
    pip runs with its default build isolation: ``--no-build-isolation`` makes ``pip download`` fail
    unless the sdist's build backend (scikit-build-core) is installed in this environment, because
    pip prepares the sdist's metadata even when only downloading.
    """
    tarball = src_dir / f"{_SDIST_NAME}.tar.gz"
    if tarball.is_file():
        if _sha256(tarball) == LLAMA_CPP_PYTHON_SDIST_SHA256:
            log.info("llama_server.build.sdist_reused", path=str(tarball))
            return tarball
        log.warning("llama_server.build.sdist_corrupt", path=str(tarball))
        tarball.unlink()
    src_dir.mkdir(parents=True, exist_ok=True)
    _run_logged(
        [
            sys.executable, "-m", "pip", "download",
            "--no-binary", ":all:", "--no-deps",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(src_dir),
        ],
        log_path,
        "download",
    )
    if not tarball.is_file():
        raise ProvisionError(f"pip download did not produce {tarball}; see {log_path}")
    digest = _sha256(tarball)
    if digest != LLAMA_CPP_PYTHON_SDIST_SHA256:
        tarball.unlink()
        raise ProvisionError(
            f"downloaded {tarball.name} has sha256 {digest}, expected {LLAMA_CPP_PYTHON_SDIST_SHA256}"
        )
    log.info("llama_server.build.sdist_downloaded", path=str(tarball))
    return tarball


def _extract_llama_cpp(tarball: Path, src_dir: Path) -> Path:
    """Extract ``vendor/llama.cpp`` from the sdist (once) and return its directory."""
    root = src_dir / _SDIST_NAME
    llama_dir = root / "vendor" / "llama.cpp"
    if (llama_dir / "CMakeLists.txt").is_file():
        return llama_dir
    prefix = f"{_SDIST_NAME}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(prefix=f".{_SDIST_NAME}.", dir=src_dir))
    try:
        with tarfile.open(tarball) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise ProvisionError(f"{tarball} has no {prefix} tree")
            tf.extractall(tmp, members=members, filter="data")
        if root.exists():
            shutil.rmtree(root)
        os.rename(tmp / _SDIST_NAME, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("llama_server.build.extracted", path=str(llama_dir))
    return llama_dir


#: CUDA architectures a CUDA build targets on a build host with no visible GPU and no
#: ``CUDAARCHS`` in its environment (Turing, Ampere, Ada, Hopper): llama.cpp's default there
#: is "native", which fails without a GPU (a fresh tester's find).
PORTABLE_CUDA_ARCHS = "75;80;86;89;90"


def _cmake_configure_args(source: Path, build: Path, backend: str) -> list[str]:
    args = [
        "cmake", "-S", str(source), "-B", str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        # The sdist carries no git metadata: name the pinned commit, or --version says "unknown".
        f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}",
        "-DLLAMA_BUILD_NUMBER=1",
        # The binary finds its shared libraries beside itself ($ORIGIN), so bin/ can be moved.
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        "-DCMAKE_BUILD_RPATH=$ORIGIN",
    ]
    isa = cpu_build_flags()
    if isa is None:
        args.append("-DGGML_NATIVE=ON")
    else:  # this CPU's instruction sets, named (never AMX: see X86_ISA_OPTIONS)
        args.append("-DGGML_NATIVE=OFF")
        args += [f"-D{name}={'ON' if on else 'OFF'}" for name, on in isa.items()]
    if backend == "cuda":
        nvcc = _find_nvcc()
        if nvcc is None:
            raise ProvisionError("backend 'cuda' requested but nvcc was not found")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
        caps = sorted(set(_nvidia_compute_capabilities()))
        if os.environ.get("CUDAARCHS"):
            pass  # CMake's own variable: the operator's choice of architectures
        elif caps:
            archs = ";".join(f"{major}{minor}" for major, minor in caps)
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
        else:  # no GPU to build for ("native" fails without one): the common ones
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={PORTABLE_CUDA_ARCHS}")
    elif backend != "cpu":
        raise ProvisionError(f"unknown llama-server backend {backend!r} (expected 'cpu' or 'cuda')")
    return args


def build_llama_server(backend: str | None = None, jobs: int | None = None) -> Path:
    """Build llama-server from the llama-cpp-python sdist into the cache and return the binary.

    Takes a few minutes on a small CPU machine (about 4 on 2 cores), much longer for CUDA; progress
    is logged as ``llama_server.build.progress``. Concurrent callers serialise on a lock file in the
    cache; the second one finds the first one's result. On failure raises ``ProvisionError`` with
    the tail of the build log.
    """
    if shutil.which("cmake") is None:
        raise ProvisionError("building llama-server needs cmake (and a C/C++ compiler) on PATH")
    backend = backend or detect_backend()
    key = _build_key(backend)
    root = cache_root()
    final_bin = cached_binary_path(backend)
    final_dir = final_bin.parent.parent  # .../llama-server/<key>
    servers_dir = final_dir.parent
    servers_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1

    # One lock for every build in this cache: builds share the sdist download and its extracted tree.
    with _file_lock(servers_dir / ".build.lock"):
        if final_bin.is_file() and os.access(final_bin, os.X_OK):
            log.info("llama_server.build.cached", path=str(final_bin))
            return final_bin
        # Leftovers of builds that were killed half-way (we hold the lock, so nobody owns them).
        for stale in [*servers_dir.glob(f".{key}.tmp-*"), *(root / "src").glob(f".{_SDIST_NAME}.*")]:
            shutil.rmtree(stale, ignore_errors=True)
        log_path = servers_dir / f"build-{key}.log"
        log_path.write_text("")
        isa = cpu_build_flags()
        log.info("llama_server.build.start", backend=backend, jobs=jobs, log=str(log_path),
                 isa="native" if isa is None else " ".join(n for n, on in isa.items() if on))
        started = time.monotonic()

        src_dir = root / "src"
        tarball = _download_sdist(src_dir, log_path)
        source = _extract_llama_cpp(tarball, src_dir)
        build_dir = root / "build" / key
        if build_dir.exists():
            shutil.rmtree(build_dir)  # never reuse a half-configured tree from an interrupted build
        _run_logged(_cmake_configure_args(source, build_dir, backend), log_path, "configure")
        _run_logged(
            ["cmake", "--build", str(build_dir), "--config", "Release",
             "--target", "llama-server", "-j", str(jobs)],
            log_path, "build", progress=True,
        )
        built_bin = build_dir / "bin"
        if not (built_bin / "llama-server").is_file():
            raise ProvisionError(
                f"build finished but {built_bin / 'llama-server'} is missing; log: {log_path}\n"
                f"{_tail(log_path)}"
            )

        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=servers_dir))
        try:
            shutil.copytree(built_bin, tmp_dir / "bin", symlinks=True)
            # Drop the build tree first so the check below proves the copy finds its libraries.
            shutil.rmtree(build_dir, ignore_errors=True)
            try:
                version = llama_server_version(tmp_dir / "bin" / "llama-server")
            except ProvisionError as exc:
                raise ProvisionError(f"built llama-server does not run from the cache: {exc}") from exc
            if final_dir.exists():
                shutil.rmtree(final_dir)  # a broken leftover (no executable binary in it)
            os.rename(tmp_dir, final_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        log.info(
            "llama_server.build.done",
            path=str(final_bin),
            version=version,
            seconds=round(time.monotonic() - started, 1),
        )
        return final_bin
