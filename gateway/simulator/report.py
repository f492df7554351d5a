"""Simulated routing-quality comparison: scenarios × policies → markdown tables and a PNG.

Used by ``llama-gateway simulate`` and ``tests/bench/sim_bench.py``. Scenarios (see
README, "Benchmarks"): the seed scenario (100 closed-loop clients, outputs uniform 10..1000),
an open-loop Poisson trace (lengths from the Azure conv trace), a shared-system-prompt trace,
multi-turn conversations and closed-loop chat clients that keep every slot busy
(``ChatClients``, as ``tests/bench/real_conversations.py`` drives real workers). Policies: this
scheduler (least_loaded + bounded-load prefix affinity), the same with the affinity wait of
delay scheduling (``scheduler.affinity_wait_ms_per_1k_tokens`` at the profile's prefill time,
125 ms per 1,000 tokens), least_loaded without affinity, least_connections, round_robin, random, the
Ollama-like baseline (one runner on GPU 0, FIFO, parallel = slots) and, for TTFT, an ideal
global-queue oracle.

The sweep varies the working set of the shared-prompt trace (how many system prompts, Zipf or
equal popularity) against one worker's cache, with this scheduler, least_loaded without
affinity, round_robin and the oracle.

Workers run as the gateway launches them: llama-server's default ``--cache-ram 8192`` (65,536
tokens of an 8B model's f16 KV at 131,072 bytes per token), ``--no-cache-idle-slots``
(workers/process.py), unified KV off. Per-worker cache C = host-cache tokens + KV cells (``slots × n_ctx``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.prompt_cache import DEFAULT_CACHE_RAM_MIB, host_cache_tokens
from gateway.simulator.engine import Result, simulate
from gateway.simulator.worker import PROFILES, GpuProfile
from gateway.simulator.workload import ChatClients, ClosedLoop, Conversations, poisson, shared_prefix

POLICY_RUNS = [  # label, policy, kwargs
    ("gateway (least_loaded+affinity)", "least_loaded", {"affinity": True}),
    ("+ affinity wait 125 ms/1k tokens", "least_loaded",
     {"affinity": True, "affinity_wait_ms_per_1k_tokens": 125.0}),
    ("least_loaded, no affinity", "least_loaded", {"affinity": False}),
    ("least_connections", "least_connections", {}),
    ("round_robin", "round_robin", {}),
    ("random", "random", {}),
    ("ollama-like (1 runner, FIFO)", "pack", {"single_runner": True}),
    ("oracle (ideal global queue)", "oracle", {}),
]


SWEEP_POLICIES = [p for p in POLICY_RUNS if p[1] in ("least_loaded", "round_robin", "oracle")
                  and not p[2].get("affinity_wait_ms_per_1k_tokens")]
SWEEP_PROMPTS = (16, 64, 128, 256)
N_CTX = 4096
CONV_REQ_PER_GPU_S = 1.25  # the shared-prompt trace's request rate per GPU


@dataclass
class Row:
    scenario: str
    gpus: int
    label: str
    res: Result
    eff_gpus: float
    cache: int = 0  # per-worker cache C (tokens): host cache + KV cells


def worker_cache(slots: int, profile: GpuProfile) -> int:
    """Per-worker cache C in tokens at the default ``--cache-ram``: host cache + KV cells."""
    return host_cache_tokens(DEFAULT_CACHE_RAM_MIB, profile.kv_bytes_per_token) + slots * N_CTX


#: Shortest ``duration_s`` a comparison can use: runs are measured after up to 20 s of
#: warm-up (the seed and chat scenarios, and the one-GPU reference they are divided by).
MIN_DURATION_S = 25.0
#: Longest: an hour of simulated traffic (each scenario × policy × fleet size is one run;
#: a run of 1e300 s never ended, a fresh tester's find).
MAX_DURATION_S = 3600.0


def scenarios(duration_s: float, only: str = ""):
    """(name, workload factory of the GPU count, slots per GPU, warmup s), those whose name
    contains ``only`` (all by default). Conversations run
    5 × ``duration_s`` and are measured after the first ``duration_s``: turns come back after
    the user's think time, so caches and load need about two minutes to settle."""
    conv = CONV_REQ_PER_GPU_S / Conversations.mean_turns
    return [s for s in [
        ("seed: 100 concurrent, out 10..1000", lambda n: ClosedLoop(100, duration_s), 16, 20.0),
        ("poisson 2 req/s per GPU (Azure conv lengths)", lambda n: poisson(2.0 * n, duration_s), 16, 10.0),
        ("shared system prompts (64, Zipf)", lambda n: shared_prefix(1.25 * n, duration_s,
                                                                      n_prefixes=64), 8, 10.0),
        ("conversations (1.25 req/s per GPU, think 10 s)",
         lambda n: Conversations(conv * n, 5 * duration_s), 16, duration_s),
        ("chat clients = slots (7 chats per client, 8 turns)",
         lambda n: ChatClients(16 * n, duration_s), 16, 20.0),
    ] if only in s[0]]


