"""Tests for workers.provision: lookup order, cache layout, backend detection, build plumbing.

No real build runs here: every "llama-server", "nvcc" and build command below is a fake — a tiny
shell script written into tmp_path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from workers import provision
from workers.provision import (
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    ProvisionError,
    cache_root,
    cached_binary_path,
    detect_backend,
    ensure_llama_server,
    find_llama_server,
    llama_server_version,
)


def make_fake_exe(path: Path, body: str = "exit 0") -> Path:
    """Write a fake executable (a shell script) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Cache in tmp_path, no $LLAMA_SERVER, and a PATH holding only an empty fake bin dir."""
    cache = tmp_path / "cache"
    path_dir = tmp_path / "pathbin"
    path_dir.mkdir()
    monkeypatch.setenv("LLAMA_GATEWAY_CACHE", str(cache))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(path_dir))
    return tmp_path


# ------------------------------------------------------------------------------------- cache paths


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_GATEWAY_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("LLAMA_GATEWAY_CACHE")
    assert cache_root() == tmp_path / "xdg" / "llama-gateway"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "llama-gateway"


def test_cached_binary_path_keyed_by_version_commit_backend(isolated, monkeypatch):
    monkeypatch.setattr(provision, "cpu_build_flags", lambda: None)  # a non-x86 machine
    cpu = cached_binary_path("cpu")
    cuda = cached_binary_path("cuda")
    assert cpu == (
        isolated / "cache" / "llama-server"
        / f"{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_CPP_COMMIT}-cpu-native" / "bin" / "llama-server"
    )
    assert cpu != cuda
    assert cuda.parent.parent.name == "0.3.36-0c1e570-cuda-native"


_CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
flags\t\t: {flags}

processor\t: 1
flags\t\t: {flags}
"""
_ZEN2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2"
_SAPPHIRE_RAPIDS = (_ZEN2 + " avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni"
                    " avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16")


