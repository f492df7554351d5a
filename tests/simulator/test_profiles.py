"""GpuProfile.from_json / resolve_profile and the measured cpu-demo profile (gateway/simulator/worker.py)."""

import json
from pathlib import Path

import pytest

from gateway.simulator.worker import PROFILES, GpuProfile, resolve_profile

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"name": "x", "prefill_tps": 1000.0, "decode_s1": 0.001, "batch_slope": 0.2,
        "attn_s_per_token": 1e-7, "source": "test"}


def write(tmp_path, doc) -> Path:
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(doc))
    return p


def test_from_json_reads_the_profile_object_or_a_bare_one(tmp_path):
    want = GpuProfile("x", 1000.0, 0.001, batch_slope=0.2, attn_s_per_token=1e-7, source="test")
    assert GpuProfile.from_json(write(tmp_path, {"profile": GOOD, "prefill": []})) == want
    assert GpuProfile.from_json(write(tmp_path, GOOD)) == want


def test_from_json_defaults_name_and_source_to_the_file(tmp_path):
    p = write(tmp_path, {k: v for k, v in GOOD.items() if k not in ("name", "source")})
    prof = GpuProfile.from_json(p)
    assert (prof.name, prof.source) == ("prof.json", str(p))


@pytest.mark.parametrize("key, value", [("decode_s1", 0), ("prefill_tps", -1.0),
                                        ("batch_slope", -0.1), ("attn_s_per_token", "1e-7"),
                                        ("decode_s1", True), ("prefill_tps", None),
                                        # NaN, infinities and absurd sizes ran the simulation
                                        # forever (a fresh tester's find)
                                        ("prefill_tps", float("nan")), ("decode_s1", float("inf")),
                                        ("batch_slope", 1e300), ("attn_s_per_token", 2.0)])
def test_from_json_names_a_bad_figure(tmp_path, key, value):
    p = write(tmp_path, {"profile": {**GOOD, key: value}})
    with pytest.raises(ValueError, match=f"profile.{key}"):
        GpuProfile.from_json(p)


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"profile": 3}'])
def test_from_json_rejects_other_files(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ValueError, match="bad.json"):
        GpuProfile.from_json(p)


def test_resolve_profile_by_name_or_path(tmp_path):
    assert resolve_profile("cpu-demo") is PROFILES["cpu-demo"]
    assert resolve_profile(str(write(tmp_path, GOOD))).name == "x"
    with pytest.raises(ValueError, match="unknown profile"):
        resolve_profile("no-such-gpu")


@pytest.mark.parametrize("name, path", [("cpu-demo", "cpu-demo.json"),
                                        ("h200-llama8b-q4-measured", "h200-llama8b-q4.json")])
def test_measured_profiles_hold_the_figures_of_their_calibration_files(name, path):
    measured = GpuProfile.from_json(ROOT / "docs/calibration" / path)
    built_in = PROFILES[name]
    for key in ("prefill_tps", "decode_s1", "batch_slope", "attn_s_per_token"):
        assert getattr(built_in, key) == pytest.approx(getattr(measured, key), rel=5e-3), key
