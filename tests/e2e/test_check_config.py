"""``llama-gateway check-config`` against real workers: the per-slot context it prints is the
one the started llama-server reports in ``/slots`` (and ``/api/ps`` shows), including when the
model's training context caps the configured one."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT, base_config, free_port
from tests.e2e.compat_helpers import model
from workers.demo_model import write_demo_model

pytestmark = pytest.mark.slow


def test_check_config_context_matches_what_the_workers_report(tmp_path, gateway_factory):
    gguf = write_demo_model(tmp_path / "short.gguf", n_ctx_train=512)  # trained for 512
    cfg = base_config(free_port(), models=[
        model("short", path=str(gguf), slots=2, context=1024),  # capped by llama-server
        model("demo", slots=2, context=768),                    # not capped (4096 trained)
        # one KV buffer for all slots: each may use all of -c (check-config printed 256; a
        # fresh tester's find)
        model("uni", slots=4, context=256, args=["--kv-unified"]),
        # -np in args splits the plan's 2 × 8192 among 3 slots, 5,461 each, and each share is
        # capped at the training context before the start (3 × 4,096; capping the plan's
        # context first gave 2 × 4096 over 3, 2,816 each: a fresh tester's find)
        model("np3", slots=2, context=8192, args=["-np", "3"])])
    gw = gateway_factory(cfg)
    r = subprocess.run([sys.executable, "-m", "gateway", "check-config", "-c", str(gw.cfg_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    printed = {}
    for line in r.stdout.splitlines():
        wid, *fields = line.split("\t")
        ctx = next(f for f in fields if f.startswith("context/slot="))
        printed[wid] = int(ctx.split("=")[1].split()[0])
    assert "(capped from 1024: the model's training context)" in r.stdout
    for w in gw.workers():
        n_ctx = {s["n_ctx"] for s in gw.slots(w)}
        assert n_ctx == {printed[w["id"]]}, (w["id"], n_ctx, r.stdout)
    ps = {m["name"]: m["context_length"] for m in httpx.get(gw.url + "/api/ps").json()["models"]}
    assert ps == {"short:latest": 512, "demo:latest": 768, "uni:latest": 1024,
                  "np3:latest": 4096}
    assert "(--kv-unified in args: every slot may use the whole -c)" in r.stdout
    # the capped worker is started with -c for the context it gets: llama-server allocated the
    # KV cache for all of -c (2 × 1024 here) while it used 2 × 512 (a fresh tester's find)
    argv = {e["worker"]: e["argv"].split() for e in _events(gw, "worker.spawned")}
    assert argv["short-cpu0"][argv["short-cpu0"].index("-c") + 1] == str(2 * 512)
    assert argv["demo-cpu0"][argv["demo-cpu0"].index("-c") + 1] == str(2 * 768)
    # with -np 3 in args (and no -c) too: -c for 3 slots of 4,096, where 2 × 8192 left 27 % of
    # the KV cache unused (a fresh tester's find); started as 3 slots, so no slots_mismatch
    argv_np3 = argv["np3-cpu0"]
    assert argv_np3[argv_np3.index("-c") + 1] == str(3 * 4096), argv_np3
    assert not [e for e in _events(gw, "worker.slots_mismatch") if e["worker"] == "np3-cpu0"]
    capped = _events(gw, "worker.context_capped")
    assert sorted((e["worker"], e["configured"], e["trained"]) for e in capped) == [
        ("np3-cpu0", 5461, 4096), ("short-cpu0", 1024, 512)]


def _events(gw, name: str) -> list[dict]:
    import json
    return [e for line in gw.log_path.read_text().splitlines() if line.startswith("{")
            and (e := json.loads(line)).get("event") == name]


def _cli(verb: str, cfg_path, env_extra: dict | None = None, timeout: int = 60):
    import os
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "gateway", verb, "-c", str(cfg_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_check_config_refuses_what_serve_refuses_about_the_address_and_the_cache(tmp_path):
    """check-config passed a ``listen`` host that does not resolve or is not this machine's,
    and a cache that is a file, all of which ``serve`` refuses with exit 2 (the cache one with
    a traceback and exit 1 for the built-in demo model, restarted by systemd every 5 s: a fresh
    tester's finds)."""
    import yaml
    from workers.provision import ensure_llama_server
    binary = str(ensure_llama_server())  # given, so that nothing is looked up in the cache
    # (an unresolvable host goes the same way; not tried here, where DNS may be slow)
    for listen, says in (("192.0.2.1:18537", "listen: cannot listen on 192.0.2.1:18537"),):
        cfg = base_config(free_port())
        cfg.update(listen=listen, llama_server={"binary": binary})
        path = tmp_path / "addr.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for verb in ("check-config", "serve"):
            r = _cli(verb, path)
            assert r.returncode == 2 and f"{path}: {says}" in r.stderr, (verb, r.stderr)
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    cfg = base_config(free_port())
    cfg["llama_server"] = {"binary": binary}
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {"LLAMA_GATEWAY_CACHE": str(cache)}
    r = _cli("check-config", path, env)
    assert r.returncode == 2, r
    assert (f"{path}: models[0].path: cannot write the built-in demo model to "
            f"{cache}/models/demo.gguf: {cache} is not a directory") in r.stderr, r.stderr
    assert f"{path}: cannot create the workers' run directory under {cache}/run" in r.stderr
    r = _cli("serve", path, env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (f"{path}: models[0].path: cannot write the built-in demo model to "
            f"{cache}/models/demo.gguf ($LLAMA_GATEWAY_CACHE, default ~/.cache/llama-gateway): "
            f"Not a directory") in r.stderr, r.stderr
    # without a binary the first use of the cache is llama-server's: the same, worded for it
    del cfg["llama_server"]
    path.write_text(yaml.safe_dump(cfg))
    r = _cli("serve", path, env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}: llama_server.binary: cannot use the cache {cache} " in r.stderr, r.stderr