def test_cpu_build_flags_name_this_cpus_instruction_sets_and_never_amx():
    """The x86 build names the instruction sets /proc/cpuinfo reports instead of
    ``-march=native``, and leaves AMX out: with -march=native on a host reporting AMX, a q4_0
    model's llama-server died of SIGILL (CI, 2026-12-01) while f32 and f16 ones ran."""
    zen2 = provision.cpu_build_flags(_CPUINFO.format(vendor="AuthenticAMD", flags=_ZEN2))
    assert {n for n, on in zen2.items() if on} == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C"}
    spr = provision.cpu_build_flags(_CPUINFO.format(vendor="GenuineIntel", flags=_SAPPHIRE_RAPIDS))
    assert spr["GGML_AVX512"] and spr["GGML_AVX512_VNNI"] and spr["GGML_AVX_VNNI"]
    assert not any(spr[n] for n in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    # AVX-512 needs all five of its parts, as ggml's GGML_AVX512 turns on all five
    partial = provision.cpu_build_flags(_CPUINFO.format(vendor="x", flags=_ZEN2 + " avx512f"))
    assert not partial["GGML_AVX512"]
    # every option is given: with GGML_NATIVE=OFF ggml's defaults turn AVX2, FMA, F16C on
    old = provision.cpu_build_flags(_CPUINFO.format(vendor="x", flags="fpu sse sse2 sse4_2"))
    assert set(old) == set(provision.X86_ISA_OPTIONS)
    assert [n for n, on in old.items() if on] == ["GGML_SSE42"]
    assert provision.cpu_build_flags("processor : 0\n") is None  # no flags line: native


def test_configure_args_name_the_isa_and_the_cache_key_follows_it(isolated, monkeypatch):
    """The CPU's instruction sets are part of the cache key: a cache moved to a CPU without
    them (tester R: it crash-looped) is not found there and is built again."""
    zen2 = provision.cpu_build_flags(_CPUINFO.format(vendor="AuthenticAMD", flags=_ZEN2))
    spr = provision.cpu_build_flags(_CPUINFO.format(vendor="GenuineIntel", flags=_SAPPHIRE_RAPIDS))
    monkeypatch.setattr(provision, "cpu_build_flags", lambda: spr)
    args = provision._cmake_configure_args(Path("/src"), Path("/build"), "cpu")
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_NATIVE=ON" not in args
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AMX_INT8=OFF" in args
    on_spr = make_fake_exe(cached_binary_path("cpu"))
    assert find_llama_server(backend="cpu") == on_spr
    monkeypatch.setattr(provision, "cpu_build_flags", lambda: zen2)
    assert "-DGGML_AVX512=OFF" in provision._cmake_configure_args(
        Path("/src"), Path("/build"), "cpu")
    assert cached_binary_path("cpu") != on_spr
    assert find_llama_server(backend="cpu") is None
    monkeypatch.setattr(provision, "cpu_build_flags", lambda: None)
    assert "-DGGML_NATIVE=ON" in provision._cmake_configure_args(
        Path("/src"), Path("/build"), "cpu")


# ------------------------------------------------------------------------------------ lookup order


def test_lookup_order_config_env_path_cache(isolated, monkeypatch):
    fake_cached = make_fake_exe(cached_binary_path("cpu"))
    fake_on_path = make_fake_exe(isolated / "pathbin" / "llama-server")
    fake_env = make_fake_exe(isolated / "env" / "llama-server")
    fake_configured = make_fake_exe(isolated / "configured" / "llama-server")
    monkeypatch.setenv("LLAMA_SERVER", str(fake_env))

    assert find_llama_server(str(fake_configured), backend="cpu") == fake_configured
    assert find_llama_server(None, backend="cpu") == fake_env
    monkeypatch.delenv("LLAMA_SERVER")
    assert find_llama_server(None, backend="cpu") == fake_on_path
    fake_on_path.unlink()
    assert find_llama_server(None, backend="cpu") == fake_cached
    assert ensure_llama_server(backend="cpu", allow_build=False) == fake_cached
    fake_cached.unlink()
    assert find_llama_server(None, backend="cpu") is None


def test_cache_lookup_uses_backend(isolated):
    fake_cuda = make_fake_exe(cached_binary_path("cuda"))
    assert find_llama_server(backend="cpu") is None
    assert find_llama_server(backend="cuda") == fake_cuda


def test_a_cache_of_another_user_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch):
    """A build that root made (mode 0700) in a cache the service user was then given: looking
    for the cached binary raised PermissionError, a traceback out of ``serve``,
    ``check-config`` and ``install-llama-server`` (a fresh tester's find). As root, the lookup
    runs in a forked child that has become ``nobody``."""
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="lgw-perm-"))
    try:
        top.chmod(0o755)
        monkeypatch.setenv("LLAMA_GATEWAY_CACHE", str(top / "cache"))
        monkeypatch.delenv("LLAMA_SERVER", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
        exe = make_fake_exe(cached_binary_path("cpu"))
        for d in (top / "cache", exe.parents[2]):
            d.chmod(0o755)
        exe.parents[1].chmod(0o700)  # the build's own folder: its owner's only
        if os.getuid() != 0:
            exe.parents[1].chmod(0o000)
            with pytest.raises(ProvisionError) as e:
                find_llama_server(backend="cpu")
            msg = str(e.value)
        else:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: nobody, as a service user without access
                os.close(r)
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    try:
                        find_llama_server(backend="cpu")
                        out = b"no error"
                    except ProvisionError as err:
                        out = b"ProvisionError: " + str(err).encode()
                    except BaseException as err:  # noqa: BLE001 - reported to the parent
                        out = f"{type(err).__name__}: {err}".encode()
                    os.write(w, out)
                finally:
                    os._exit(0)
            os.close(w)
            out = b""
            while chunk := os.read(r, 65536):
                out += chunk
            os.waitpid(pid, 0)
            assert out.startswith(b"ProvisionError: "), out
            msg = out.decode()
        assert f"cannot look at the cached llama-server {exe}" in msg and "chown" in msg, msg
    finally:
        for d in (top / "cache" / "llama-server").glob("*"):
            d.chmod(0o755)
        import shutil
        shutil.rmtree(top, ignore_errors=True)


def test_configured_path_missing_raises(isolated):
    make_fake_exe(isolated / "pathbin" / "llama-server")  # must not be used as a fallback
    missing = isolated / "nope" / "llama-server"
    with pytest.raises(ProvisionError, match=str(missing)):
        find_llama_server(str(missing))


def test_configured_path_not_executable_raises(isolated):
    not_exe = isolated / "llama-server"
    not_exe.write_text("not a program")
    not_exe.chmod(0o644)
    with pytest.raises(ProvisionError, match="not executable"):
        find_llama_server(str(not_exe))


def test_env_path_missing_raises(isolated, monkeypatch):
    missing = isolated / "gone" / "llama-server"
    monkeypatch.setenv("LLAMA_SERVER", str(missing))
    with pytest.raises(ProvisionError, match="LLAMA_SERVER"):
        find_llama_server()


def test_ensure_without_build_explains_what_to_do(isolated):
    with pytest.raises(ProvisionError) as exc:
        ensure_llama_server(backend="cpu", allow_build=False)
    msg = str(exc.value)
    assert "llama-gateway install-llama-server" in msg
    assert "llama_server.binary" in msg


# --------------------------------------------------------------------------------- backend detection


class _FakeNvml:
    """A fake pynvml module."""

    def __init__(self, init_error: Exception | None = None, count: int = 1, cap=(8, 6)):
        self.init_error = init_error
        self.count = count
        self.cap = cap

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self.cap


def test_detect_backend_cpu_without_driver(isolated, monkeypatch):
    import pynvml

    make_fake_exe(isolated / "pathbin" / "nvcc")  # the toolkit is "installed"

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert detect_backend() == "cpu"


def test_detect_backend_cuda_needs_nvcc_and_a_device(isolated, monkeypatch):
    import sys

    make_fake_exe(isolated / "pathbin" / "nvcc")
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(count=2))
    assert detect_backend() == "cuda"
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(count=0))
    assert detect_backend() == "cpu"
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(init_error=OSError("boom")))
    assert detect_backend() == "cpu"
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(count=1))
    monkeypatch.setattr(provision, "_find_nvcc", lambda: None)
    assert detect_backend() == "cpu"


