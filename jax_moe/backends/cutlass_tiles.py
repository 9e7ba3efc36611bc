"""Which CUTLASS tile the cutlass backend's grouped GEMMs run with, chosen at trace time.

The SM90 grouped GEMM (``ffi/cutlass``) is built in eight tile configurations (:data:`TILES`):

- ``pingpong_64x128``: 64-row tiles, two consumer warpgroups on alternating tiles. Few rows per
  expert (decode, small batches): the weights stream, and a 64-row tile wastes least.
- ``pingpong_64x128_k256``: the same with a K tile of 256 bytes per row (128 bf16, 256 fp8): each
  stage reads twice as long a run of every weight row, half as many stages. Measured 1-6% faster
  than ``pingpong_64x128`` on the long-K weight-streaming GEMMs (DeepSeek-V3, GPT-OSS), slower on
  short K.
- ``pingpong_64x256``: 64x256 pingpong, half the tiles of 64x128; fastest on some mid-size cells
  (Mixtral GEMM1 at 256 rows per expert: 1.19x ``coop_128x256``; Qwen3's GEMM1 with its
  activation fused at 256 rows per expert: 1.26x).
- ``coop_128x128``: 128x128 tiles, both warpgroups on one tile.
- ``coop_128x256``: 128x256 tiles on a 2x1 cluster (two CTAs share the weight tile by TMA
  multicast). Many rows per expert (prefill, training), bf16 and FP8 (the FP8 kernels accumulate
  without promotion into a second register accumulator, which would not fit at this tile).
- ``coop_128x256_c1``: the same tile on no cluster. The grouped scheduler rounds each expert's
  row tiles up to whole clusters, so on the 2x1 cluster an expert of ~128 rows runs two 128-row
  tiles; on random routing the cluster multiplies 1.35 times the rows this tile does at 128 rows
  per expert, 1.11 at 512, 1.03 at 2048. Without the cluster each tile reads its weight tile
  through L2 on its own. On an H200, from 128 to 1024 rows per expert, whole layers in a loop ran
  2-8% faster on it than on the clustered tile (GPT-OSS-120B, DeepSeek-V3, Qwen3-30B-A3B, bf16
  and FP8; one GEMM up to 12%). On Mixtral-8x7B they were level at 1024 and 4096 rows (1.000 and
  1.015, within the spread of the rounds); from 1536 rows the clustered tile stays.
- ``coop_192x256``: GEMM1 with its activation fused (the act kinds) on 192-row tiles whose two
  warpgroups split the columns; the tile loads and multiplies only its 64-row blocks that hold rows.
  An expert of up to 192 rows then has one row tile, so no two CTAs read the same weight tile, and
  multiplies its rows rounded up to 64, where the 128-row tiles round them up to 128. On random
  routing at about 128 rows per expert, half the experts need a second 128-row tile for a few rows.
  The other kinds run it as ``coop_128x256_c1``. On an H200 the shipped tiles take it for
  GPT-OSS-120B's and DeepSeek-V3's GEMM1 at 128 rows per expert (4096 tokens; from
  :data:`ROW_BLOCK_TILE_FROM_ROWS` rows), where it made their bf16 layers 3% and 6% faster in a loop of
  layers, and their FP8 layers 2.3% and 0.8% (FP8 GEMM1 4.1% and 1.4%). It takes GPT-OSS-120B's
  GEMM1 at 512 rows too, where an expert needs three row tiles instead of four: at 16384 tokens
  GEMM1 ran 8.7% (bf16) and 4.6% (FP8) faster, the layer 5.9% and 3.7%; and its FP8 GEMM1 at 256
  rows (0.5% at 8192 tokens; in bf16 there the layer gained 0.2%, and the 128x256 tile stays).
  Qwen3-30B-A3B's GEMM1 gained 1.2% per layer at 512 rows but lost 7% at 256, so its crossover may
  lie inside the 512-row point's reach, and ``pingpong_64x256`` stays; DeepSeek-V3's lost 10% per
  layer at 256. Neither the H100 table nor the heuristic picks it.
  ``JAX_MOE_CUTLASS_SKIP_BLOCKS=0`` multiplies every block, which times the tile without the skip.
  Its row tiles differ in cost (one, two or three blocks), so its CTAs take their tiles from a
  counter as they go rather than in a fixed deal: on an H200 at 4096 tokens, GPT-OSS-120B's GEMM1
  ran 2-3.5% faster and DeepSeek-V3's 1.3-1.6%. ``JAX_MOE_CUTLASS_DYNAMIC_TILES`` (a mask: 1, 2
  and 4 for every unclustered cooperative tile of the plain, act and scatter kinds, 8 for this tile and
  ``pingpong_192x128``; default 8, 0 for none) chooses which GEMMs do.
- ``pingpong_192x128``: GEMM2 with its un-permute fused (the scatter kinds) on 192-row tiles that,
  like ``coop_192x256``, load and multiply only their 64-row blocks with rows, each consumer
  warpgroup on a tile of its own, so that one warpgroup's scatter epilogue runs while the other
  multiplies. ``coop_192x256`` on GEMM2, whose long scatter epilogue stalls both warpgroups, was
  slower than ``pingpong_64x256``. The other kinds run it as ``coop_128x256_c1``; GEMM1 with its
  activation, whose epilogue is short, ran 7-12% slower on it than on ``coop_192x256``. On an H200
  the shipped tiles take it for GPT-OSS-120B's GEMM2 at 128 rows per expert (about 64 to 181 rows,
  2048 to 5792 tokens), bf16 and FP8: at 4096 tokens its GEMM2 ran 1.5% (bf16) and 7.6% (FP8)
  faster, and at 5120 tokens 9.4% and 20%, in a loop of layers, in the fixed deal. Its CTAs take
  their tiles from the counter, as ``coop_192x256``'s do: another 1.0-1.4% off GEMM2 at 3072 to
  5120 tokens. FP8, whose epilogue also scales every row and column, keeps it at the 256- and
  512-row points as well: against ``pingpong_64x256`` its GEMM2 ran 17% faster at 6144 tokens, 12%
  at 8192 and 24% at 11264 (the layer 4.6-10%), and against ``coop_128x256_c1`` 1.8% at 16384. In
  bf16 at 256 rows it was 7.7% slower than ``coop_128x256_c1``, and DeepSeek-V3's FP8 GEMM2 at 256
  rows 18% slower than ``pingpong_64x256``.

:func:`pick_tile` chooses per GEMM from the average rows per expert (``rows / E``):

1. ``JAX_MOE_CUTLASS_TILE`` forces one tile everywhere.
2. Tuned tiles: a GEMM in the active tile cache (:mod:`jax_moe.backends.cutlass_tile_cache`,
   ``JAX_MOE_TILE_CACHE``, written by :func:`jax_moe.autotune.tune` on this GPU model), else in
   the cache shipped for this GPU model (``jax_moe/backends/tuned_tiles/``, popular models'
   layers), takes the tile measured fastest for it there, at the nearest rows per expert (within
   :data:`~jax_moe.backends.cutlass_tile_cache.REACH` times the tuned range). A fused
   kind (``"_act"``, ``"_scatter"``) with no tuned tile of its own takes its plain kind's: GEMM2
   tuned while it still wrote its rows keeps its tile when it scatters.
3. A GEMM whose ``(kind, E, N, K)`` is in :data:`MEASURED` takes the tile measured fastest at the
   nearest rows per expert (on a log scale). The table is written by ``bench/tile_sweep.py
   --update-table`` from an H100 run (every tile timed on each GEMM of the bench's models, with
   the rows of a random softmax top-k routing, in device time per call, calls in a jitted loop,
   so that the host's dispatch does not decide between tiles; the rows of 16384 tokens from
   per-call medians, where dispatch is noise); a tile is recorded only where it
   beat the heuristic's by more than :data:`MIN_GAIN`. Kinds: ``"bf16"`` and ``"fp8"`` (weights ``[E, N, K]``
   as stored) and ``"bf16_kn"`` (the same product on transposed weights ``[E, K, N]``, the
   prepared layout: the same tiles stream the weights differently, so they are measured apart);
   N and K are the product's (``d [M, N] = a [M, K] @ w[e]``) whatever the layout. A kind with
   ``"_act"`` appended (``"bf16_kn_act"``, ``"fp8_act"``) is a gated layer's GEMM1 and its activation timed as
   one unit (the activation in the epilogue on the tiles that fuse it, the activation kernel
   after the others): the forward's GEMM1 pick where it may fuse, falling back to the plain
   kind's rows.
4. Otherwise the heuristic :func:`heuristic_tile`, the same for both kinds: pingpong below
   :data:`DECODE_ROWS_PER_EXPERT`, 128x256 from :data:`WIDE_ROWS_PER_EXPERT`, 128x128 between;
   on an H200, bf16's ``pingpong_64x256`` from 64 to 448 rows per expert
   (:data:`WIDE_PINGPONG_ROWS`).
5. On an H200, a ``coop_128x256`` pick of steps 2-4 runs as ``coop_128x256_c1`` below 1536 rows
   per expert (:data:`NO_CLUSTER_BELOW_ROWS`, :func:`unclustered`); the user's cache and the
   autotuner's trials, which time both tiles, are taken as they are.

Everything here is static (shapes and a dict): the choice costs nothing at run time and the
program stays one CUDA graph. Inside :func:`tuning` (the autotuner's trials) the user's cache is
not read (the shipped ones are: they are today's picks), chosen GEMMs take the trial's tiles, and
every pick is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping

from jax_moe.backends import cutlass_tile_cache
from jax_moe.backends.cutlass_tile_cache import gemm_key, nearest
from jax_moe.device import device_kind

# tile name -> CutlassTile in ffi/cutlass/grouped_gemm.h (one CUTLASS instantiation per kind; the K
# tile is 128 bytes, 64 for bf16 and 128 for fp8, except pingpong_64x128_k256's 256 bytes)
TILES: dict[str, int] = {"coop_128x128": 0, "pingpong_64x128": 1, "coop_128x256": 2, "pingpong_64x256": 3,
                         "pingpong_64x128_k256": 4, "coop_128x256_c1": 5, "coop_192x256": 6,
                         "pingpong_192x128": 7}
# Tiles built for one fused kind only -> that kind's suffix: GEMM1 with its activation ("_act") or GEMM2
# with its un-permute ("_scatter"). Every other kind runs them as coop_128x256_c1 (TileConfig in
# ffi/cutlass/grouped_gemm_impl.cuh), so nothing times them there.
ONE_KIND_TILES: dict[str, str] = {"coop_192x256": "_act", "pingpong_192x128": "_scatter"}
TILE_ENV = "JAX_MOE_CUTLASS_TILE"
DECODE_ROWS_PER_EXPERT = 64  # below this many rows per expert on average: the 64-row pingpong tile
WIDE_ROWS_PER_EXPERT = 128  # from this many: the 128x256 tile with a 2x1 cluster
MIN_GAIN = 0.03  # a measured tile replaces the heuristic's only where it is this much faster
# GPU model -> (from, below) rows per expert where a bf16 GEMM in no table takes pingpong_64x256.
# On an H200 it was at least as fast as the heuristic's cooperative tiles in 48 of the 52 GEMMs
# of 18 models' layers tuned from 64 to 384 rows per expert (up to 1.28x the forward; the other
# four 0.96-0.99x); at 512 rows it won half; on an H100 it won no such band (the figures of the
# shipped caches in tuned_tiles/).
WIDE_PINGPONG_ROWS: dict[str, tuple[float, float]] = {"NVIDIA H200": (64.0, 448.0)}
# GPU model -> rows per expert below which coop_128x256 runs as coop_128x256_c1 (unclustered()). On
# an H200, with every clustered pick of the shipped cache from 128 to 1024 rows per expert moved,
# whole layers in a loop of 8 were 2-8% faster for GPT-OSS-120B, DeepSeek-V3 and Qwen3-30B-A3B at
# 16384 tokens, bf16 and FP8, and 8% for GPT-OSS-120B bf16 at 4096 (bench/RESULTS.md, sixteenth
# session); Mixtral-8x7B was level at 1024 rows per expert and stays clustered at 4096. Not
# measured on an H100.
NO_CLUSTER_BELOW_ROWS: dict[str, float] = {"NVIDIA H200": 1536.0}
# Rows per expert below which a shipped coop_192x256 pick runs as the fastest other tile of the figures
# nearest its rows (tuned_tile()): the pick before the tile was built. With fewer rows per expert fewer
# experts pass 128 rows, both tiles multiply more nearly the same rows, and the 192-row tile's own
# cost shows: with every expert given 128 rows it took 11% longer than coop_128x256_c1 (Nsight
# Compute, GPT-OSS-120B's GEMM1). Timed in alternating rounds against the earlier pick, per layer in
# a loop on an H200 on random routing, the tile's layer took (GPT-OSS-120B; DeepSeek-V3):
#   96 rows 1.065; 1.019   112 rows 1.053; 1.006   120 rows 1.022; 0.998   128 rows 0.974; 0.970
#   176 rows (GPT-OSS-120B only) 0.921
# GPT-OSS-120B crosses over between 120 and 128 rows, DeepSeek-V3 near 120; 124 is between the two.
# Since the tile loads only its A blocks with rows, GPT-OSS-120B at 120 rows reads 1.006.
ROW_BLOCK_TILE_FROM_ROWS = 124.0

# (kind, E, N, K) -> ((rows per expert, tile), ...) in increasing rows per expert.
# Written by `python bench/tile_sweep.py --update-table` (the lines between the markers).
# measured table: begin
MEASURED: dict[tuple[str, int, int, int], tuple[tuple[float, str], ...]] = {
    ('bf16', 8, 4096, 14336): (
        (0.25, 'pingpong_64x128'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128_k256'),
        (64, 'coop_128x256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('bf16', 8, 28672, 4096): (
        (0.25, 'pingpong_64x128'),
        (4, 'pingpong_64x128_k256'),
        (16, 'pingpong_64x128'),
        (64, 'pingpong_64x128_k256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('bf16', 128, 1536, 2048): (
        (0.0625, 'pingpong_64x128_k256'),
        (1, 'pingpong_64x128'),
        (4, 'pingpong_64x128_k256'),
        (16, 'pingpong_64x128'),
        (64, 'pingpong_64x128_k256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('bf16', 128, 2048, 768): (
        (0.0625, 'pingpong_64x128'),
        (1, 'pingpong_64x128'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128'),
        (64, 'coop_128x128'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('bf16', 128, 2880, 2880): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128_k256'),
        (8, 'pingpong_64x128_k256'),
        (32, 'pingpong_64x128_k256'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16', 128, 5760, 2880): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x128'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16', 256, 4096, 7168): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x128_k256'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16', 256, 7168, 2048): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128_k256'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128_k256'),
        (32, 'pingpong_64x128'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16_kn', 8, 4096, 14336): (
        (0.25, 'pingpong_64x128_k256'),
        (4, 'pingpong_64x256'),
        (16, 'pingpong_64x256'),
        (64, 'coop_128x128'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('bf16_kn', 8, 28672, 4096): (
        (0.25, 'pingpong_64x128_k256'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128'),
        (64, 'pingpong_64x256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('bf16_kn', 128, 1536, 2048): (
        (0.0625, 'pingpong_64x128_k256'),
        (1, 'pingpong_64x128'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128'),
        (64, 'pingpong_64x128_k256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('bf16_kn', 128, 2048, 768): (
        (0.0625, 'pingpong_64x128'),
        (1, 'pingpong_64x128'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128'),
        (64, 'coop_128x128'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('bf16_kn', 128, 2880, 2880): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128_k256'),
        (8, 'pingpong_64x256'),
        (32, 'pingpong_64x128'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16_kn', 128, 5760, 2880): (
        (0.03125, 'pingpong_64x256'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x256'),
        (32, 'pingpong_64x128'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16_kn', 256, 4096, 7168): (
        (0.03125, 'pingpong_64x256'),
        (0.5, 'pingpong_64x256'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x256'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16_kn', 256, 7168, 2048): (
        (0.03125, 'pingpong_64x128_k256'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x256'),
        (32, 'pingpong_64x128_k256'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16_kn_act', 8, 28672, 4096): (
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128'),
        (64, 'pingpong_64x256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('bf16_kn_act', 128, 1536, 2048): (
        (1, 'pingpong_64x128_k256'),
        (4, 'pingpong_64x128_k256'),
        (16, 'pingpong_64x128'),
        (64, 'pingpong_64x128_k256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('bf16_kn_act', 128, 5760, 2880): (
        (0.5, 'pingpong_64x256'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x256'),
        (32, 'pingpong_64x256'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('bf16_kn_act', 256, 4096, 7168): (
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x256'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('fp8', 8, 4096, 14336): (
        (0.25, 'pingpong_64x128_k256'),
        (4, 'pingpong_64x128_k256'),
        (16, 'pingpong_64x128'),
        (64, 'coop_128x128'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('fp8', 8, 28672, 4096): (
        (0.25, 'pingpong_64x128'),
        (4, 'pingpong_64x128_k256'),
        (16, 'pingpong_64x128_k256'),
        (64, 'pingpong_64x128_k256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('fp8', 128, 1536, 2048): (
        (0.0625, 'pingpong_64x128'),
        (1, 'pingpong_64x128'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128'),
        (64, 'coop_128x128'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('fp8', 128, 2048, 768): (
        (0.0625, 'coop_128x128'),
        (1, 'pingpong_64x128'),
        (4, 'pingpong_64x128'),
        (16, 'pingpong_64x128_k256'),
        (64, 'pingpong_64x128_k256'),
        (256, 'coop_128x256'),
        (1024, 'coop_128x256'),
    ),
    ('fp8', 128, 2880, 2880): (
        (0.03125, 'pingpong_64x128_k256'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x128'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('fp8', 256, 4096, 7168): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x128_k256'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('fp8', 256, 7168, 2048): (
        (0.03125, 'pingpong_64x128'),
        (0.5, 'pingpong_64x128_k256'),
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x128_k256'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
    ('fp8_act', 8, 28672, 4096): (
        (16, 'pingpong_64x256'),
        (64, 'pingpong_64x256'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
        (4096, 'coop_128x256'),
    ),
    ('fp8_act', 128, 1536, 2048): (
        (4, 'pingpong_64x128_k256'),
        (16, 'pingpong_64x128_k256'),
        (64, 'coop_128x128'),
        (256, 'pingpong_64x256'),
        (1024, 'coop_128x256'),
    ),
    ('fp8_act', 128, 5760, 2880): (
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128_k256'),
        (32, 'pingpong_64x128'),
        (128, 'coop_128x256'),
        (512, 'coop_128x256'),
    ),
    ('fp8_act', 256, 4096, 7168): (
        (2, 'pingpong_64x128'),
        (8, 'pingpong_64x128'),
        (32, 'pingpong_64x128_k256'),
        (128, 'pingpong_64x256'),
        (512, 'coop_128x256'),
    ),
}
MEASURED_ON = 'NVIDIA H100 80GB HBM3'
# measured table: end


def tiles_for(kind: str) -> tuple[str, ...]:
    """The tiles of :data:`TILES` that run a kernel of their own for GEMM kind ``kind``, a tile
    cache key's first part (``"bf16_kn_act"``, ``"fp8_scatter"``, ``"bf16"``...)."""
    return tuple(t for t in TILES if t not in ONE_KIND_TILES or kind.endswith(ONE_KIND_TILES[t]))


