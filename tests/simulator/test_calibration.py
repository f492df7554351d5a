"""The fitting arithmetic of gateway/simulator/calibration.py (no llama-server)."""

import json

import pytest

from gateway.simulator.calibration import (
    DecodePoint,
    PrefillPoint,
    fit_decode,
    fit_prefill,
    fit_profile,
    profile_dict,
    step_s,
)
from gateway.simulator.worker import GpuProfile

TRUE = GpuProfile("t", 20000.0, 0.0002, batch_slope=0.4, attn_s_per_token=1e-6)
PLAN = [(1, 8, 256), (2, 8, 256), (4, 8, 256), (1, 1024, 128), (1, 2048, 128), (1, 3072, 128)]


def points(profile=TRUE, noise=()):
    out = []
    for i, (b, p, n) in enumerate(PLAN):
        kv = DecodePoint(b, p, n, 0.0).kv_tokens
        out.append(DecodePoint(b, p, n, step_s(profile, b, kv) * (1 + (noise[i] if noise else 0))))
    return out


def test_kv_tokens_is_the_mean_over_the_decode_window():
    assert DecodePoint(4, 100, 50, 0.0).kv_tokens == 4 * 125


def test_fit_decode_recovers_the_model_figures():
    s1, slope, attn = fit_decode(points())
    assert s1 == pytest.approx(TRUE.decode_s1, rel=1e-9)
    assert slope == pytest.approx(TRUE.batch_slope, rel=1e-9)
    assert attn == pytest.approx(TRUE.attn_s_per_token, rel=1e-9)


def test_fit_decode_with_noise_stays_close():
    s1, slope, attn = fit_decode(points(noise=(0.02, -0.02, 0.01, -0.01, 0.02, -0.02)))
    assert s1 == pytest.approx(TRUE.decode_s1, rel=0.15)
    assert slope == pytest.approx(TRUE.batch_slope, rel=0.3)
    assert attn == pytest.approx(TRUE.attn_s_per_token, rel=0.1)


def test_negative_term_is_dropped_and_the_rest_refitted():
    flat = GpuProfile("f", 1.0, 0.0005, batch_slope=0.3, attn_s_per_token=0.0)
    pts = points(flat)
    # long-context points a little faster than short ones: the raw fit's attention cost < 0
    pts = [DecodePoint(p.streams, p.prompt_tokens, p.predicted,
                       p.step_s * (0.97 if p.prompt_tokens > 8 else 1.0)) for p in pts]
    s1, slope, attn = fit_decode(pts)
    assert attn == 0.0
    assert slope > 0 and s1 > 0


@pytest.mark.parametrize("pts, msg", [
    ([DecodePoint(1, 8, 8, 0.001)] * 2, "at least 3"),
    ([DecodePoint(1, p, 8, 0.001 * p) for p in (8, 100, 1000)], "two batch sizes"),
    ([DecodePoint(b, 8, 8, 0.001 * b) for b in (1, 2, 4)], "two contexts"),
])
def test_fit_decode_refuses_points_that_cannot_separate_the_terms(pts, msg):
    with pytest.raises(ValueError, match=msg):
        fit_decode(pts)


def test_fit_prefill_is_all_tokens_over_all_seconds():
    assert fit_prefill([PrefillPoint(100, 0.01), PrefillPoint(300, 0.03)]) == pytest.approx(10000)
    with pytest.raises(ValueError):
        fit_prefill([])


def test_fit_profile_round_trips_through_json(tmp_path):
    prof = fit_profile("cal", [PrefillPoint(2000, 0.1)], points(), "here")
    assert prof.prefill_tps == pytest.approx(20000)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profile": profile_dict(prof), "decode": []}))
    assert GpuProfile.from_json(path) == prof