def test_cuda_configure_args_use_present_architectures(isolated, monkeypatch):
    import sys

    nvcc = make_fake_exe(isolated / "pathbin" / "nvcc")
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(cap=(9, 0)))
    args = provision._cmake_configure_args(Path("/src"), Path("/build"), "cuda")
    assert "-DGGML_CUDA=ON" in args
    assert f"-DCMAKE_CUDA_COMPILER={nvcc}" in args
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    cpu_args = provision._cmake_configure_args(Path("/src"), Path("/build"), "cpu")
    assert "-DGGML_CUDA=ON" not in cpu_args
    for flag in ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
                 "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"):
        assert flag in cpu_args
    with pytest.raises(ProvisionError):
        provision._cmake_configure_args(Path("/src"), Path("/build"), "rocm")


def test_cuda_build_without_a_visible_gpu_targets_common_architectures(isolated, monkeypatch):
    """On a build host with nvcc and no GPU llama.cpp's default ("native") fails: the build
    targets the common architectures, or CMake's own ``CUDAARCHS`` when the operator set it
    (a fresh tester's find)."""
    import sys

    make_fake_exe(isolated / "pathbin" / "nvcc")
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(count=0))
    monkeypatch.delenv("CUDAARCHS", raising=False)
    args = provision._cmake_configure_args(Path("/src"), Path("/build"), "cuda")
    assert f"-DCMAKE_CUDA_ARCHITECTURES={provision.PORTABLE_CUDA_ARCHS}" in args
    monkeypatch.setenv("CUDAARCHS", "89")
    args = provision._cmake_configure_args(Path("/src"), Path("/build"), "cuda")
    assert not [a for a in args if a.startswith("-DCMAKE_CUDA_ARCHITECTURES")]


# ----------------------------------------------------------------------------- build plumbing (fakes)


def test_build_progress_logged_once_per_percent(tmp_path):
    fake_build = make_fake_exe(
        tmp_path / "fake-build",
        "echo '[  0%] Building C object a.o'\n"
        "echo '[  0%] Building C object b.o'\n"
        "echo 'warning: something'\n"
        "echo '[ 50%] Linking CXX shared library libllama.so'\n"
        "echo '[100%] Built target llama-server'",
    )
    log_path = tmp_path / "build.log"
    with capture_logs() as logs:
        provision._run_logged([str(fake_build)], log_path, "build", progress=True)
    progress = [e["percent"] for e in logs if e["event"] == "llama_server.build.progress"]
    assert progress == [0, 50, 100]
    assert "warning: something" in log_path.read_text()


def test_build_failure_raises_with_log_tail(tmp_path):
    fake_build = make_fake_exe(tmp_path / "fake-build", "echo 'error: it broke' >&2\nexit 2")
    with pytest.raises(ProvisionError) as exc:
        provision._run_logged([str(fake_build)], tmp_path / "build.log", "build", progress=True)
    assert "error: it broke" in str(exc.value)
    assert "exit 2" in str(exc.value)