def heuristic_tile(rows_per_expert: float, kind: str = "bf16", device: str | None = None) -> str:
    """The tile for ``rows_per_expert`` rows per expert on average, for a GEMM of ``kind`` in no
    table, on GPU model ``device`` (None: JAX's default device's): pingpong below
    :data:`DECODE_ROWS_PER_EXPERT`, 128x256 from :data:`WIDE_ROWS_PER_EXPERT`, 128x128 between
    (bf16 and FP8 alike: both kinds measured so on an H100, bench/sweeps); except that a bf16
    GEMM on a GPU model of :data:`WIDE_PINGPONG_ROWS` takes ``pingpong_64x256`` in its band, and
    on a GPU model of :data:`NO_CLUSTER_BELOW_ROWS` the 128x256 tile runs without its cluster
    below that many rows."""
    device = device_kind() if device is None else device
    band = WIDE_PINGPONG_ROWS.get(device)
    if band is not None and kind.startswith("bf16") and band[0] <= rows_per_expert < band[1]:
        return "pingpong_64x256"
    if rows_per_expert < DECODE_ROWS_PER_EXPERT:
        return "pingpong_64x128"
    if rows_per_expert >= WIDE_ROWS_PER_EXPERT:
        return unclustered("coop_128x256", rows_per_expert, device)
    return "coop_128x128"