def sweep_scenarios(duration_s: float):
    """Shared-prompt traces whose working set runs from a quarter of one worker's cache to
    four times it: (name, workload factory, slots, warmup s)."""
    out = []
    for zipf_s, pop in ((1.0, "Zipf"), (0.0, "equal")):
        for k in SWEEP_PROMPTS:
            out.append((f"sweep: {k} system prompts, {pop} popularity",
                        lambda n, k=k, z=zipf_s: shared_prefix(1.25 * n, duration_s, n_prefixes=k,
                                                               zipf_s=z), 8, 10.0))
    return out


def _run(gpus, scen, policies, prof: GpuProfile, duration_s: float) -> list[Row]:
    rows: list[Row] = []
    refs: dict[tuple[int, float], float] = {}
    for n in gpus:
        for name, make, slots, warm in scen:
            # one saturated GPU: the same kind of traffic at a level that keeps its slots full
            key = (slots, min(warm, 20.0))
            if key not in refs:
                refs[key] = simulate(ClosedLoop(slots * 4, duration_s, seed=9), n_workers=1,
                                     profile=prof, slots=slots, n_ctx=N_CTX,
                                     warmup_s=key[1]).throughput
            for label, pol, kw in policies:
                res = simulate(make(n), n_workers=n, profile=prof, slots=slots, n_ctx=N_CTX,
                               policy=pol, warmup_s=warm, **kw)
                rows.append(Row(name, n, label, res, res.throughput / refs[key],
                                worker_cache(slots, prof)))
    return rows


def _profile(profile: str | GpuProfile) -> GpuProfile:
    return PROFILES[profile] if isinstance(profile, str) else profile


def run_all(gpus=(4, 8), duration_s: float = 120.0,
            profile: str | GpuProfile = "rtx6000ada-llama8b-q4", policies=POLICY_RUNS,
            only: str = "") -> list[Row]:
    """Every scenario (whose name contains ``only``) × policy at each fleet size; ``profile``: a
    ``PROFILES`` name or a ``GpuProfile`` (e.g. from ``GpuProfile.from_json``)."""
    return _run(gpus, scenarios(duration_s, only), policies, _profile(profile), duration_s)


def run_sweep(gpus=(4, 8), duration_s: float = 120.0,
              profile: str | GpuProfile = "rtx6000ada-llama8b-q4",
              policies=SWEEP_POLICIES) -> list[Row]:
    """The working-set sweep (``sweep_scenarios``) at each fleet size."""
    return _run(gpus, sweep_scenarios(duration_s), policies, _profile(profile), duration_s)


def _f(x: float, nd=2) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


def _same(rows: list[Row], r: Row, label: str) -> Row | None:
    """The row of policy ``label`` (prefix match) in ``r``'s scenario and fleet size."""
    return next((x for x in rows if (x.scenario, x.gpus) == (r.scenario, r.gpus)
                 and x.label.startswith(label)), None)


def _ratios(rows: list[Row], r: Row) -> tuple[float, float, float]:
    """(TTFT p99 / oracle's, cached tokens / round_robin's, tokens/s / least_loaded without
    affinity's) of row ``r``; nan where the baseline is missing or zero."""
    nan = float("nan")
    o, rr, ll = _same(rows, r, "oracle"), _same(rows, r, "round_robin"), _same(rows, r, "least_loaded, no")
    o99 = Result.pct(o.res.ttft, 99) if o else nan
    return (Result.pct(r.res.ttft, 99) / o99 if o99 == o99 and o99 else nan,
            r.res.cached_tokens / rr.res.cached_tokens if rr and rr.res.cached_tokens else nan,
            r.res.throughput / ll.res.throughput if ll and ll.res.throughput else nan)


