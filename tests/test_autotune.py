"""The autotuner (jax_moe/autotune.py): it keeps a tile only where the forward is measurably faster,
confirms a gain in alternating rounds, writes a cache file that later traces on the same GPU model
read first, and refuses what it cannot tune. How traces read the caches: tests/test_tile_caches.py.
The GPU test tunes a real block and checks the tuned forward against the float64 definition."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import np_moe, poison_memory, rel_err, random_routing
from jax_moe import MoEBlock, autotune
from jax_moe.backends import cutlass_tile_cache as tc
from jax_moe.backends import cutlass_tiles as ct
from jax_moe.config import MoEConfig
from jax_moe.device import device_kind
from tile_cache_cases import E, GEMM1, GEMM2, K, N, no_tile_caches, ship  # noqa: F401 (the autouse fixture)

TILE_IDS = {name: i for i, name in enumerate(ct.TILES)}


def two_gemm_forward(w, x, topk_weights, topk_ids):
    """A stand-in forward with two grouped GEMMs (T*k rows over E experts) that picks their tiles as
    the cutlass backend does, and returns the tiles it was traced with, encoded in its output."""
    rows = topk_ids.size
    t1 = ct.pick_tile(rows, E, n=N, k=K, kind="bf16_kn_act")
    t2 = ct.pick_tile(rows, E, n=K, k=N // 2, kind="bf16_kn")
    return jnp.zeros_like(x, jnp.float32) + (100 * TILE_IDS[t1] + TILE_IDS[t2]) + 0 * w


def synthetic_timer(times: dict, calls: list | None = None):
    """A timer that runs the program once and answers from the tiles it was traced with:
    ``times[(gemm, tile)]`` ms off a 1.0 ms forward for each GEMM on that tile; ``calls``, if given,
    gains an entry per timing."""
    names = {i: name for name, i in TILE_IDS.items()}

    def timer(fn, inputs, vary):
        if calls is not None:
            calls.append(1)
        code = int(jax.block_until_ready(fn(*inputs[0]))[0, 0])
        t1, t2 = names[code // 100], names[code % 100]
        return 1.0 - times.get(("gemm1", t1), 0.0) - times.get(("gemm2", t2), 0.0)

    return timer


CFG = MoEConfig(E, 4, K, N // 2)


def trials(*keys: str) -> int:
    """The tuner's trials of GEMMs ``keys``: each on each tile of its own but today's pick."""
    return sum(len(ct.tiles_for(key.split("/")[0])) - 1 for key in keys)


def test_tune_keeps_a_tile_only_where_the_forward_is_faster_by_more_than_min_gain(tmp_path):
    path = tmp_path / "tiles.json"
    timer = synthetic_timer({("gemm1", "pingpong_64x256"): 0.2, ("gemm2", "coop_128x128"): 0.01})
    report = autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), path=path, timer=timer, log=None)
    by_key = {g.key: g for g in report.gemms}
    assert set(by_key) == {GEMM1, GEMM2}
    assert by_key[GEMM1].chosen == "pingpong_64x256" and by_key[GEMM1].gain == pytest.approx(1.25)
    assert by_key[GEMM2].chosen == by_key[GEMM2].default  # 1% faster: inside the timer's spread, not kept
    assert sorted(by_key[GEMM1].cell) == sorted(set(ct.TILES) - {"pingpong_192x128"})  # every tile of its own
    assert sorted(by_key[GEMM2].cell) == sorted(set(ct.TILES) - set(ct.ONE_KIND_TILES))  # not those it runs as another
    (fwd,) = report.forwards
    assert fwd.default_ms == pytest.approx(1.0) and fwd.tuned_ms == pytest.approx(0.8)
    assert fwd.kept and "| 64 | 1.0000 | 0.8000 | 1.25x | yes |" in report.markdown()
    every_tile = report.markdown().split("each GEMM on each tile")[1]  # and each tile's figure per GEMM
    assert f"| 64 | {GEMM1} | " in every_tile and "0.8000" in every_tile and every_tile.count("| 64 |") == 2
    doc = json.loads(path.read_text())
    assert doc["format"] == tc.FORMAT and doc["device"] == device_kind()
    assert doc["gemms"][GEMM1] == {"16": "pingpong_64x256"}  # 64 tokens x top-4 over 16 experts
    assert doc["figures"][GEMM1]["16"]["pingpong_64x256"] == pytest.approx(0.8)


def test_gains_the_whole_forward_does_not_confirm_are_not_kept(tmp_path):
    """Each GEMM alone on pingpong_64x256 timed 5% faster, both together not: today's picks stay."""
    names = {i: name for name, i in TILE_IDS.items()}

    def timer(fn, inputs, vary):
        code = int(jax.block_until_ready(fn(*inputs[0]))[0, 0])
        on = [names[code // 100] == "pingpong_64x256", names[code % 100] == "pingpong_64x256"]
        return 0.95 if sum(on) == 1 else 1.0

    report = autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), path=tmp_path / "t.json",
                                   timer=timer, log=None)
    assert all(g.chosen == g.default and g.cell["pingpong_64x256"] == pytest.approx(0.95) for g in report.gemms)
    (fwd,) = report.forwards
    assert not fwd.kept and fwd.tuned_ms == pytest.approx(1.0)
    assert all(t != "pingpong_64x256" for pts in tc.load(tmp_path / "t.json", ct.TILES).gemms.values() for _, t in pts)


