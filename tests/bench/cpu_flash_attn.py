"""llama-server's CPU flash attention on and off, measured on one real worker (not part of pytest).

Why: the gateway starts CPU workers with ``LLAMA_ARG_FLASH_ATTN=off`` (``workers.process``,
:data:`~workers.process.FLASH_ATTN_ENV`). This bench is the measurement behind that default.

One llama-server per setting (``-fa on``, ``-fa off``), the demo model, ``-t 1``, 4 slots ×
2,048 tokens, started directly (no gateway). For each setting, read from llama-server's own
``timings`` of ``/v1/chat/completions`` answers (median of ``--repeats`` requests each):

- cold prompts of about 100, 850 and 1,600 tokens: ``prompt_ms``;
- the same system prompts again (cached by the slot) with a new user message of 1–80 words:
  ``prompt_ms`` for the new tokens after the cached head (a chat turn, a question under a shared
  system prompt);
- decode: 256 tokens (``ignore_eos``) after a short and a long prompt, ms per token.

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/cpu_flash_attn.py [--repeats 5]
[--model F.gguf] [--out docs/bench_cpu_flash_attn.md]``: an operator can measure a real model
on their own CPU the same way (the default measures the demo model).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import wait_health  # noqa: E402
from workers.demo_model import ensure_demo_model  # noqa: E402
from workers.process import free_port  # noqa: E402
from workers.provision import ensure_llama_server  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()
SYSTEM_WORDS = (20, 200, 400)  # about 100, 850 and 1,600 tokens with the chat template
USER_WORDS = (1, 5, 10, 20, 40, 80)


def start(fa: str, model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    proc = subprocess.Popen(
        [str(ensure_llama_server()), "-m", str(model), "-c", "8192", "-np", "4",
         "-t", "1", "--port", str(port), "-fa", fa, "--no-webui"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    async def ready() -> None:
        async with aiohttp.ClientSession() as session:
            await wait_health(session, url)

    try:
        asyncio.run(ready())
    except TimeoutError:
        proc.kill()
        raise
    return proc, url


def timings(url: str, system: str, user: str, max_tokens: int = 1) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "ignore_eos": True}
    # a fresh connection each time: llama-server may close an idle keep-alive connection
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["timings"]


def measure(fa: str, repeats: int, model: Path) -> dict:
    rng = random.Random(7)
    proc, url = start(fa, model)
    out: dict = {"cold": {}, "cached": {}, "decode": {}}
    try:
        for sw in SYSTEM_WORDS:
            cold = []
            for i in range(repeats):  # a distinct system prompt each time: nothing cached
                system = f"You are {sw}-{i}. " + " ".join(rng.choices(WORDS, k=sw))
                t = timings(url, system, "hi")
                cold.append((t["prompt_n"], t["prompt_ms"]))
            out["cold"][sw] = (cold[0][0], statistics.median(ms for _, ms in cold))
            system = f"You are {sw}. " + " ".join(rng.choices(WORDS, k=sw))
            timings(url, system, "hi")  # now held by a slot
            for uw in USER_WORDS:
                got = [timings(url, system, " ".join(rng.choices(WORDS, k=uw)))
                       for _ in range(repeats)]
                out["cached"][(sw, uw)] = (got[0]["cache_n"], got[0]["prompt_n"],
                                           statistics.median(t["prompt_ms"] for t in got))
        for sw in (SYSTEM_WORDS[0], SYSTEM_WORDS[-1]):
            system = f"Decode {sw}. " + " ".join(rng.choices(WORDS, k=sw))
            got = [timings(url, system, f"go {i}", max_tokens=256) for i in range(repeats)]
            ctx = got[0]["cache_n"] + got[0]["prompt_n"] + got[0]["predicted_n"]
            out["decode"][sw] = (ctx, statistics.median(t["predicted_per_token_ms"] for t in got))
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF file (default: the demo model); the model's own chat template")
    ap.add_argument("--out", default="docs/bench_cpu_flash_attn.md")
    a = ap.parse_args()
    model = a.model or ensure_demo_model()
    on, off = measure("on", a.repeats, model), measure("off", a.repeats, model)
    lines = [f"### CPU flash attention ({model.name}, `-t 1`, 4 slots, median of {a.repeats})", "",
             "| case | tokens | `-fa on` ms | `-fa off` ms | on ÷ off |", "|---|---|---:|---:|---:|"]
    for sw in SYSTEM_WORDS:
        n, a_ms = on["cold"][sw]
        b_ms = off["cold"][sw][1]
        lines.append(f"| cold prompt | {n} | {a_ms:.1f} | {b_ms:.1f} | {a_ms / b_ms:.2f} |")
    for (sw, uw), (cache_n, prompt_n, a_ms) in on["cached"].items():
        b_ms = off["cached"][(sw, uw)][2]
        lines.append(f"| cached head + new tokens | {cache_n} + {prompt_n} | {a_ms:.1f} | "
                     f"{b_ms:.1f} | {a_ms / b_ms:.2f} |")
    for sw, (ctx, a_ms) in on["decode"].items():
        b_ms = off["decode"][sw][1]
        lines.append(f"| decode, ms per token | context ≈ {ctx} | {a_ms:.3f} | {b_ms:.3f} | "
                     f"{a_ms / b_ms:.2f} |")
    md = "\n".join(lines) + "\n"
    Path(a.out).write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
