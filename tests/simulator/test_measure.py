"""gateway/simulator/measure.py without a server: the stored calibration's raw measurements
refit to its own profile, and the table shows every measured row."""

import json
from pathlib import Path

import pytest

from gateway.simulator.measure import fit, table

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