def unclustered(tile: str, rows_per_expert: float, device: str) -> str:
    """``coop_128x256_c1`` for ``coop_128x256`` below :data:`NO_CLUSTER_BELOW_ROWS` rows per expert on
    GPU model ``device``; any other tile as it is. Applied to the heuristic's, the table's and the
    shipped caches' picks (tuned with the clustered tile before the unclustered one was built), not
    to the user's cache or the autotuner's trials, which time both."""
    if tile == "coop_128x256" and rows_per_expert < NO_CLUSTER_BELOW_ROWS.get(device, 0.0):
        return "coop_128x256_c1"
    return tile


def measured_tile(kind: str, groups: int, n: int, k: int, rows_per_expert: float) -> str | None:
    """The tile :data:`MEASURED` has for this GEMM at the nearest rows per expert, or None."""
    points = MEASURED.get((kind, groups, n, k))
    return nearest(points, rows_per_expert) if points else None


def tuned_tile(key: str, rows_per_expert: float, *, user: bool = True, device: str | None = None) -> str | None:
    """The tuned tile for GEMM ``key`` (:func:`gemm_key`) at the nearest rows per expert: the
    active tile cache's (the user's; ``user=False`` skips it), else the cache shipped for GPU model
    ``device`` (None: JAX's default device's); None where neither was measured on that GPU model
    or holds this GEMM within reach of ``rows_per_expert``. The shipped cache's tile comes as it
    runs (:func:`unclustered`; a ``coop_192x256`` pick below :data:`ROW_BLOCK_TILE_FROM_ROWS` rows
    per expert as the fastest other tile in its figures nearest those rows), the user's as tuned."""
    device = device_kind() if device is None else device
    users = cutlass_tile_cache.active(TILES) if user else None
    tile = users.tile_for(key, rows_per_expert) if users is not None and users.device == device else None
    if tile is not None:
        return tile
    shipped = cutlass_tile_cache.shipped(device, TILES)  # keyed by its own GPU model: device's or None
    tile = shipped.tile_for(key, rows_per_expert) if shipped is not None else None
    if tile == "coop_192x256" and rows_per_expert < ROW_BLOCK_TILE_FROM_ROWS:
        tile = shipped.runner_up(key, rows_per_expert, tile) or "coop_128x256_c1"
    return None if tile is None else unclustered(tile, rows_per_expert, device)