def test_build_failure_quotes_the_error_above_a_long_tail(tmp_path):
    """A configure step whose CMake error is followed by more than the tail's 60 lines (git's
    warnings about the sdist having no repository, then CMake's own) quotes the error block
    first (a CUDA configure failure was buried under git warnings); git's ``fatal:`` lines are
    not quoted as errors."""
    noise = "\n".join(f"echo 'fatal: not a git repository (or any parent up to /): {i}'"
                      for i in range(80))
    fake = make_fake_exe(tmp_path / "fake-cmake", (
        "echo '-- The C compiler identification is GNU 13.2.0'\n"
        "echo 'CMake Error at ggml/src/ggml-cuda/CMakeLists.txt:183 (message):'\n"
        "echo '  CUDA Toolkit not found'\n"
        "echo ''\n"
        "echo '-- Configuring incomplete, errors occurred!'\n"
        f"{noise}\nexit 1"))
    with pytest.raises(ProvisionError) as exc:
        provision._run_logged([str(fake)], tmp_path / "build.log", "configure")
    msg = str(exc.value)
    head, _, tail = msg.partition("--- last lines ---")
    assert "--- errors ---\nCMake Error at ggml/src/ggml-cuda/CMakeLists.txt:183 (message):\n" \
        "  CUDA Toolkit not found\n" in head, msg
    assert "fatal: not a git" not in head and "CUDA Toolkit not found" not in tail, msg
    # an error already in the tail is not quoted twice
    with pytest.raises(ProvisionError) as exc:
        provision._run_logged([str(make_fake_exe(tmp_path / "short", "echo 'error: it broke'\nexit 2"))],
                              tmp_path / "b2.log", "build")
    assert "--- errors ---" not in str(exc.value) and "error: it broke" in str(exc.value)


def test_build_returns_existing_cached_binary_without_building(isolated, monkeypatch):
    fake_cached = make_fake_exe(cached_binary_path("cpu"))
    monkeypatch.setattr(provision.shutil, "which", lambda name: "/usr/bin/cmake")

    def must_not_run(*a, **k):
        raise AssertionError("no build step may run when the cache already holds the binary")

    monkeypatch.setattr(provision, "_run_logged", must_not_run)
    monkeypatch.setattr(provision, "_download_sdist", must_not_run)
    assert provision.build_llama_server("cpu") == fake_cached


def test_llama_server_version_reads_stderr(tmp_path):
    fake = make_fake_exe(
        tmp_path / "llama-server",
        "echo 'load_backend: loaded CPU backend' >&2\n"
        "echo 'version: 1 (0c1e570)' >&2\n"
        "echo 'built with GNU 12.2.0 for Linux x86_64' >&2",
    )
    assert llama_server_version(fake) == "version: 1 (0c1e570)"


def test_llama_server_version_without_version_line_raises(tmp_path):
    fake = make_fake_exe(tmp_path / "llama-server", "echo nothing here; exit 1")
    with pytest.raises(ProvisionError):
        llama_server_version(fake)


def test_check_runs_timeout_kills_the_binary_and_its_children(tmp_path):
    """A FAKE wrapper that starts a child and never answers `--version`: check_runs gives up
    after its timeout and kills the whole process group, child included (subprocess.run's
    timeout killed only the wrapper and left the child running)."""
    import psutil

    pid_file = tmp_path / "child.pid"
    fake = make_fake_exe(tmp_path / "llama-server",
                         f"sleep 300 & echo $! > {pid_file}\nwait")
    with pytest.raises(ProvisionError, match=r"gave no answer within 1 s"):
        provision.check_runs(fake, timeout_s=1)
    child = int(pid_file.read_text())
    gone = not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert gone, "the wrapper's child outlived the timeout"


def test_llama_server_version_timeout_raises(tmp_path):
    fake = make_fake_exe(tmp_path / "llama-server", "sleep 300")
    with pytest.raises(ProvisionError, match="could not run"):
        llama_server_version(fake, timeout_s=0.5)


def test_real_cached_binary_version_if_present():
    """If a real cached build exists on this machine, it reports the pinned commit."""
    real = find_llama_server(backend="cpu") if not os.environ.get("LLAMA_SERVER") else None
    if real is None or real != cached_binary_path("cpu"):
        pytest.skip("no cached llama-server build on this machine")
    assert LLAMA_CPP_COMMIT in llama_server_version(real)