def markdown(rows: list[Row]) -> str:
    out = []
    key = None
    for r in rows:
        if (r.scenario, r.gpus) != key:
            key = (r.scenario, r.gpus)
            out.append(f"\n#### {r.scenario} — {r.gpus} GPUs\n")
            if r.res.working_set:
                out.append(f"Working set W ≈ {r.res.working_set:,.0f} tokens; per-worker cache "
                           f"C = {r.cache:,} tokens; W/C = {r.res.working_set / r.cache:.2f}.\n")
            out.append("| policy | tokens/s | effective GPUs | TTFT p50 s | TTFT p99 s | TTFT p99 / oracle "
                       "| e2e p99 s | cached prompt tokens | cache hit ratio | from host cache "
                       "| cached / round_robin |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        p99_o, c_rr, _ = _ratios(rows, r)
        host = r.res.restored_tokens / r.res.cached_tokens if r.res.cached_tokens else float("nan")
        out.append(f"| {r.label} | {r.res.throughput:,.0f} | {r.eff_gpus:.2f} | "
                   f"{_f(Result.pct(r.res.ttft, 50), 3)} | {_f(Result.pct(r.res.ttft, 99), 3)} | "
                   f"{_f(p99_o)} | {_f(Result.pct(r.res.e2e, 99))} | {r.res.cached_tokens:,} | "
                   f"{r.res.cached_ratio:.3f} | {_f(host)} | {_f(c_rr)} |")
    return "\n".join(out) + "\n"


def markdown_sweep(rows: list[Row]) -> str:
    """One line per sweep point and fleet size: W/C and this scheduler's ratios."""
    out = ["\n#### Sweep: shared system prompts, working set ÷ per-worker cache\n",
           "| system prompts | popularity | GPUs | W/C | gateway cached / round_robin "
           "| no-affinity cached / round_robin | gateway tokens/s / no-affinity | "
           "gateway TTFT p99 / oracle | gateway cache hit ratio |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.label.startswith("gateway"):
            continue
        p99_o, c_rr, t_ll = _ratios(rows, r)
        ll = _same(rows, r, "least_loaded, no")
        ll_rr = _ratios(rows, ll)[1] if ll else float("nan")
        k, pop = r.scenario.split(": ")[1].split(" system prompts, ")
        out.append(f"| {k} | {pop.split()[0]} | {r.gpus} | {r.res.working_set / r.cache:.2f} | "
                   f"{_f(c_rr)} | {_f(ll_rr)} | {_f(t_ll, 3)} | {_f(p99_o)} | {r.res.cached_ratio:.3f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[Row], path: str, sweep: list[Row] = ()) -> None:
    """Bar charts of effective GPUs and TTFT p99 per policy, one panel pair per scenario; with
    ``sweep``, a last row of cached tokens ÷ round_robin's against W/C."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.scenario, r.gpus) for r in rows))
    n_rows = len(keys) + (1 if sweep else 0)
    fig, axes = plt.subplots(n_rows, 2, figsize=(13, 3.2 * n_rows), squeeze=False)
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
    if sweep:
        for j, pop in enumerate(("Zipf", "equal")):
            ax = axes[-1][j]
            for label, style in (("gateway", "-"), ("least_loaded, no", ":")):
                for n in sorted({r.gpus for r in sweep}):
                    pts = [(r.res.working_set / r.cache, _ratios(sweep, r)[1]) for r in sweep
                           if r.gpus == n and pop in r.scenario and r.label.startswith(label)]
                    ax.plot(*zip(*pts), style, marker="o", label=f"{label.split(',')[0]} {n} GPUs")
            ax.set_xscale("log")
            ax.set_xticks([0.25, 0.5, 1, 2, 4], ["0.25", "0.5", "1", "2", "4"])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("working set / per-worker cache", fontsize=8)
            ax.set_title(f"sweep, {pop} popularity: cached tokens / round_robin", fontsize=9)
            ax.tick_params(labelsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
