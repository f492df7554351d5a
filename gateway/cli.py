"""``llama-gateway`` command line.

Verbs:
  serve (default)          run the gateway on a config (default ./gateway.yaml)
  install-llama-server     find or build the llama-server binary now (shows build progress)
  demo-model               write the small offline demo GGUF
  check-config             validate a config file and print the worker plan
  simulate                 simulated routing-quality comparison of scheduling policies
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
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
    d = sub.add_parser("demo-model", help="write the offline demo GGUF")
    d.add_argument("--path", default=None)
    c = sub.add_parser("check-config", help="validate a config and show the worker plan")
    c.add_argument("-c", "--config", default="gateway.yaml")
    m = sub.add_parser("simulate", help="simulate scheduling policies on modelled GPUs")
    m.add_argument("--gpus", default="4,8", help="comma-separated fleet sizes")
    m.add_argument("--duration", type=float, default=120.0, help="simulated seconds per run")
    m.add_argument("--profile", default="rtx6000ada-llama8b-q4")
    m.add_argument("--png", default=None, help="write a plot of effective GPUs and TTFT p99")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    verb = args.verb or "serve"
    if verb == "serve" and not hasattr(args, "config"):
        args.config = os.environ.get("LLAMA_GATEWAY_CONFIG", "gateway.yaml")
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
            from gateway.config import plan_workers
            from workers.gpu import detect_gpus
            for w in plan_workers(cfg, detect_gpus()):
                sys.stdout.write(f"{w.id}\tmodel={w.model}\tgpus={list(w.gpus) or 'cpu'}\t"
                                 f"slots={w.slots}\tcontext/slot={w.context}\n")
            return 0
        from gateway.app import serve
        try:
            import uvloop
            return uvloop.run(serve(cfg))
        except ImportError:
            return asyncio.run(serve(cfg))
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
        from gateway.simulator.report import markdown, plot, run_all
        rows = run_all(tuple(int(x) for x in args.gpus.split(",")), args.duration, args.profile)
        sys.stdout.write(markdown(rows))
        if args.png:
            plot(rows, args.png)
        return 0
    if verb == "demo-model":
        from workers.demo_model import demo_model_path, write_demo_model
        path = write_demo_model(Path(args.path) if args.path else demo_model_path())
        sys.stdout.write(f"{path}\n")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