@dataclasses.dataclass
class Trial:
    """One autotuner trial (:func:`tuning`): ``tiles`` gemm_key -> the tile that GEMM takes;
    ``picks`` every (gemm_key, rows per expert, tile picked) the traced program asked for, in order."""

    tiles: Mapping[str, str]
    picks: list[tuple[str, float, str]] = dataclasses.field(default_factory=list)


_TRIAL: contextvars.ContextVar[Trial | None] = contextvars.ContextVar("jax_moe_tile_trial", default=None)


@contextlib.contextmanager
def tuning(tiles: Mapping[str, str] | None = None) -> Iterator[Trial]:
    """Within it, programs traced pick as shipped (the shipped caches, not the user's) except the
    GEMMs named in ``tiles`` (gemm_key -> tile), and record every pick: what
    :func:`jax_moe.autotune.tune` traces each trial under. Only tracing reads it: a program jitted
    inside keeps its tiles outside."""
    tiles = dict(tiles or {})
    unknown = sorted(t for t in tiles.values() if t not in TILES)
    if unknown:
        raise ValueError(f"tiles {unknown} are not built (have {sorted(TILES)})")
    trial = Trial(tiles)
    token = _TRIAL.set(trial)
    try:
        yield trial
    finally:
        _TRIAL.reset(token)


