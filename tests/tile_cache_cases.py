"""The tile-cache specs' shared problem (tests/test_autotune.py, tests/test_tile_caches.py): two
grouped GEMMs of one small layer, a fixture that hides every cache from a test, and a writer of
shipped caches."""

from __future__ import annotations

import pytest

from jax_moe.backends import cutlass_tile_cache as tc
from jax_moe.backends import cutlass_tiles as ct

E, N, K = 16, 256, 512
GEMM1, GEMM2 = tc.gemm_key("bf16_kn_act", E, N, K), tc.gemm_key("bf16_kn", E, K, N // 2)
SHIPPED = tc.SHIPPED_DIR  # the package's shipped caches (no_tile_caches hides them from the tests)


@pytest.fixture(autouse=True)
def no_tile_caches(monkeypatch, tmp_path_factory):
    """No forced tile, no user's cache and no shipped caches: each test sets the ones it needs.
    Autouse in every module that imports it."""
    monkeypatch.delenv(ct.TILE_ENV, raising=False)
    monkeypatch.delenv(tc.CACHE_ENV, raising=False)
    monkeypatch.delenv(tc.SHIPPED_ENV, raising=False)
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path_factory.mktemp("no_shipped_tiles")))
    tc.use(None)
    yield
    tc.use(None)


def ship(directory, device: str, key: str, points: dict[float, str]) -> None:
    """Writes a shipped cache of ``device`` holding GEMM ``key`` at ``points`` into ``directory``."""
    cache = tc.TileCache(device)
    for r, tile in points.items():
        cache.record(key, r, tile, {tile: 1.0})
    cache.save(directory / tc.shipped_file_name(device))