def test_confirmation_rounds_alternate_the_two_forwards_and_keep_a_gain_their_median_ratio_shows(tmp_path):
    """rounds=3: after the trials (each GEMM on each tile of its own but today's), each GEMM's pick
    runs off against its closest tile (3 pairs of timings each), then today's forward and the tuned
    one are timed back to back three times; a 2% gain clears min_gain=1%, and the ms reported are
    medians."""
    calls = []
    report = autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), min_gain=0.01, rounds=3,
                                   timer=synthetic_timer({("gemm1", "pingpong_64x256"): 0.02}, calls), log=None)
    (fwd,) = report.forwards
    assert len(calls) == 1 + trials(GEMM1, GEMM2) + 2 * (2 * 3) + 2 * 3
    assert fwd.kept and fwd.default_ms == pytest.approx(1.0) and fwd.tuned_ms == pytest.approx(0.98)
    assert {g.key: g.chosen for g in report.gemms}[GEMM1] == "pingpong_64x256"


def trial_then_rounds(first: dict, later: dict, calls: list):
    """A timer whose first timing of each (gemm, tile) forward reads ``first``'s ms off a 1.0 ms
    forward and every later one ``later``'s: one trial off by more than a gap the rounds show."""
    names, seen = {i: name for name, i in TILE_IDS.items()}, set()

    def timer(fn, inputs, vary):
        code = int(jax.block_until_ready(fn(*inputs[0]))[0, 0])
        on = (("gemm1", names[code // 100]), ("gemm2", names[code % 100]))
        calls.append(on)
        ms = 1.0
        for cell in on:
            ms -= (later if cell in seen else first).get(cell, 0.0)
            seen.add(cell)
        return ms

    return timer


def test_a_tile_whose_one_trial_read_slower_wins_the_run_off_its_rounds_show():
    """GEMM1 on pingpong_64x256, the second fastest in the trials, timed 2.7% slower than today's
    pick once and 5% faster every time after (as a trial inside the timer's spread can): with
    rounds it runs off against today's pick and is kept; with one round the trial decides and
    today's pick stays."""
    today = ct.pick_tile(64 * CFG.top_k, E, n=N, k=K, kind="bf16_kn_act")
    first = {("gemm1", tile): -0.10 for tile in ct.TILES if tile not in (today, "pingpong_64x256")}
    first[("gemm1", "pingpong_64x256")] = -0.027
    later = {("gemm1", "pingpong_64x256"): 0.05}
    for rounds, kept in ((3, "pingpong_64x256"), (1, None)):
        report = autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), min_gain=0.01, rounds=rounds,
                                       timer=trial_then_rounds(first, later, []), log=None)
        g1 = {g.key: g for g in report.gemms}[GEMM1]
        assert g1.chosen == (kept or g1.default) and g1.default != "pingpong_64x256"
        if kept:  # the figures kept are the rounds' medians
            assert g1.cell["pingpong_64x256"] == pytest.approx(0.95) and g1.cell[g1.default] == pytest.approx(1.0)
            assert report.forwards[0].kept


def test_a_lucky_trial_loses_the_run_off_and_needs_no_confirmation():
    """GEMM1 on pingpong_64x256 timed 4% faster once and level after: the run-off keeps today's
    pick, so no whole-forward confirmation runs."""
    calls = []
    report = autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), min_gain=0.01, rounds=3,
                                   timer=trial_then_rounds({("gemm1", "pingpong_64x256"): 0.04}, {}, calls),
                                   log=None)
    assert all(g.chosen == g.default for g in report.gemms) and not report.forwards[0].kept
    assert len(calls) == 1 + trials(GEMM1, GEMM2) + 2 * (2 * 3)  # trials and two run-offs, nothing after