def pick_tile(rows: int, num_groups: int, *, n: int | None = None, k: int | None = None,
              kind: str = "bf16") -> str:
    """The tile for a grouped GEMM of ``rows`` expert-sorted rows over ``num_groups`` experts,
    ``d [rows, n] = a [rows, k] @ b[e]`` of ``kind`` (``"bf16"``, ``"fp8"`` or ``"bf16_kn"``, or one
    of them with ``"_act"``: GEMM1 with its activation, or ``"_scatter"``: GEMM2 adding its rows
    into the output; their own tuned tiles, else the plain kind's tuned tiles, else their own
    rows of the table, else the plain kind's): the override, else the tuned tiles, else the
    measured table (both when ``n`` and ``k`` are given), else the heuristic (see the module
    note)."""
    forced = os.environ.get(TILE_ENV)
    if forced:
        if forced not in TILES:
            raise ValueError(f"{TILE_ENV} must be one of {sorted(TILES)}, got {forced!r}")
        return forced
    r, device = rows / max(num_groups, 1), device_kind()
    if n is None or k is None:
        return heuristic_tile(r, kind, device)
    key, trial = gemm_key(kind, num_groups, n, k), _TRIAL.get()
    tile = trial.tiles.get(key) if trial is not None else None
    plain = kind.removesuffix("_act").removesuffix("_scatter")
    if tile is None:
        tile = tuned_tile(key, r, user=trial is None, device=device)
    if tile is None and plain != kind:  # the plain GEMM's tuned tile (tuned where it ran without the fusion)
        tile = tuned_tile(gemm_key(plain, num_groups, n, k), r, user=trial is None, device=device)
    if tile is None:
        measured = measured_tile(kind, num_groups, n, k, r) or measured_tile(plain, num_groups, n, k, r)
        tile = unclustered(measured, r, device) if measured else heuristic_tile(r, kind, device)
    if trial is not None:
        trial.picks.append((key, r, tile))
    return tile
