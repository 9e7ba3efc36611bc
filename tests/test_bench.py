"""bench/moe_bench.py runs every scheme it offers (on CPU: the tiny demo model, pure JAX)."""

import os

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def moe_bench(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import moe_bench

    return moe_bench


def test_every_scheme_has_its_weight_width_and_math(moe_bench):
    """Weight bytes include the scales; FP8 products count at twice the bf16 peak."""
    assert moe_bench.SCHEMES["bf16"] == moe_bench.SCHEMES["f16"] == 2
    assert moe_bench.SCHEMES["fp8_block"] == pytest.approx(1 + 4 / 128**2)
    assert moe_bench.SCHEMES["w4a8"] == pytest.approx(0.5 + 4 / 128)
    m = moe_bench.MODELS["tiny"]
    _, _, bf16_flops = moe_bench.roofline(m, 4096, 1e12, 1e12, "bf16")
    floor_bf16, _, _ = moe_bench.roofline(m, 4096, 1e30, 1e12, "bf16")
    for scheme in moe_bench.FP8_MATH:
        floor, _, flops = moe_bench.roofline(m, 4096, 1e30, 1e12, scheme)
        assert flops == bf16_flops and floor == pytest.approx(floor_bf16 / 2)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
@pytest.mark.parametrize("scheme", [s if s == "bf16" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in ("bf16", "f16", "fp8", "fp8_block", "mxfp4", "w4a8")])
def test_each_scheme_runs_and_prints_a_row_per_token_count(moe_bench, scheme, capsys):
    assert scheme in moe_bench.SCHEMES
    moe_bench.main(["--scheme", scheme, "--tokens", "1", "5"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [r.split(" | ")[1] for r in rows] == ["1", "5"]
    for r in rows:  # the xla column is a time, never n/a
        assert float(r.split(" | ")[2]) > 0


@pytest.mark.parametrize("model", [pytest.param("tiny", marks=pytest.mark.slow), "tiny_mxfp4"])
def test_load_layer_writes_loads_and_matches_the_format_reference(monkeypatch, model, capsys):
    """bench/load_layer.py: a synthetic checkpoint in the release's on-disk form (DeepSeek-V3 FP8
    blocks + shared expert, GPT-OSS MXFP4) loads, runs, and matches its float32 reference."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import load_layer

    assert load_layer.main(["--model", model, "--tokens", "3"]) == 0
    assert "PASS" in capsys.readouterr().out