def test_a_gap_wider_than_one_trials_spread_is_taken_from_the_trials():
    """Beyond RUNOFF_WITHIN either way no run-off is timed: the trial decides."""
    timed = []
    time_on = lambda tile: timed.append(tile) or 1.0  # noqa: E731
    slower = {"a": 1.0, "b": 1.0 + autotune.RUNOFF_WITHIN + 0.01}
    faster = {"a": 1.0, "b": 1.0 - autotune.RUNOFF_WITHIN - 0.01}
    assert autotune._runoff(dict(slower), "a", time_on, 3, 0.01) == ("a", False)
    assert autotune._runoff(dict(faster), "a", time_on, 3, 0.01) == ("b", False)
    assert not timed
    assert autotune._runoff({"a": 1.0, "b": 1.02}, "a", time_on, 3, 0.01) == ("a", True) and len(timed) == 6


def clocked(ms: float, calls):
    """A forward of ``ms`` on a GPU that slows by 0.5% with each timing (``calls`` counts them all)."""
    return lambda: ms * (1 + 0.005 * next(calls))


def test_a_drift_over_the_rounds_falls_on_both_forwards():
    calls = iter(range(100))
    default_ms, tuned_ms, kept = autotune._confirm(1.0, clocked(1.0, calls), clocked(0.97, calls), 3, 0.01)
    assert kept  # each round's pair, back to back, still shows the 3%
    assert default_ms == pytest.approx(1.01) and tuned_ms == pytest.approx(0.97 * 1.015)


def test_one_lucky_round_of_three_does_not_make_a_gain():
    today, tuned = iter([1.0, 1.0, 1.0]), iter([0.90, 1.0, 1.0])
    _, _, kept = autotune._confirm(1.0, lambda: next(today), lambda: next(tuned), 3, 0.01)
    assert not kept  # the median ratio is 1.0 (a mean would have said 3.7%)


def test_one_round_sets_the_tuned_forward_against_todays_faster_timing():
    """One round (the default): today's is the faster of its timing before the trials and one after."""
    default_ms, tuned_ms, kept = autotune._confirm(0.95, lambda: 1.0, lambda: 0.96, 1, 0.01)
    assert (default_ms, tuned_ms, kept) == (0.95, 0.96, False)
    assert autotune._confirm(1.0, lambda: 1.0, lambda: 0.95, 1, 0.03)[2]


def test_tiles_tuned_on_another_gpu_model_are_not_used(tmp_path):
    path = tmp_path / "tiles.json"
    cache = tc.TileCache("Some Other GPU")
    cache.record(GEMM1, 16.0, "pingpong_64x256", {"pingpong_64x256": 0.5})
    cache.save(path)
    autotune.use(path)
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == ct.heuristic_tile(16)
    with pytest.raises(ValueError, match="Some Other GPU"):  # and the tuner will not mix them
        autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), path=path,
                              timer=synthetic_timer({}), log=None)


def test_a_cache_file_round_trips_and_tuning_again_keeps_the_other_gemms(tmp_path):
    path = tmp_path / "tiles.json"
    cache = tc.TileCache(device_kind())
    other = tc.gemm_key("fp8", 8, 1024, 2048)
    cache.record(other, 2.0, "coop_128x128", {"coop_128x128": 0.3, "pingpong_64x128": 0.4})
    cache.record(other, 0.5, "pingpong_64x128", {"pingpong_64x128": 0.2})
    cache.save(path)
    back = tc.load(path, ct.TILES)
    assert back.gemms == {other: ((0.5, "pingpong_64x128"), (2.0, "coop_128x128"))}
    assert back.figures == cache.figures
    autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), path=path, timer=synthetic_timer({}), log=None)
    assert set(tc.load(path, ct.TILES).gemms) == {other, GEMM1, GEMM2}


