"""Simulated routing quality at 4 and 8 GPUs, and the working-set sweep (not part of pytest;
run by hand).

    python tests/bench/sim_bench.py [--duration 120] [--gpus 4,8] [--only NAME] [--no-sweep]
        [--out docs/bench_sim.md] [--png docs/bench_sim.png | --no-png]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.simulator.report import markdown, markdown_sweep, plot, run_all, run_sweep  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--gpus", default="4,8")
    ap.add_argument("--only", default="", help="only the scenarios whose name contains this")
    ap.add_argument("--no-sweep", action="store_true", help="skip the working-set sweep")
    ap.add_argument("--out", default="docs/bench_sim.md")
    ap.add_argument("--png", default="docs/bench_sim.png")
    ap.add_argument("--no-png", action="store_true", help="write no plot (no matplotlib needed)")
    a = ap.parse_args()
    if not a.no_png:
        try:
            import matplotlib  # noqa: F401  (the plot needs it: checked before minutes of runs)
        except ImportError:
            sys.stderr.write("sim_bench.py: the plot needs matplotlib: pip install "
                             "'llama-gateway[bench]', or pass --no-png\n")
            return 2
    t0 = time.time()
    gpus = tuple(int(x) for x in a.gpus.split(","))
    rows = run_all(gpus, a.duration, only=a.only)
    sweep = [] if a.no_sweep else run_sweep(gpus, a.duration)
    md = markdown(rows) + (markdown_sweep(sweep) if sweep else "")
    Path(a.out).write_text(md)
    if not a.no_png:
        plot(rows, a.png, sweep)
    sys.stdout.write(md + f"\n({time.time() - t0:.0f} s wall)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
