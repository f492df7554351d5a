"""``llama-gateway`` command line.

Verbs:
  serve (default)          run the gateway on a config (default ./gateway.yaml)
  install-llama-server     find or build the llama-server binary now (shows build progress)
  demo-model               write the small offline demo GGUF
  check-config             validate a config file and print the worker plan
  status                   one row per worker of a running gateway (state, slots, KV, GPU…)
  worker drain|undrain|restart ID   admin actions on a running gateway (admin token)
  reload                   reload the running gateway's config file (admin token)
  hash-key [KEY|-]         print the SHA-256 to put in auth.keys[].sha256 (no KEY: a new
                           random key is generated and printed too; "-": read it from stdin)
  simulate                 simulated routing-quality comparison of scheduling policies
  calibrate                measure one real llama-server and write a simulator profile (JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from pathlib import Path

from gateway import __version__
from gateway.logs import configure, get_logger


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-gateway", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"llama-gateway {__version__}")
    sub = p.add_subparsers(dest="verb")
    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("-c", "--config", default=os.environ.get("LLAMA_GATEWAY_CONFIG", "gateway.yaml"))
    i = sub.add_parser("install-llama-server", help="find or build llama-server")
    i.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    i.add_argument("--jobs", type=int, default=None)
    i.add_argument("--force", action="store_true", help="build even if a binary is found")
    d = sub.add_parser("demo-model", help="write the offline demo GGUF (if missing)")
    d.add_argument("--path", default=None)
    d.add_argument("--force", action="store_true", help="write it again even if it exists")
    d.add_argument("--context-length", type=int, default=None, metavar="TOKENS",
                   help="write a demo model trained for TOKENS of context (GGUF "
                        "context_length; the built-in one has 4096) to --path, which is "
                        "required, even if that file exists; a model entry's 'context' is "
                        "capped by it")
    c = sub.add_parser("check-config", help="validate a config and show the worker plan")
    c.add_argument("-c", "--config", default="gateway.yaml")
    url_help = "gateway URL (default $LLAMA_GATEWAY_URL or http://127.0.0.1:11434)"
    tok_help = "admin token (default $LLAMA_GATEWAY_ADMIN_TOKEN)"
    st = sub.add_parser("status", help="show the workers of a running gateway")
    st.add_argument("--url", default=None, help=url_help)
    st.add_argument("--json", action="store_true", help="print the raw JSON")
    st.add_argument("--token", default=None, help=tok_help + "; needed when auth.keys is set")
    w = sub.add_parser("worker", help="drain, undrain or restart a worker")
    w.add_argument("action", choices=["drain", "undrain", "restart"])
    w.add_argument("worker", help="worker id, e.g. demo-cpu1")
    w.add_argument("--url", default=None, help=url_help)
    w.add_argument("--token", default=None, help=tok_help)
    r = sub.add_parser("reload", help="reload the running gateway's config file")
    r.add_argument("--url", default=None, help=url_help)
    r.add_argument("--token", default=None, help=tok_help)
    h = sub.add_parser("hash-key", help="hash an API key for auth.keys (or make a new one)")
    h.add_argument("key", nargs="?", default=None,
                   help='the key; "-" reads it from stdin; omitted: generate one')
    m = sub.add_parser("simulate", help="simulate scheduling policies on modelled GPUs")
    m.add_argument("--gpus", default="4,8", help="comma-separated fleet sizes")
    m.add_argument("--duration", type=float, default=120.0, help="simulated seconds per run")
    m.add_argument("--profile", default="rtx6000ada-llama8b-q4",
                   help="a built-in profile name or a calibration JSON file")
    m.add_argument("--png", default=None, help="write a plot of effective GPUs and TTFT p99")
    cal = sub.add_parser("calibrate", help="measure one real llama-server, fit a simulator profile")
    cal.add_argument("--out", default="docs/calibration/cpu-demo.json", help="JSON file to write")
    cal.add_argument("--name", default="cpu-demo", help="profile name")
    cal.add_argument("--slots", type=int, default=8, help="-np (rounds of more streams are skipped)")
    cal.add_argument("--context", type=int, default=4096, help="context tokens per slot")
    cal.add_argument("--threads", type=int, default=None,
                     help="-t (default: 1 on the CPU, llama-server's own choice with --gpu)")
    cal.add_argument("--gpu", type=int, default=None,
                     help="run the server on this GPU (NVML index, as CUDA_VISIBLE_DEVICES) as "
                          "the gateway runs a GPU worker; default: on the CPU")
    cal.add_argument("--repeats", type=int, default=7, help="rounds per measurement (median)")
    cal.add_argument("--binary", default=None, help="llama-server (default: as serve finds it)")
    cal.add_argument("--model", default=None, help="GGUF file (default: the demo model)")
    return p


def _why(e: OSError) -> str:
    """Why a file could not be written, in words: ``mkdir(parents=True, exist_ok=True)`` of a
    parent that is a regular file raises FileExistsError ("File exists"), which says it wrong."""
    if isinstance(e, FileExistsError):
        return f"{e.filename} is not a directory"
    return e.strerror or str(e)


def _gpu_problem(gpu: int | None) -> str | None:
    """Why ``calibrate --gpu`` cannot use that GPU (NVML, ``workers.gpu.detect_gpus``), or None."""
    if gpu is None:
        return None
    from workers.gpu import detect_gpus
    found = detect_gpus()
    if gpu in found:
        return None
    return (f"--gpu {gpu}: no NVIDIA GPU found (NVML)" if not found
            else f"--gpu {gpu}: NVML finds GPUs {', '.join(map(str, found))}")


def _calibrate(args, argv: list[str]) -> int:
    import orjson

    from gateway.config import INT32_MAX
    from gateway.inventory import GGUFFacts
    from gateway.simulator.measure import calibrate, table
    from workers.demo_model import ensure_demo_model
    from workers.provision import ProvisionError, ensure_llama_server
    # Checked before a server starts and minutes of measuring begin (a fresh tester's find:
    # each of these was a traceback or an error at the end).
    out = Path(args.out)
    bad = ("--slots must be at least 2 (the decode fit needs two batch sizes)" if args.slots < 2
           else "--repeats must be at least 1" if args.repeats < 1
           else "--context must be at least 16 tokens" if args.context < 16
           else (f"--slots × --context is {args.slots * args.context:,} tokens, more than "
                 f"llama-server's -c takes ({INT32_MAX})")
           if args.slots * args.context > INT32_MAX
           else "--threads must be at least 1" if args.threads is not None and args.threads < 1
           else f"--binary is not an executable file: {args.binary}"
           if args.binary and not (os.path.isfile(args.binary) and os.access(args.binary, os.X_OK))
           else _gpu_problem(args.gpu))
    if bad is None and args.model:
        try:
            GGUFFacts.read(Path(args.model))
        except (OSError, ValueError) as e:
            bad = f"--model is not a readable GGUF file: {args.model} ({e})"
    if bad is None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            existed = out.exists()
            with open(out, "ab"):
                pass
            if not existed:  # only the finished profile is written there
                out.unlink()
        except OSError as e:
            bad = f"--out cannot be written: {out} ({_why(e)})"
    if bad is not None:
        sys.stderr.write(f"llama-gateway calibrate: {bad}\n")
        return 2
    try:
        doc = calibrate(ensure_llama_server(args.binary),
                        Path(args.model) if args.model else ensure_demo_model(),
                        name=args.name, command=" ".join(["llama-gateway", *argv]), out=args.out,
                        slots=args.slots, context=args.context,
                        threads=args.threads if args.threads or args.gpu is not None else 1,
                        repeats=args.repeats, gpus=() if args.gpu is None else (args.gpu,))
    except (ProvisionError, ValueError) as e:  # no binary; too few slots to fit a batch slope
        sys.stderr.write(f"llama-gateway calibrate: {e}\n")
        return 2
    except (RuntimeError, TimeoutError) as e:  # its llama-server exited or never got ready
        sys.stderr.write(f"llama-gateway calibrate: {e}\n")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: its llama-server was stopped on the way out
        sys.stderr.write("llama-gateway calibrate: interrupted, nothing written\n")
        return 130
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.write(table(doc) + f"\nwritten: {out}\n")
    return 0


def _admin(args) -> int:
    import orjson

    from gateway import admin_client as ac
    try:
        if args.verb == "status":
            st = ac.fetch_status(args.url, args.token)
            sys.stdout.write(orjson.dumps(st, option=orjson.OPT_INDENT_2).decode() + "\n"
                             if args.json else ac.status_table(st))
        elif args.verb == "worker":
            res = ac.worker_action(args.action, args.worker, args.url, args.token)
            sys.stdout.write(orjson.dumps(res).decode() + "\n")
        else:
            res = ac.reload(args.url, args.token)
            sys.stdout.write(orjson.dumps(res).decode() + "\n")
    except ac.AdminError as e:
        sys.stderr.write(f"llama-gateway {args.verb}: {e}\n")
        return 1
    return 0


def _fleet_sizes(text: str) -> tuple[int, ...]:
    """``--gpus`` "4,8" → (4, 8). Raises ValueError unless each is a whole number 1..1024."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or not all(1 <= n <= 1024 for n in sizes):
        raise ValueError(f"--gpus must be comma-separated whole numbers of GPUs from 1 to 1024, "
                         f"e.g. 4,8; got {text!r}")
    return sizes