def test_named_tiles_are_timed_against_todays_picks_alone_and_the_files_other_figures_stay(tmp_path):
    """tiles=["coop_192x256"]: GEMM1 (an act kind) is timed on that tile once beside today's pick, and
    GEMM2 (a plain kind, which has no kernel for it) on nothing; the file's full sweep from before
    keeps its figures of the other tiles at the point, beside the new one."""
    path = tmp_path / "tiles.json"
    autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), path=path, timer=synthetic_timer({}),
                          log=None)
    swept = tc.load(path, ct.TILES).figures[GEMM1]["16"]
    calls = []
    report = autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), path=path, tiles=["coop_192x256"],
                                   timer=synthetic_timer({("gemm1", "coop_192x256"): 0.2}, calls), log=None)
    by_key = {g.key: g for g in report.gemms}
    assert sorted(by_key[GEMM1].cell) == sorted({by_key[GEMM1].default, "coop_192x256"})
    assert list(by_key[GEMM2].cell) == [by_key[GEMM2].default]
    assert by_key[GEMM1].chosen == "coop_192x256" and report.forwards[0].kept
    assert len(calls) == 1 + 1 + 2  # today's forward, the one trial, the confirmation's two timings
    cache = tc.load(path, ct.TILES)
    assert cache.gemms[GEMM1] == ((16.0, "coop_192x256"),)
    figures = cache.figures[GEMM1]["16"]
    assert figures["coop_192x256"] == pytest.approx(0.8)
    assert set(figures) == set(swept) | {"coop_192x256"}
    assert all(figures[t] == pytest.approx(swept[t]) for t in swept if t not in by_key[GEMM1].cell)


def test_tuning_forces_the_named_gemms_records_every_pick_and_ignores_the_cache(tmp_path):
    cache = tc.TileCache(device_kind())
    cache.record(GEMM2, 4.0, "coop_128x256", {"coop_128x256": 0.1})
    cache.save(tmp_path / "t.json")
    autotune.use(tmp_path / "t.json")
    with ct.tuning({GEMM1: "coop_128x128"}) as trial:
        assert ct.pick_tile(4 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_128x128"
        assert ct.pick_tile(4 * E, E, n=K, k=N // 2, kind="bf16_kn") == ct.heuristic_tile(4)  # not the cache's
    assert trial.picks == [(GEMM1, 4.0, "coop_128x128"), (GEMM2, 4.0, ct.heuristic_tile(4))]
    assert ct.pick_tile(4 * E, E, n=K, k=N // 2, kind="bf16_kn") == "coop_128x256"  # outside: the cache again
    with pytest.raises(ValueError, match="not built"):
        with ct.tuning({GEMM1: "huge_tile"}):
            pass


def test_the_tuner_starts_from_the_shipped_tiles_not_the_users(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    ship(tmp_path, device_kind(), GEMM2, {4.0: "coop_128x256"})
    (tmp_path / "user").mkdir()
    cache = tc.TileCache(device_kind())
    cache.record(GEMM1, 4.0, "pingpong_64x256", {"pingpong_64x256": 0.5})
    cache.save(tmp_path / "user" / "t.json")
    autotune.use(tmp_path / "user" / "t.json")
    with ct.tuning() as trial:
        ct.pick_tile(4 * E, E, n=N, k=K, kind="bf16_kn_act")
        ct.pick_tile(4 * E, E, n=K, k=N // 2, kind="bf16_kn")
    assert trial.picks == [(GEMM1, 4.0, ct.heuristic_tile(4)), (GEMM2, 4.0, "coop_128x256")]


def test_token_counts_on_the_decode_path_have_nothing_to_tune():
    report = autotune.tune_forward(lambda w, x, tw, ids: x * w, jnp.float32(1), CFG, (1,), timer=synthetic_timer({}),
                                   log=None)
    assert report.gemms == [] and report.forwards == []


def test_tune_refuses_what_it_cannot_tune(monkeypatch):
    with pytest.raises(ValueError, match="tokens"):
        autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (0,), log=None)
    with pytest.raises(ValueError, match="min_gain"):
        autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), min_gain=-1, log=None)
    with pytest.raises(ValueError, match="rounds must be a positive int, got 0"):
        autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), rounds=0, log=None)
    for tiles in (["coop_64x64"], [], "coop_192x256"):
        with pytest.raises(ValueError, match="tiles must be a non-empty list of the cutlass tiles"):
            autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), tiles=tiles, log=None)
    monkeypatch.setenv(ct.TILE_ENV, "coop_128x128")
    with pytest.raises(ValueError, match=ct.TILE_ENV):
        autotune.tune_forward(two_gemm_forward, jnp.float32(0), CFG, (64,), log=None)


