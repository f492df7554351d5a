"""Decode time per token under JSON-schema ``pattern``s, for gateway code trees side by side
(not part of pytest). Speed is measured, never asserted.

Each tree (a checkout, e.g. ``git worktree add /tmp/base <commit>``) runs its own gateway with
one real worker (demo model, 2 slots, ``-t 1``). For each pattern the script alternates trees
answer by answer (``/api/generate`` with ``format: {"type": "string", "pattern": P}``, 40
tokens, seeds 0..n-1), so machine load hits every series alike, and prints per tree the median
of the worker's decode time per token (Ollama ``eval_duration / eval_count``, ms) and its ratio
to the same tree's baseline in the same run: a string with no pattern.

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/pattern_ab.py /tmp/base . [-n 8]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.overhead_ab import ready_worker, start  # noqa: E402

PATTERNS = [None, r"^[^a]{60}$", r"^.{60}$", r"^\w{60}$", "[0-9]{3}", r"^[ -~]{60}$",
            r"^[\s\S]{4,60}$", r"^[\w.-]+@[\w-]+\.\w{2,}$"]


def per_token_ms(url: str, pattern: str | None, seed: int) -> float:
    schema = {"type": "string"} if pattern is None else {"type": "string", "pattern": pattern}
    r = httpx.post(url + "/api/generate", timeout=120, json={
        "model": "demo", "prompt": "hi", "stream": False, "format": schema,
        "options": {"num_predict": 40, "seed": seed}})
    r.raise_for_status()
    a = r.json()
    return a["eval_duration"] / 1e6 / max(1, a["eval_count"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("-n", type=int, default=8, help="answers per pattern and tree")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gws = [start(tree.resolve(), Path(tmp), i) for i, tree in enumerate(args.trees)]
        try:
            for _, url in gws:
                ready_worker(url)
            base: dict[int, float] = {}
            print(f"{'pattern':34} " + " ".join(f"{str(t):>22}" for t in args.trees))
            for p in PATTERNS:
                ms: dict[int, list[float]] = {i: [] for i in range(len(gws))}
                for seed in range(args.n):
                    for i, (_, url) in enumerate(gws):
                        ms[i].append(per_token_ms(url, p, seed))
                cells = []
                for i in ms:
                    med = statistics.median(ms[i])
                    if p is None:
                        base[i] = med
                    cells.append(f"{med:6.3f} ms ({med / base[i]:4.2f}x)")
                print(f"{str(p):34} " + " ".join(f"{c:>22}" for c in cells))
        finally:
            for proc, _ in gws:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