def _cannot_create(folder) -> str:
    """Why ``serve`` could not make the directory ``folder`` or write in it (its nearest
    existing ancestor is not a writable directory), or "" when it could."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory"
    return "" if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable"


def _check_files(cfg) -> tuple[list[str], dict[str, int]]:
    """What ``serve`` would refuse or fail on: an unusable llama-server binary (missing, not executable, or
    one whose ``--version`` fails: ``workers.provision.check_runs``; no build is started here)
    or a model path that is not a readable GGUF; a ``listen`` host that does not resolve or is
    not this machine's (bound at port 0, so a running gateway's port is no error); a cache in
    which the workers' run directory or the built-in demo model could not be written (as
    ``serve`` refuses them, a fresh tester's find). Returns key-path error lines, and each model's
    trained context (full name -> tokens, 0 unknown) from its GGUF (the built-in demo model's
    file when it was written already, else its default)."""
    from pathlib import Path

    from gateway.config import ConfigError
    from gateway.inventory import GGUFFacts
    from workers.demo_model import N_CTX_TRAIN, demo_model_path
    from workers.provision import ProvisionError, check_runs, find_llama_server

    problems, trained = [], {}
    ls = cfg.llama_server
    try:
        found = find_llama_server(ls.binary, None if ls.backend == "auto" else ls.backend)
        if found is None:
            sys.stderr.write("llama-gateway: no llama-server found; `serve` will build one "
                             "(or run `llama-gateway install-llama-server`)\n")
        else:
            check_runs(found)  # it exists and is executable; does it start at all?
    except ProvisionError as e:
        problems.append(f"llama_server.binary: {e}")
    from gateway.listen import address, bind_listen
    from workers.provision import cache_root
    try:  # port 0: the address resolves and is this machine's (the port may be a running
        for sock in bind_listen(cfg.host.strip("[]"), 0, cfg.source):  # gateway's)
            sock.close()
    except ConfigError as e:
        shown = (address(cfg.host, 0), address(cfg.host, cfg.port))
        problems.extend(err.replace(*shown) for err in e.errors)
    run_dir = cache_root() / "run"
    why = _cannot_create(run_dir)
    if why:
        problems.append(f"cannot create the workers' run directory under {run_dir} "
                        f"($LLAMA_GATEWAY_CACHE, default ~/.cache/llama-gateway): {why}")
    for i, m in enumerate(cfg.models):
        path = demo_model_path() if m.is_builtin else Path(m.path).expanduser()
        if m.is_builtin and not path.exists():
            why = _cannot_create(path.parent)
            if why:
                problems.append(f"models[{i}].path: cannot write the built-in demo model to "
                                f"{path}: {why}")
            trained[m.full_name] = N_CTX_TRAIN
            continue
        try:
            trained[m.full_name] = GGUFFacts.read(path).context_length
        except (OSError, ValueError) as e:
            problems.append(f"models[{i}].path: not a readable GGUF file: {m.path} ({e})")
    return problems, trained


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    verb = args.verb or "serve"
    if verb == "serve" and threading.current_thread() is threading.main_thread():
        # Until serve() installs its reload handler (after imports and the config load), a
        # SIGHUP must not end the process (its default action; exit 129 in a tester's run),
        # and is applied once the handler is there (gateway.early_hup).
        from gateway import early_hup
        early_hup.catch()  # again when gateway.__main__ did: what it recorded is kept
    if verb == "serve" and not hasattr(args, "config"):
        args.config = os.environ.get("LLAMA_GATEWAY_CONFIG", "gateway.yaml")
    if verb in ("status", "worker", "reload"):
        return _admin(args)
    from gateway.config import ConfigError, load_config

    if verb in ("serve", "check-config"):
        configure("info", "auto")
        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            sys.stderr.write(f"llama-gateway: invalid config\n{e}\n")
            return 2
        configure(cfg.log.level, cfg.log.format)
        if verb == "check-config":
            from gateway.config import models_without_workers, plan_workers
            from workers.gpu import detect_gpus
            from gateway.slot_plan import args_override, slot_context
            problems, trained = _check_files(cfg)
            if problems:
                sys.stderr.write(f"llama-gateway: invalid config\n{ConfigError(problems, cfg.source)}\n")
                return 2
            from gateway.texts import no_workers
            try:
                plans = plan_workers(cfg, detect_gpus())
            except ConfigError as e:  # e.g. gpus: [0] on a machine without an NVIDIA GPU
                sys.stderr.write(f"llama-gateway: invalid config\n{e}\n")
                return 2
            for w in plans:
                mcfg = cfg.find_model(w.model)
                slots, per_slot, note = args_override(
                    list(cfg.llama_server.extra_args) + list(mcfg.args if mcfg else ()),
                    w.slots, w.context)
                ctx = slot_context(per_slot, trained.get(w.model, 0))
                capped = (f" (capped from {per_slot}: the model's training context)"
                          if ctx < per_slot else "")
                sys.stdout.write(f"{w.id}\tmodel={w.model}\tgpus={list(w.gpus) or 'cpu'}\t"
                                 f"slots={slots}\tcontext/slot={ctx}{capped}{note}\n")
            for model in models_without_workers(cfg, plans):  # what serve answers them
                sys.stdout.write(f"-\tmodel={model}\tno worker: {no_workers(model)}\n")
            return 0
        from gateway.app import serve
        try:
            import uvloop
            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        try:
            return runner(serve(cfg, args.config))
        except ConfigError as e:  # a binary or model file the gateway cannot use
            sys.stderr.write(f"llama-gateway: invalid config\n{e}\n")
            return 2
    if verb == "hash-key":
        from gateway.auth import hash_key, new_key
        key = args.key
        if key == "-":
            key = sys.stdin.read().strip("\r\n")
        if key is None:
            key = new_key()
            sys.stdout.write(f"key:    {key}\nsha256: {hash_key(key)}\n")
            return 0
        if not key:
            sys.stderr.write("llama-gateway: empty key\n")
            return 2
        sys.stdout.write(hash_key(key) + "\n")
        return 0
    configure("info", "auto")
    log = get_logger("gateway.cli")
    if verb == "install-llama-server":
        from workers.provision import ProvisionError, build_llama_server, ensure_llama_server
        backend = None if args.backend == "auto" else args.backend
        try:
            path = build_llama_server(backend, args.jobs) if args.force else ensure_llama_server(None, backend)
        except ProvisionError as e:
            log.error("llama_server.install_failed", error=str(e))
            return 1
        sys.stdout.write(f"{path}\n")
        return 0
    if verb == "simulate":
        from gateway.simulator.report import (MAX_DURATION_S, MIN_DURATION_S, markdown,
                                              markdown_sweep, plot, run_all, run_sweep)
        from gateway.simulator.worker import resolve_profile
        try:
            profile = resolve_profile(args.profile)
            gpus = _fleet_sizes(args.gpus)
            if not args.duration >= MIN_DURATION_S:  # NaN too
                raise ValueError(f"--duration must be at least {MIN_DURATION_S:g} simulated "
                                 f"seconds (runs are measured after up to 20 s of warm-up), "
                                 f"got {args.duration:g}")
            if args.duration > MAX_DURATION_S:
                raise ValueError(f"--duration must be at most {MAX_DURATION_S:g} simulated "
                                 f"seconds, got {args.duration:g}")
            if args.png:
                try:
                    import matplotlib  # noqa: F401  (the plot needs it; checked before the runs)
                except ImportError:
                    raise ValueError("--png needs matplotlib: pip install "
                                     "'llama-gateway[bench]'") from None
        except ValueError as e:
            sys.stderr.write(f"llama-gateway simulate: {e}\n")
            return 2
        rows = run_all(gpus, args.duration, profile)
        sweep = run_sweep(gpus, args.duration, profile)
        sys.stdout.write(markdown(rows) + markdown_sweep(sweep))
        if args.png:
            plot(rows, args.png, sweep)
        return 0
    if verb == "calibrate":
        return _calibrate(args, sys.argv[1:] if argv is None else argv)
    if verb == "demo-model":
        from workers.demo_model import demo_model_path, ensure_demo_model, write_demo_model
        path = Path(args.path) if args.path else demo_model_path()
        if args.context_length is not None:
            if not args.path:
                sys.stderr.write("llama-gateway: --context-length needs --path (the built-in "
                                 "demo model keeps its 4096 tokens)\n")
                return 2
            if not 16 <= args.context_length <= 2**31 - 1:
                sys.stderr.write("llama-gateway: --context-length must be 16 to 2147483647 "
                                 "tokens\n")
                return 2
        try:
            if path.is_dir():  # "if missing" found it there and printed a folder as the model
                raise IsADirectoryError(21, "Is a directory", str(path))
            if args.context_length is None and not args.force and path.is_file():
                with open(path, "rb") as f:  # "if missing" found another file there and
                    if f.read(4) != b"GGUF":  # printed it as the model (a fresh tester's find)
                        sys.stderr.write(f"llama-gateway demo-model: {path} exists and is not "
                                         "a GGUF file; --force overwrites it\n")
                        return 1
            if args.context_length is not None:
                path = write_demo_model(path, n_ctx_train=args.context_length)
            else:
                path = write_demo_model(path) if args.force else ensure_demo_model(path)
        except OSError as e:  # a folder that does not exist or cannot be written
            sys.stderr.write(f"llama-gateway demo-model: cannot write {path}: {_why(e)}\n")
            return 1
        sys.stdout.write(f"{path}\n")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
