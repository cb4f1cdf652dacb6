"""Pallas Mosaic GPU indexer scores (docs/math.md §2) over an FP8 indexer cache, for decode on the H200:
score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) * s_k[s], -inf at s >= kv_lens[t].

Why a kernel of its own: the Triton scores kernel (`kernels.indexer.triton`) is latency-bound, well under the
memory bandwidth: its key gathers are synchronous loads into registers, 3 CTAs of 4 warps an SM, about half the
cycles stalled on memory (BENCHMARKS.md, indexer). Here a producer warpgroup keeps several tiles of keys in flight
with asynchronous copies, so the bytes in flight no longer depend on registers.

One CTA per (query row t, split): the split's share of the row's 64-key tiles, in warpgroups
- the producer (the last warpgroup): a tile of 64 positions lies in one page (pages are multiples of 64 keys), so
  its cache rows are one contiguous, 16-byte-aligned run of 64 x 132 bytes. One TMA copies the run into a
  staging buffer (`in_flight` of them, the copies `in_flight - 1` tiles ahead). The rows themselves are not
  16-byte aligned, so no copy can put a row where wgmma reads it; the producer's threads move each landed tile
  with 4-byte shared-memory loads and stores into the 128-byte-swizzled [64, 128] e4m3 key tile (one warp a row)
  and its 64 float32 scales, fence them for the tensor cores and hand the tile to the consumers (`stages` key
  buffers). (copy "rows": 4-byte cp.async copies from memory straight into place instead, slower.)
- the consumers (`consumers` warpgroups, taking tiles in turn): S = K_tile q^T by one e4m3 x e4m3 wgmma
  [64 keys, 128] x [128, H] with float32 accumulation, then per key sum_h relu(S) w[h], x s_k, -inf past kv_len,
  64 float32 scores stored. Tiles wholly past kv_len read nothing and store -inf.
Queries (e4m3, s_q folded into the weights by `kernels.indexer.prepare_queries`) are padded to a multiple of 8
heads (wgmma's N) with zero weights.

The producer's repack is Lane code, which the Pallas GPU interpreter does not run; under the interpreter (impl
"mosaic_interpret", the CPU tests) the same kernel repacks with array ops instead (`_repack_interpreted`), the one
place the two paths differ. copy "rows" is Lane code throughout: GPU only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common import fp8_formats, mosaic_common
from ..common.mosaic_common import MBARRIER_BYTES, SMEM_LIMIT, smem_align, wait_async_copies
from .config import SM_COUNT, MosaicIndexerConfig  # noqa: F401 (read from here)
from .stages import scores_then_topk

BLOCK_K = 64  # keys per tile: wgmma's M
DI = 128  # key width the kernel takes: one 128-byte swizzle row of e4m3
ROW_BYTES = fp8_formats.index_row_bytes(DI)  # a cache row: 128 e4m3 and a float32 scale, 132 bytes
TILE_BYTES = BLOCK_K * ROW_BYTES  # one tile's cache rows: a contiguous run of 8448 bytes
TMA_ROWS, TMA_COLS = TILE_BYTES // 256, 256  # the run as a TMA box (each box dimension at most 256)
# shared memory Pallas reserves for cross-warp reductions (the sum over heads): CompilerParams' default, which
# `_run` keeps
_REDUCTION_SCRATCH = plgpu.CompilerParams.reduction_scratch_bytes


def _tile_transforms():
    """The (8, 128)-tiled, 128-byte-swizzled form wgmma reads, of the query tile and the key buffers."""
    return plgpu.TilingTransform((8, DI)), plgpu.SwizzleTransform(128)


def heads_padded(h: int) -> int:
    """Query heads as the kernel runs them: a multiple of 8 (wgmma's N granule)."""
    return -(-h // 8) * 8


def shared_memory_bytes(h: int, config: MosaicIndexerConfig) -> int:
    """Shared memory of one CTA for `h` query heads, as Mosaic GPU counts it (`_run`'s scratch, jax 0.11.2): each
    buffer rounded up to SMEM_ALIGNMENT (the query tile, the buffered key tiles, their scales, copy "tma"'s staging
    buffers), the reduction scratch Pallas keeps for the kernel's sum over heads (`_REDUCTION_SCRATCH`), and
    MBARRIER_BYTES a barrier (the query's, a ready and a free one a stage, one a staging buffer).
    tests/kernels/indexer checks it against Mosaic's own count."""
    buffers = [heads_padded(h) * DI, config.stages * BLOCK_K * DI, config.stages * BLOCK_K * 4]
    barriers = 1 + 2 * config.stages
    if config.copy == "tma":
        buffers.append(config.in_flight * TILE_BYTES)
        barriers += config.in_flight
    return sum(map(smem_align, buffers)) + _REDUCTION_SCRATCH + MBARRIER_BYTES * barriers


def lowered_smem_bytes(h: int, config: MosaicIndexerConfig) -> int:
    """Mosaic GPU's own count of the kernel's shared memory for `h` heads (`mosaic_common.lowered_smem_bytes`: the
    kernel lowered for CUDA at a small shape, no device needed)."""
    t, pages = 2, 4
    S = jax.ShapeDtypeStruct
    args = (S((t, h, DI), jnp.bfloat16), S((t, h), jnp.float32), S((pages * BLOCK_K, ROW_BYTES), jnp.uint8),
            S((t,), jnp.int32), S((t,), jnp.int32), S((t, pages), jnp.int32))
    return mosaic_common.lowered_smem_bytes(
        lambda: _run.trace(*args, block_size=BLOCK_K, config=config, interpret=False).lower(
            lowering_platforms=("cuda",)), f"Mosaic indexer {config}")


def supports(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, interpret: bool = False,
             config: MosaicIndexerConfig | None = None, **_) -> str | None:
    """Why the kernel cannot take these inputs (None: it can): an FP8 cache (uint8 rows of 128 e4m3 + a float32
    scale), pages a multiple of 64 keys (a tile is then one page's contiguous rows), at most 256 heads (wgmma's N),
    copy "tma" under the interpreter (copy "rows" is Lane code)."""
    if interpret and (config or MosaicIndexerConfig()).copy != "tma":
        return "copy 'rows' is Lane code, which the GPU interpreter cannot run (copy 'tma' can be interpreted)"
    if k_cache.dtype != jnp.uint8 or k_cache.ndim != 2 or k_cache.shape[-1] != ROW_BYTES:
        return (f"the Mosaic indexer takes an FP8 indexer cache uint8 [slots, {ROW_BYTES}], got {k_cache.dtype} "
                f"{tuple(k_cache.shape)}")
    if q.ndim != 3 or q.shape[-1] != DI:
        return f"the Mosaic indexer takes keys of {DI} values, got queries of shape {tuple(q.shape)}"
    if heads_padded(q.shape[1]) > 256:
        return f"the Mosaic indexer takes at most 256 heads (wgmma's N), got {q.shape[1]}"
    if block_size % BLOCK_K:
        return f"the Mosaic indexer needs pages of a multiple of {BLOCK_K} keys, got block_size {block_size}"
    if k_cache.shape[0] % BLOCK_K:
        return f"the Mosaic indexer needs a cache of whole {BLOCK_K}-slot tiles, got {k_cache.shape[0]} slots"
    need = shared_memory_bytes(q.shape[1], config or MosaicIndexerConfig())
    if need > SMEM_LIMIT:
        return f"this config needs {need} bytes of shared memory per CTA, over the H200's {SMEM_LIMIT}"
    return None


def _issue_tile(ctx, cache, k_smem, s_smem, base_fa, b_fa):
    """Lane code (inline_mgpu): this producer thread's cp.async copies of the 64 cache rows from slot `base` into
    buffer `b`, committed as one group: warp w copies rows w + 4 m, lane l the word l of each (row j's key bytes
    land in swizzle row j % 8 of 8-row group j // 8, 16-byte chunk (l // 4) ^ (j % 8)); threads 0..63 copy the
    scale of row tid to s_smem[b, tid]."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    del ctx
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)

    def c(v):
        return arith.constant(i32, v)

    def cp(dst, src, predicate=None):
        mgpu_utils.inline_ptx("cp.async.ca.shared.global [$0], [$1], 4;", dst, src, predicate=predicate,
                              has_side_effects=True)
    base = base_fa.registers.item()
    b = b_fa.registers.item()
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    warp = arith.divui(tid, c(32))
    lane = arith.remui(tid, c(32))
    row0 = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(cache),
                                    [arith.muli(arith.extui(i64, base), arith.constant(i64, ROW_BYTES))], i8)
    k_buf = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(k_smem), [arith.muli(b, c(BLOCK_K * DI))], i8)
    s_buf = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(s_smem), [arith.muli(b, c(BLOCK_K * 4))], i8)
    src0 = mgpu_utils.getelementptr(row0, [arith.extui(i64, arith.addi(arith.muli(warp, c(ROW_BYTES)),
                                                                        arith.muli(lane, c(4))))], i8)
    for m in range(BLOCK_K // 4):
        row = arith.addi(warp, c(4 * m))
        cp(mgpu_utils.getelementptr(k_buf, [_swizzled(row, lane)], i8),
           mgpu_utils.getelementptr(src0, [4 * m * ROW_BYTES], i8))
    cp(mgpu_utils.getelementptr(s_buf, [arith.muli(tid, c(4))], i8),
       mgpu_utils.getelementptr(row0, [arith.extui(i64, arith.addi(arith.muli(tid, c(ROW_BYTES)), c(DI)))], i8),
       arith.cmpi(arith.CmpIPredicate.ult, tid, c(BLOCK_K)))
    mgpu_utils.inline_ptx("cp.async.commit_group;", has_side_effects=True)


def _swizzled(row, word):
    """Lane code: byte offset in a [64, 128] e4m3 key tile ((8, 128) tiles, 128-byte swizzle) of key word `word`
    (bytes 4 word .. 4 word + 3) of row `row` (both i32)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    i32 = ir.IntegerType.get_signless(32)

    def c(v):
        return arith.constant(i32, v)
    r_in = arith.remui(row, c(8))
    return arith.addi(arith.addi(arith.muli(arith.divui(row, c(8)), c(8 * DI)), arith.muli(r_in, c(DI))),
                      arith.addi(arith.muli(arith.xori(arith.divui(word, c(4)), r_in), c(16)),
                                 arith.muli(arith.remui(word, c(4)), c(4))))


def _repack(ctx, stage, k_smem, s_smem, p_fa, b_fa):
    """Lane code (inline_mgpu): staging buffer `p` (a tile's 64 rows of 132 bytes as copied) into key buffer `b`
    (`_swizzled`) and its scales. Warp w moves rows w + 4 m, lane l the word l of each (a warp
    reads one row: 32 consecutive words, no bank conflict); threads 0..63 the scale of row tid (rows 33 words
    apart: distinct banks). Loads first, then stores."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    del ctx
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)

    def c(v):
        return arith.constant(i32, v)
    p = p_fa.registers.item()
    b = b_fa.registers.item()
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    warp = arith.divui(tid, c(32))
    lane = arith.remui(tid, c(32))
    src = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(stage),
                                   [arith.addi(arith.muli(p, c(TILE_BYTES)),
                                               arith.addi(arith.muli(warp, c(ROW_BYTES)), arith.muli(lane, c(4))))],
                                   i8)
    k_buf = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(k_smem), [arith.muli(b, c(BLOCK_K * DI))], i8)
    words = [mgpu_utils.inline_ptx("ld.shared.b32 $0, [$1];", mgpu_utils.getelementptr(src, [4 * m * ROW_BYTES], i8),
                                   result_types=[i32])[0] for m in range(BLOCK_K // 4)]
    for m, word in enumerate(words):
        dst = mgpu_utils.getelementptr(k_buf, [_swizzled(arith.addi(warp, c(4 * m)), lane)], i8)
        mgpu_utils.inline_ptx("st.shared.b32 [$0], $1;", dst, word, has_side_effects=True)
    is_scale_thread = arith.cmpi(arith.CmpIPredicate.ult, tid, c(BLOCK_K))
    scale_src = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(stage),
                                         [arith.addi(arith.muli(p, c(TILE_BYTES)),
                                                     arith.addi(arith.muli(arith.remui(tid, c(BLOCK_K)),
                                                                           c(ROW_BYTES)), c(DI)))], i8)
    scale = mgpu_utils.inline_ptx("ld.shared.b32 $0, [$1];", scale_src, result_types=[i32])[0]
    scale_dst = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(s_smem),
                                         [arith.addi(arith.muli(b, c(BLOCK_K * 4)), arith.muli(tid, c(4)))], i8)
    mgpu_utils.inline_ptx("st.shared.b32 [$0], $1;", scale_dst, scale, predicate=is_scale_thread,
                          has_side_effects=True)


def _kernel(req_ref, len_ref, q_ref, w_ref, bt_ref, cache_ref, o_ref, q_smem, k_smem, s_smem, q_bar, k_ready,
            k_free, staging=None, *, page, tiles_per_split, config, interpret):
    t = lax.axis_index("t")
    split = lax.axis_index("s")
    wg = lax.axis_index("wg")
    n = len_ref[t]
    tile0 = split * tiles_per_split
    # tiles of this split holding a visible key; the rest read nothing
    busy = jnp.clip((n + BLOCK_K - 1) // BLOCK_K - tile0, 0, tiles_per_split)
    stages, consumers = config.stages, config.consumers

    @pl.when(wg < consumers)
    def _consumer():
        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        w = plgpu.load(w_ref.at[t], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)  # [Hp]
        hp = w.shape[0]
        w_tile = lax.broadcast_in_dim(w, (BLOCK_K, hp), [1])

        def step(j, carry):
            i = j * consumers + wg
            b = lax.rem(i, stages)
            plgpu.barrier_wait(k_ready.at[b])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, k_smem.at[b], q_smem.transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_K, hp), jnp.float32))
            s_k = plgpu.load(s_smem.at[b], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            plgpu.barrier_arrive(k_free.at[b])
            sc = (jnp.maximum(s, 0.0) * w_tile).sum(axis=1) * s_k
            first = (tile0 + i) * BLOCK_K
            pos = first + plgpu.layout_cast(lax.iota(jnp.int32, BLOCK_K), plgpu.Layout.WGMMA.reduce(1))
            o_ref[t, pl.ds(first, BLOCK_K)] = jnp.where(pos < n, sc, -jnp.inf)
            return carry

        lax.fori_loop(0, (busy - wg + consumers - 1) // consumers, step, None)

        def blank(j, carry):
            i = busy + j * consumers + wg
            o_ref[t, pl.ds((tile0 + i) * BLOCK_K, BLOCK_K)] = plgpu.layout_cast(
                jnp.full((BLOCK_K,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            return carry

        lax.fori_loop(0, (tiles_per_split - busy - wg + consumers - 1) // consumers, blank, None)

    @pl.when(wg == consumers)
    def _producer():
        req = req_ref[t]

        def slot_of(i):  # the cache slot of tile i's first key (a tile lies in one page)
            pos = (tile0 + jnp.minimum(i, tiles_per_split - 1)) * BLOCK_K
            return jnp.maximum(bt_ref[req, pos // page], 0) * page + pos % page

        if config.copy == "tma":
            _tma_producer(cache_ref, k_smem, s_smem, k_ready, k_free, staging, slot_of, busy, config, interpret)
        else:
            _cp_async_producer(cache_ref, k_smem, s_smem, k_ready, k_free, slot_of, busy, config)


def _repack_interpreted(stage, k_smem, s_smem, p, b):
    """`_repack` in array ops, for the Pallas GPU interpreter (which runs no Lane code): the staged run as [64, 132]
    bytes, its key bytes as e4m3 into buffer `b`, its scale bytes as float32."""
    rows = stage[p].reshape(BLOCK_K, ROW_BYTES)
    k_smem[b] = lax.bitcast_convert_type(rows[:, :DI], fp8_formats.FP8)
    s_smem[b] = lax.bitcast_convert_type(rows[:, DI:].reshape(BLOCK_K, 4), jnp.float32)


def _tma_producer(cache_ref, k_smem, s_smem, k_ready, k_free, staging, slot_of, busy, config, interpret):
    """One TMA a tile (its 8448-byte run, `cache_ref` viewed as [tiles, 33, 256]) into `in_flight` staging
    buffers, `in_flight - 1` tiles ahead; each landed tile is rearranged (`_repack`; under the interpreter
    `_repack_interpreted`) into a free key buffer, fenced for the tensor cores and handed to the consumers."""
    stage, t_bar = staging
    ahead = config.in_flight - 1
    if interpret:
        repack = _repack_interpreted
    else:
        repack = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(_tile_transforms()), plgpu.RefType(),
                                              plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT))(_repack)

    def fetch(i):
        @pl.when(i < busy)
        def _():
            p = lax.rem(i, config.in_flight)
            plgpu.copy_gmem_to_smem(cache_ref.at[slot_of(i) // BLOCK_K], stage.at[p], t_bar.at[p])

    for j in range(ahead):
        fetch(j)

    def step(i, carry):
        # staging buffer (i - 1) % in_flight was emptied by the last step (its loads, then commit_smem's fence and
        # warpgroup barrier), so the copy that refills it cannot overtake them
        fetch(i + ahead)
        p = lax.rem(i, config.in_flight)
        b = lax.rem(i, config.stages)
        plgpu.barrier_wait(t_bar.at[p])

        @pl.when(i >= config.stages)
        def _():
            plgpu.barrier_wait(k_free.at[b])
        repack(stage, k_smem, s_smem, p, b)
        plgpu.commit_smem()
        plgpu.barrier_arrive(k_ready.at[b])
        return carry

    lax.fori_loop(0, busy, step, None)
    if interpret:
        # the interpreter checks that every thread waiting on a barrier observes all its phases: wait for the
        # consumers to free the last tiles (on the device the producer just leaves first)
        def drain(i, carry):
            plgpu.barrier_wait(k_free.at[lax.rem(i, config.stages)])
            return carry
        lax.fori_loop(jnp.maximum(busy, config.stages) - config.stages, busy, drain, None)


def _cp_async_producer(cache_ref, k_smem, s_smem, k_ready, k_free, slot_of, busy, config):
    """4-byte cp.async copies straight into the key buffer and scales (`_issue_tile`), `in_flight` tiles of them
    outstanding per thread."""
    issue = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(_tile_transforms()), plgpu.RefType(),
                                         plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT))(_issue_tile)
    stages = config.stages

    def fill(i, slot):
        b = lax.rem(i, stages)
        slot_next = slot_of(i + 1)  # the next tile's page, read while this tile's copies go out

        @pl.when(i >= stages)
        def _():
            plgpu.barrier_wait(k_free.at[b])
        issue(cache_ref, k_smem, s_smem, slot, b)

        @pl.when(i >= config.in_flight - 1)
        def _():
            wait_async_copies(config.in_flight - 1)
            plgpu.commit_smem()
            plgpu.barrier_arrive(k_ready.at[lax.rem(i - (config.in_flight - 1), stages)])
        return slot_next

    lax.fori_loop(0, busy, fill, slot_of(0))
    wait_async_copies(0)
    plgpu.commit_smem()

    def last(i, carry):  # the tiles whose copies were still in flight when the loop ended
        plgpu.barrier_arrive(k_ready.at[lax.rem(i, stages)])
        return carry
    lax.fori_loop(jnp.maximum(busy - (config.in_flight - 1), 0), busy, last, None)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def _run(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size, config, interpret):
    t, h, _ = q.shape
    s = block_tables.shape[1] * block_size
    tiles = -(-s // BLOCK_K)
    n_split = config.splits(t, tiles)
    tiles_per_split = -(-tiles // n_split)
    hp = heads_padded(h)
    # e4m3 values (exact in q's dtype) to e4m3 storage: an exact convert, so no folding of converts can change it
    q8 = jnp.pad(q.astype(fp8_formats.FP8), ((0, 0), (0, hp - h), (0, 0)))
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, hp - h)))
    staging = None
    if config.copy == "tma":  # each tile's run of rows as one TMA box: the cache viewed as [tiles, 33, 256]
        k_cache = k_cache.reshape(k_cache.shape[0] // BLOCK_K, TMA_ROWS, TMA_COLS)
        staging = (plgpu.SMEM((config.in_flight, TMA_ROWS, TMA_COLS), jnp.uint8),
                   plgpu.Barrier(num_arrivals=1, num_barriers=config.in_flight))
    kernel = plgpu.kernel(
        functools.partial(_kernel, page=block_size, tiles_per_split=tiles_per_split, config=config,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((t, n_split * tiles_per_split * BLOCK_K), jnp.float32),
        scratch_types=(
            plgpu.SMEM((hp, DI), fp8_formats.FP8, transforms=_tile_transforms()),
            plgpu.SMEM((config.stages, BLOCK_K, DI), fp8_formats.FP8, transforms=_tile_transforms()),
            plgpu.SMEM((config.stages, BLOCK_K), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=config.stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=config.stages),
            staging,
        ),
        grid=(t, n_split),
        grid_names=("t", "s"),
        num_threads=config.consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(token_req.astype(jnp.int32), kv_lens.astype(jnp.int32), q8, w, block_tables.astype(jnp.int32),
                  k_cache)


def indexer_scores_mosaic(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int,
                          config: MosaicIndexerConfig | None = None, interpret: bool = False, **overrides):
    """Scores [T, S_pad] float32 (S_pad: S = block-table width x block_size rounded up to the splits' 64-key
    tiles; -inf at s >= kv_lens[t]) of e4m3 queries `q` [T, H, 128] (any float dtype holding e4m3 values exactly,
    s_q folded into `weights` [T, H]: `kernels.indexer.prepare_queries`) against the FP8 indexer cache `k_cache`
    uint8 [slots, 132] through `block_tables` [R, pages] (pages of a multiple of 64 keys).
    config: a `MosaicIndexerConfig` (default: its defaults); `overrides` replace its fields by name."""
    config = config or MosaicIndexerConfig()
    if overrides:
        config = dataclasses.replace(config, **overrides)
    why = supports(q, weights, k_cache, token_req, kv_lens, block_tables, block_size=block_size,
                   interpret=interpret, config=config)
    if why:
        raise ValueError(f"indexer_scores_mosaic: {why}")
    return _run(q, weights, k_cache, token_req, kv_lens, block_tables, block_size=int(block_size), config=config,
                interpret=bool(interpret))


def indexer_topk_mosaic(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                        return_scores: bool = False, ordered: bool = True, row_chunk: int | None = None,
                        interpret: bool = False, topk_impl: str | None = None, topk_config=None,
                        config: MosaicIndexerConfig | None = None, **overrides):
    """The "mosaic" impl of `kernels.indexer.indexer_topk`: `indexer_scores_mosaic` (`config`, `overrides`), then
    the top-k of `kernels.indexer.stages.scores_then_topk` (`topk_impl`, `topk_config`, `ordered`, `row_chunk`)."""
    def scores(q_, w_, r_, n_):
        return indexer_scores_mosaic(q_, w_, k_cache, r_, n_, block_tables, block_size=block_size, config=config,
                                     interpret=interpret, **overrides)
    return scores_then_topk(scores, q, weights, k_cache, token_req, kv_lens, block_tables, block_size=block_size,
                            topk=topk, return_scores=return_scores, ordered=ordered, row_chunk=row_chunk,
                            interpret=interpret, topk_impl=topk_impl, topk_config=topk_config, name="mosaic")
