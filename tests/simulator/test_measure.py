"""gateway/simulator/measure.py without a server: the stored calibration's raw measurements
refit to its own profile, the table shows every measured row, and the server's
``LLAMA_ARG_*`` environment is what a calibration records."""

import json
from pathlib import Path

import pytest

from gateway.simulator.measure import fit, server_env, table
from workers.process import FLASH_ATTN_ENV, LaunchSpec

DOC = Path(__file__).resolve().parents[2] / "docs/calibration/cpu-demo.json"


def test_stored_measurements_refit_to_the_stored_profile():
    doc = json.loads(DOC.read_text())
    prof = fit(doc, doc["profile"]["name"], doc["profile"]["source"])
    for key in ("prefill_tps", "decode_s1", "batch_slope", "attn_s_per_token"):
        assert getattr(prof, key) == pytest.approx(doc["profile"][key], rel=1e-9), key
    assert all(r["model_ms"] > 0 for r in doc["decode"])


def test_table_has_a_row_per_measurement():
    doc = json.loads(DOC.read_text())
    fit(doc, "x", "y")
    md = table(doc)
    assert md.count("\n| ") >= 4 + len(doc["prefill"]) + len(doc["decode"])
    assert "no (check)" in md


def test_server_env_records_the_cpu_flash_attn_default_and_no_key(monkeypatch):
    monkeypatch.delenv(FLASH_ATTN_ENV, raising=False)
    monkeypatch.setenv("LLAMA_API_KEY", "outer")
    spec = LaunchSpec("calibrate", Path("/bin/true"), Path("/m.gguf"), "demo", (), 8, 4096, 1)
    env = server_env(spec)
    assert env[FLASH_ATTN_ENV] == "off"
    assert all(k.startswith("LLAMA_ARG_") for k in env)
    gpu = LaunchSpec("calibrate", Path("/bin/true"), Path("/m.gguf"), "demo", (0,), 8, 4096, 1)
    assert FLASH_ATTN_ENV not in server_env(gpu)


def test_stored_calibration_ran_with_cpu_flash_attn_off():
    doc = json.loads(DOC.read_text())
    assert doc["server"]["env"][FLASH_ATTN_ENV] == "off"