def test_a_block_whose_experts_run_elsewhere_is_refused_with_the_backend_named():
    block = MoEBlock(64, 32, 4, 2, rngs=__import__("flax").nnx.Rngs(0), backend="xla")
    with pytest.raises(ValueError, match="'xla'.*'cutlass'"):
        autotune.tune(block, (64,), log=None)


def test_the_cutlass_forward_is_traced_with_each_trial_tile():
    """On the real pipeline (the kernels' CPU lowerings): the tuner finds both grouped GEMMs of the
    cutlass forward, and each trial's program was traced with the tile tried (else it raises)."""
    from jax_moe.backends import cutlass
    from jax_moe.backends.cutlass_scatter_gemm import scatters

    rng = np.random.default_rng(0)
    cfg = MoEConfig(8, 2, 128, 64)
    w13 = jnp.asarray(rng.standard_normal((8, 128, 128)) / 12, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((8, 128, 64)) / 8, jnp.bfloat16)

    def forward(w, x, tw, ids):
        return cutlass.apply(x, *w, tw, ids, cfg)

    timed = []

    def timer(fn, inputs, vary):
        timed.append(fn(*inputs[0]))
        return 1.0

    report = autotune.tune_forward(forward, (w13, w2), cfg, (16,), timer=timer, log=None)
    gemm2 = "bf16_scatter" if scatters("auto", bf16_out=True) else "bf16"  # the form finalize="auto" takes
    assert {g.key for g in report.gemms} == {tc.gemm_key("bf16", 8, 128, 128), tc.gemm_key(gemm2, 8, 128, 64)}
    assert len(timed) == 1 + trials(*(g.key for g in report.gemms))  # today's, then each GEMM on each other tile
    assert all(g.chosen == g.default for g in report.gemms)  # ties keep today's pick


def test_info_says_where_the_tiles_come_from(tmp_path):
    from jax_moe.info import tile_cache_status

    assert "no tuned-tile cache" in tile_cache_status()
    for device, says in ((device_kind(), "1 tuned GEMM shapes"), ("Some Other GPU", "not used")):
        cache = tc.TileCache(device)
        cache.record(GEMM1, 16.0, "pingpong_64x256", {"pingpong_64x256": 0.5})
        cache.save(tmp_path / f"{len(device)}.json")
        autotune.use(tmp_path / f"{len(device)}.json")
        assert says in tile_cache_status()


def test_info_names_the_tiles_shipped_for_this_gpu_model(tmp_path, monkeypatch):
    from jax_moe.info import tile_cache_status

    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    ship(tmp_path, device_kind(), GEMM1, {16.0: "pingpong_64x256"})
    assert f"1 shipped tuned GEMM shapes of {device_kind()}" in tile_cache_status()
    monkeypatch.setenv(tc.SHIPPED_ENV, "off")
    assert "shipped tuned" not in tile_cache_status()


def test_a_model_config_gives_the_routed_experts_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 4096, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "hidden_act": "silu"}))
    cfg = autotune.config_from_file(str(tmp_path), 3)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, cfg.activation) == \
        (128, 8, 4096, 1536, "silu")


def test_the_command_line_says_what_it_cannot_tune_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        autotune.main(["--shape", "16", "0", "128", "4"])
    assert stop.value.code == 2 and "hidden_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        autotune.main(["--config", str(tmp_path / "none.json")])
    assert stop.value.code == 2 and "none.json" in capsys.readouterr().err
    if jax.devices()[0].platform == "cpu":  # no cutlass backend here: refused with the reason
        with pytest.raises(SystemExit) as stop:
            autotune.main(["--shape", "16", "256", "128", "4", "--out", str(tmp_path / "t.json")])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "cutlass" in err and "Traceback" not in err


