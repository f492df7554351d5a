"""Simulated routing-quality comparison: scenarios × policies → markdown tables and a PNG.

Used by ``llama-gateway simulate`` and ``tests/bench/sim_bench.py``. Scenarios (see
README, "Benchmarks"): the seed scenario (100 closed-loop clients, outputs uniform 10..1000),
an open-loop Poisson trace (lengths from the Azure conv trace) and a shared-system-prompt
trace. Policies: this scheduler (least_loaded + bounded-load prefix affinity), least_loaded
without affinity, least_connections, round_robin, random, the Ollama-like baseline (one
runner on GPU 0, FIFO, parallel = slots) and, for TTFT, an ideal global-queue oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.simulator.engine import Result, simulate
from gateway.simulator.worker import PROFILES, GpuProfile
from gateway.simulator.workload import ClosedLoop, poisson, shared_prefix

POLICY_RUNS = [  # label, policy, kwargs
    ("gateway (least_loaded+affinity)", "least_loaded", {"affinity": True}),
    ("least_loaded, no affinity", "least_loaded", {"affinity": False}),
    ("least_connections", "least_connections", {}),
    ("round_robin", "round_robin", {}),
    ("random", "random", {}),
    ("ollama-like (1 runner, FIFO)", "pack", {"single_runner": True}),
    ("oracle (ideal global queue)", "oracle", {}),
]


@dataclass
class Row:
    scenario: str
    gpus: int
    label: str
    res: Result
    eff_gpus: float


def scenarios(duration_s: float):
    """(name, workload factory, slots per GPU, warmup s, rate scales with GPUs)."""
    return [
        ("seed: 100 concurrent, out 10..1000", lambda n: ClosedLoop(100, duration_s), 16, 20.0),
        ("poisson 2 req/s per GPU (Azure conv lengths)", lambda n: poisson(2.0 * n, duration_s), 16, 10.0),
        ("shared system prompts (64, Zipf)", lambda n: shared_prefix(1.25 * n, duration_s,
                                                                      n_prefixes=64), 8, 10.0),
    ]


def run_all(gpus=(4, 8), duration_s: float = 120.0,
            profile: str | GpuProfile = "rtx6000ada-llama8b-q4", policies=POLICY_RUNS) -> list[Row]:
    """Every scenario × policy at each fleet size; ``profile``: a ``PROFILES`` name or a
    ``GpuProfile`` (e.g. from ``GpuProfile.from_json``)."""
    prof = PROFILES[profile] if isinstance(profile, str) else profile
    rows: list[Row] = []
    for n in gpus:
        for name, make, slots, warm in scenarios(duration_s):
            # one saturated GPU: the same kind of traffic at a level that keeps its slots full
            ref = simulate(ClosedLoop(slots * 4, duration_s, seed=9), n_workers=1, profile=prof,
                           slots=slots, warmup_s=warm).throughput
            for label, pol, kw in policies:
                res = simulate(make(n), n_workers=n, profile=prof, slots=slots, policy=pol,
                               warmup_s=warm, **kw)
                rows.append(Row(name, n, label, res, res.throughput / ref))
    return rows


def _f(x: float, nd=2) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


def markdown(rows: list[Row]) -> str:
    out = []
    key = None
    for r in rows:
        if (r.scenario, r.gpus) != key:
            key = (r.scenario, r.gpus)
            oracle = next((x for x in rows if (x.scenario, x.gpus) == key and x.label.startswith("oracle")), None)
            rr = next((x for x in rows if (x.scenario, x.gpus) == key and x.label == "round_robin"), None)
            out.append(f"\n#### {r.scenario} — {r.gpus} GPUs\n")
            out.append("| policy | tokens/s | effective GPUs | TTFT p50 s | TTFT p99 s | TTFT p99 / oracle "
                       "| e2e p99 s | cached prompt tokens | cache hit ratio | cached / round_robin |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        o99 = Result.pct(oracle.res.ttft, 99) if oracle else float("nan")
        t99 = Result.pct(r.res.ttft, 99)
        rrc = rr.res.cached_tokens if rr else 0
        out.append(f"| {r.label} | {r.res.throughput:,.0f} | {r.eff_gpus:.2f} | "
                   f"{_f(Result.pct(r.res.ttft, 50), 3)} | {_f(t99, 3)} | {_f(t99 / o99 if o99 else float('nan'))} | "
                   f"{_f(Result.pct(r.res.e2e, 99))} | {r.res.cached_tokens:,} | {r.res.cached_ratio:.3f} | "
                   f"{_f(r.res.cached_tokens / rrc if rrc else float('nan'))} |")
    return "\n".join(out) + "\n"


def plot(rows: list[Row], path: str) -> None:
    """Bar charts of effective GPUs and TTFT p99 per policy, one panel pair per scenario."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.scenario, r.gpus) for r in rows))
    fig, axes = plt.subplots(len(keys), 2, figsize=(13, 3.2 * len(keys)), squeeze=False)
    for i, key in enumerate(keys):
        sub = [r for r in rows if (r.scenario, r.gpus) == key]
        labels = [r.label.split(" (")[0] for r in sub]
        axes[i][0].barh(labels, [r.eff_gpus for r in sub], color="tab:blue")
        axes[i][0].set_title(f"{key[0]} — {key[1]} GPUs: effective GPUs", fontsize=9)
        axes[i][1].barh(labels, [Result.pct(r.res.ttft, 99) for r in sub], color="tab:orange")
        axes[i][1].set_title("TTFT p99 (s)", fontsize=9)
        for ax in axes[i]:
            ax.tick_params(labelsize=8)
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