def _fake_sdist(path: Path) -> str:
    """A fake, tiny llama-cpp-python sdist holding only vendor/llama.cpp/CMakeLists.txt; returns sha256."""
    import hashlib
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tf:
        data = b"# fake llama.cpp\n"
        info = tarfile.TarInfo(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


# A fake cmake: "configure" records its arguments; "--build" prints progress and writes a fake
# bin/llama-server (printing a version line) plus a fake shared library beside it.
FAKE_CMAKE = r"""
PATH="$PATH:/usr/bin:/bin"
if [ "$1" = "--build" ]; then
  echo '[  5%] Building C object ggml.c.o'
  echo '[ 50%] Linking CXX shared library ../../bin/libggml.so'
  mkdir -p "$2/bin"
  printf '#!/bin/sh\necho "version: 1 (0c1e570)" >&2\n' > "$2/bin/llama-server"
  chmod +x "$2/bin/llama-server"
  echo fake > "$2/bin/libggml.so"
  echo '[100%] Built target llama-server'
else
  echo "$@" > "$CONFIGURE_ARGS_FILE"
fi
"""


def test_build_with_fake_cmake_installs_into_cache(isolated, monkeypatch):
    src = cache_root() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    monkeypatch.setattr(provision, "LLAMA_CPP_PYTHON_SDIST_SHA256", _fake_sdist(src))
    make_fake_exe(isolated / "pathbin" / "cmake", FAKE_CMAKE)
    monkeypatch.setenv("CONFIGURE_ARGS_FILE", str(isolated / "configure-args"))

    with capture_logs() as logs:
        binary = provision.build_llama_server("cpu", jobs=3)

    assert binary == cached_binary_path("cpu")
    assert (binary.parent / "libggml.so").is_file(), "the whole bin/ folder is kept"
    assert llama_server_version(binary) == "version: 1 (0c1e570)"
    configure = (isolated / "configure-args").read_text()
    assert "-DLLAMA_BUILD_SERVER=ON" in configure and "-DGGML_CUDA=ON" not in configure
    assert [e["percent"] for e in logs if e["event"] == "llama_server.build.progress"] == [5, 50, 100]
    assert not (cache_root() / "build").exists() or not any((cache_root() / "build").iterdir())
    leftovers = [p.name for p in binary.parent.parent.parent.iterdir() if p.name.startswith(".") and "tmp" in p.name]
    assert leftovers == []
    # Found through the normal lookup now, and a second build is a no-op.
    assert find_llama_server(backend="cpu") == binary
    assert provision.build_llama_server("cpu") == binary


def test_build_failure_leaves_no_cache_entry(isolated, monkeypatch):
    src = cache_root() / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    monkeypatch.setattr(provision, "LLAMA_CPP_PYTHON_SDIST_SHA256", _fake_sdist(src))
    make_fake_exe(
        isolated / "pathbin" / "cmake",
        'if [ "$1" = "--build" ]; then echo "[ 10%] x"; echo "fatal error: foo.h" >&2; exit 1; fi',
    )
    with pytest.raises(ProvisionError, match="fatal error: foo.h"):
        provision.build_llama_server("cpu")
    assert not cached_binary_path("cpu").exists()
    assert find_llama_server(backend="cpu") is None


def test_download_uses_pip_when_tarball_missing(isolated, monkeypatch):
    import sys

    staged = isolated / "staged.tar.gz"
    sha = _fake_sdist(staged)
    monkeypatch.setattr(provision, "LLAMA_CPP_PYTHON_SDIST_SHA256", sha)
    # A fake python: "python -m pip download ... -d DIR" copies the staged tarball into DIR.
    fake_python = make_fake_exe(
        isolated / "fake-python",
        'PATH="$PATH:/usr/bin:/bin"\n'
        f'echo "$@" > {isolated}/pip-args\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-d" ]; then dir="$2"; fi; shift; done\n'
        f'cp {staged} "$dir/llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"',
    )
    monkeypatch.setattr(sys, "executable", str(fake_python))
    tarball = provision._download_sdist(isolated / "src", isolated / "dl.log")
    assert tarball.is_file()
    args = (isolated / "pip-args").read_text()
    assert "-m pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36" in args
    # A tarball whose hash does not match is rejected.
    monkeypatch.setattr(provision, "LLAMA_CPP_PYTHON_SDIST_SHA256", "0" * 64)
    with pytest.raises(ProvisionError, match="sha256"):
        provision._download_sdist(isolated / "src2", isolated / "dl.log")