def test_the_command_line_tunes_the_scattering_forward_when_asked(tmp_path, monkeypatch):
    """--finalize scatter sets JAX_MOE_CUTLASS_FINALIZE for the forward it traces (its GEMM2 then
    has tile keys of its own, bf16_kn_scatter/...), before anything is tuned."""
    from jax_moe.backends.cutlass_scatter_gemm import FINALIZE_ENV

    monkeypatch.setenv(FINALIZE_ENV, "gather")
    seen = []

    def tune(block, tokens, **kw):
        seen.append(os.environ[FINALIZE_ENV])
        raise ValueError("stop here")

    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(autotune, "random_block", lambda cfg, scheme: None)
    with pytest.raises(SystemExit):
        autotune.main(["--shape", "16", "256", "128", "4", "--finalize", "scatter", "--out", str(tmp_path / "t.json")])
    assert seen == ["scatter"]


def test_the_command_line_passes_its_rounds_min_gain_and_tiles_to_the_tuner(tmp_path, monkeypatch):
    seen = {}

    def tune(block, tokens, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(autotune, "random_block", lambda cfg, scheme: None)
    with pytest.raises(SystemExit):
        autotune.main(["--shape", "16", "256", "128", "4", "--rounds", "3", "--min-gain", "0.01",
                       "--out", str(tmp_path / "t.json")])
    assert seen["rounds"] == 3 and seen["min_gain"] == 0.01 and seen["tiles"] is None
    with pytest.raises(SystemExit):
        autotune.main(["--shape", "16", "256", "128", "4", "--tiles", "coop_192x256", "pingpong_192x128",
                       "--out", str(tmp_path / "t.json")])
    assert seen["tiles"] == ["coop_192x256", "pingpong_192x128"]


@pytest.mark.gpu
def test_a_tuned_block_on_the_gpu_computes_the_definition(tmp_path):
    """tune() on a real prepared block: every tile timed for both GEMMs, the cache written; the block
    traced afterwards on the tuned tiles matches the float64 definition (outputs poisoned first)."""
    from flax import nnx

    from helpers import SCHEME_TOL, random_weights, skip_unless_available
    from jax_moe.backends.cutlass_scatter_gemm import scatters
    from jax_moe.checkpoint.readers import ExpertWeights, LayerTensors

    skip_unless_available("cutlass")
    rng = np.random.default_rng()
    e, h, i, k, t = 16, 512, 256, 4, 512
    w13, w2 = random_weights(rng, e, h, i, dtype=jnp.bfloat16)
    layer = LayerTensors(ExpertWeights(w13, w2), router=jnp.asarray(rng.standard_normal((e, h)), jnp.float32), top_k=k)
    block = MoEBlock.from_layer_tensors(layer, backend="cutlass")
    assert block.prepare("cutlass") == "cutlass"
    path = tmp_path / "tiles.json"
    report = autotune.tune(block, (t,), path=path, min_gain=0.0, log=None)
    # GEMM1 with its activation; GEMM2 in the form the forward runs (finalize "auto")
    gemm2 = "bf16_kn_scatter" if scatters("auto", bf16_out=True) else "bf16_kn"
    assert {g.key.split("/")[0] for g in report.gemms} == {"bf16_kn_act", gemm2}
    assert all(sorted(g.cell) == sorted(ct.tiles_for(g.key.split("/")[0])) and min(g.cell.values()) > 0
               for g in report.gemms)
    kept = {f.tokens: f.kept for f in report.forwards}
    for g in report.gemms:  # min_gain 0: the fastest, unless the whole forward did not confirm it
        assert g.chosen == (min(g.cell, key=g.cell.get) if kept[g.tokens] else g.default)

    autotune.use(path)
    for g in report.gemms:  # traces from now on take the tuned tiles
        kind, _, n, kk = g.key.split("/")
        assert ct.pick_tile(t * k, e, n=int(n), k=int(kk), kind=kind) == g.chosen
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    tw, ids = random_routing(rng, t, e, k)
    graphdef, state = nnx.split(block)
    fn = jax.jit(lambda s, v, a, b: nnx.merge(graphdef, s)._run_experts(v, a, b))
    poison_memory(jax.eval_shape(fn, state, x, tw, ids))
    got = fn(state, x, tw, ids)
    assert rel_err(got, np_moe(x, w13, w2, tw, ids)) < SCHEME_TOL["bf16"]
