"""Pallas Mosaic GPU sparse MLA attention (docs/math.md §5) for the H200: warp-specialised, in the shape of
FlashMLA's sm90 sparse decode (design: docs/mosaic_sparse_mla.md).

One CTA per (query row t, split s), three warpgroups:
- warpgroup 2, the producer, gathers the row's selected cache rows 64 at a time into a double-buffered shared
  memory tile [64, R + Dr] in the (8, 64)-tiled, 128-byte-swizzled form wgmma reads;
- warpgroups 0 and 1, the consumers, accumulate P V into their own 256 of the R = 512 latent columns. By default
  (`share_p`, FlashMLA's split) consumer 0 alone computes S = q K^T for all 64 (padded) heads and the online
  softmax in float32 (log2 units), and hands P (bf16) and the rescale factors to consumer 1 through shared memory;
  with share_p=False each consumer computes the same S itself (identical work, so their statistics agree
  without an exchange).
Query heads are padded to 64 (wgmma's M). Slot -1 reads as a zero row and is masked out of the softmax; a row
with no valid slot gives (0, -inf). Splits write normalised partials merged by one Pallas Triton launch
(`kernels.lse_merge.triton`, config `merge`) or `lse_merge.merge_partials`. A CTA whose split holds no valid slot
(every split of a padding row, which a batch-invariant decode step has 224 of at B = 32; the tail splits of a
short context) skips its gathers, MMAs and softmax and writes only lse -inf, plus o = 0 where its partial is
returned as it is (`_write_empty`): the same bits as the full schedule gives it.

Gathering: sm_90 has no TMA row gather, so the producer issues one TMA per (row, 64-column chunk) into a
swizzle-only view of the K buffer ("tma_rows"). The GPU interpreter (CPU tests) does not alias `RefUnion`
views, so there the same copies go to the tiled view at a traced row, which it accepts and device lowering
does not: the one place the two paths differ. A bf16 cache goes by 16-byte cp.async copies by default
("cp_async"); an fp8_ds_mla cache always takes its own Lane-code producer, which loads the e4m3 rows into
registers and stores them dequantised to bf16, the next tile's slot ids coming into shared memory by one TMA
meanwhile (the GPU runs it; the interpreter refuses Lane code). `Hooks` leaves parts of the work out, for
timing the others (benchmarks/diagnostics only; the results are then wrong by design).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import registry
from ..common import fp8_formats, mosaic_common
from ..lse_merge import merge_partials, merge_splits
from ..common.mosaic_common import MBARRIER_BYTES, SMEM_LIMIT, smem_align, wait_async_copies
from .config import BLOCK_K, LAUNCH_REGISTERS, MosaicSparseMLAConfig  # noqa: F401 (read from here)
from .config import mosaic_default_config as default_config

HEADS = 64  # wgmma M: query heads per CTA (padded)
COL_TILE = 64  # bf16 columns per 128-byte swizzle atom row
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Parts of the kernel's work to leave out so that the rest can be timed alone (the extension point of
    benchmarks/diagnostics; not a product setting: with any part left out the results are wrong by design). The
    default leaves out nothing.

    consumers: "full"; "no_mask" (the plain schedule's consumers neither read the slot ids nor mask -1 slots);
    "idle" (the plain schedule's consumers only hand each tile back: the producer alone; needs share_p=False).
    fp8_producer (an fp8_ds_mla cache only): "full" (load, convert, store); "no_convert" (stores the loaded e4m3
    words without converting them, and so loads no scales: nothing reads them); "no_load" (converts and stores
    words it did not load: it reads the slot ids, no cache bytes); "idle" (only hands tiles to the consumers)."""
    consumers: str = "full"
    fp8_producer: str = "full"

    def __post_init__(self):
        if self.consumers not in ("full", "no_mask", "idle"):
            raise ValueError(f"Hooks.consumers must be 'full', 'no_mask' or 'idle', got {self.consumers!r}")
        if self.fp8_producer not in ("full", "no_convert", "no_load", "idle"):
            raise ValueError(f"Hooks.fp8_producer must be 'full', 'no_convert', 'no_load' or 'idle', got "
                             f"{self.fp8_producer!r}")


# Mosaic GPU's reduction scratch (CompilerParams.reduction_scratch_bytes default). The kernel's reductions are
# along S rows, inside a warp (shuffles), so the share_p schedule, which needs the room, sets it to 0.
_REDUCTION_SCRATCH = plgpu.CompilerParams.reduction_scratch_bytes


def _slot_tiles(config: MosaicSparseMLAConfig) -> bool:
    """Whether the launch keeps the slot ids in shared memory (slot_source "smem"; the TMA and fp8 producers
    read them from there, the bf16 cp.async producer leaves them unused)."""
    return config.slot_source == "smem"


def _reduction_scratch(config: MosaicSparseMLAConfig) -> int:
    """The launch's `reduction_scratch_bytes`: none with share_p (its P tile takes the room)."""
    return 0 if config.share_p else _REDUCTION_SCRATCH


def shared_memory_bytes(width: int, config: MosaicSparseMLAConfig) -> int:
    """Shared memory a CTA of the native kernel takes for cache rows of `width` bf16 columns, as Mosaic GPU counts
    `_run`'s scratch (jax 0.11.2): each buffer rounded up to SMEM_ALIGNMENT (the q tile, the double-buffered K tile
    (one union of its tiled and row views), the slot tiles (slot_source "smem"), with `share_p` the shared P tile
    and its row statistics), Mosaic GPU's reduction scratch (none with share_p) and MBARRIER_BYTES a barrier (q's,
    a ready and a free one a K buffer, one a slot tile, share_p's two). tests/kernels/sparse_mla checks it against
    Mosaic's own count."""
    buffers = [HEADS * width * 2, 2 * BLOCK_K * width * 2]
    barriers = 1 + 2 + 2
    if _slot_tiles(config):
        buffers.append(2 * BLOCK_K * 4)
        barriers += 2
    if config.share_p:
        buffers += [HEADS * BLOCK_K * 2, 2 * HEADS * 4]
        barriers += 2
    return sum(map(smem_align, buffers)) + _reduction_scratch(config) + MBARRIER_BYTES * barriers


def lowered_smem_bytes(width: int, config: MosaicSparseMLAConfig, kv_lora_rank: int = 512) -> int:
    """Mosaic GPU's own count of the native kernel's shared memory for a bf16 cache of `width` columns
    (`mosaic_common.lowered_smem_bytes`: the kernel lowered for CUDA at a small shape, no device needed)."""
    S = jax.ShapeDtypeStruct
    args = (S((2, HEADS, width), jnp.bfloat16), S((4 * BLOCK_K, width), jnp.bfloat16), S((2, 2 * BLOCK_K), jnp.int32))
    return mosaic_common.lowered_smem_bytes(lambda: jax.jit(functools.partial(
        _run, scale=0.1, kv_lora_rank=kv_lora_rank, config=config, interpret=False, return_partials=True,
        hooks=Hooks())).trace(*args).lower(lowering_platforms=("cuda",)), f"sparse MLA Mosaic {config}")


def supports(q, cache, indices, *, kv_lora_rank: int, interpret: bool = False, **_) -> str | None:
    """Why this kernel cannot take the inputs (None if it can)."""
    if cache.dtype not in (jnp.bfloat16, jnp.uint8):
        return f"the Mosaic kernel takes a bf16 or fp8_ds_mla (uint8) cache, got {cache.dtype}"
    if q.ndim != 3 or q.shape[1] > HEADS:
        return f"query heads must be <= {HEADS}, got q of shape {q.shape}"
    width = q.shape[-1]
    if cache.dtype == jnp.uint8:
        if interpret:
            return "the fp8_ds_mla producer is Lane code, which the GPU interpreter cannot run"
        want = fp8_formats.mla_row_bytes(kv_lora_rank, width - kv_lora_rank)
        if cache.shape[-1] != want:
            return f"fp8_ds_mla row of {cache.shape[-1]} bytes != {want}"
        if (width - kv_lora_rank) * 2 != 8 * 16:
            return "the fp8 producer copies the rope part as 8 16-byte pieces: rope width must be 64"
        if want % 16:  # a misaligned vector load is a fault on the device, not a slow path
            return (f"fp8_ds_mla rows of {want} bytes are not 16-byte aligned (the fp8 producer's 16-byte loads "
                    "need kv_lora_rank 512)")
    elif cache.shape[-1] != width:
        return f"query row width {width} != cache row width {cache.shape[-1]}"
    if kv_lora_rank % (2 * COL_TILE) or width % COL_TILE or width <= kv_lora_rank:
        return (f"kv_lora_rank {kv_lora_rank} must be a multiple of {2 * COL_TILE} and the row width {width} a "
                f"multiple of {COL_TILE} above it")
    if kv_lora_rank // 2 > 256:
        return f"kv_lora_rank {kv_lora_rank} > 512: a consumer's half must fit one wgmma (N <= 256)"
    return None


def _load_slots(idx_ref, t, tile0, tiles_per_split, i):
    """The slot ids of tile i (clamped to the split's last tile: the prefetch past it), one per S column."""
    i = jnp.minimum(i, tiles_per_split - 1)
    return plgpu.load(idx_ref.at[t, pl.ds((tile0 + i) * BLOCK_K, BLOCK_K)],
                      layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)


def _scores_softmax(q_smem, k_tile, slots, m_i, scale):
    """S = q K^T of one tile, -inf at slot -1, and the online softmax step in log2 units: (p, alpha, m_new)."""
    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
        return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((HEADS, BLOCK_K), jnp.float32))
    valid = lax.broadcast_in_dim(slots >= 0, (HEADS, BLOCK_K), [1])
    s = jnp.where(valid, s * (scale * LOG2E), -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    return p, alpha, m_new


def _kernel(q_ref, cache_ref, idx_ref, live_ref, o_ref, lse_ref, q_smem, k_view, q_bar, k_ready, k_free, idx_smem,
            idx_bar, share, p_smem=None, *, scale,
            r, width, tiles_per_split, config, interpret, hooks, zero_empty):
    t = lax.axis_index("t")
    split = lax.axis_index("s")
    wg = lax.axis_index("wg")
    # every warpgroup reads the CTA's flag itself (one scalar load each): a split with no valid slot (a padding row,
    # or the tail split of a short row) skips the gathers, the MMAs and the softmax, with no barrier touched, and
    # writes what the full schedule gives it: lse -inf and (with `zero_empty`) o = 0
    live = live_ref[t, split] != 0
    n_cols = width // COL_TILE
    half = r // 2
    tile0 = split * tiles_per_split
    k_tiled, k_rows = k_view  # the same bytes as [2, 64, width] (tiled + swizzled) and [2, 8, cols, 8, 64]

    if config.share_p:
        _share_p_consumers(q_ref, idx_ref, o_ref, lse_ref, q_smem, k_tiled, q_bar, k_ready, k_free, share, t, split,
                           wg, tile0, tiles_per_split, half, scale, config, interpret, live, zero_empty)

    if not config.share_p:
        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(config.consumer_registers, action="increase")
            _write_empty(o_ref, lse_ref, split, t, wg, half, live, zero_empty, write_lse=wg == 0)

            @pl.when(live)
            def _():
                _plain_consumer(q_ref, idx_ref, o_ref, lse_ref, q_smem, k_tiled, q_bar, k_ready, k_free, p_smem, t,
                                split, wg, tile0, tiles_per_split, half, scale, interpret, hooks)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(config.producer_registers, action="decrease")

        @pl.when(live)
        def _():
            if cache_ref.dtype == jnp.uint8:
                _fp8_producer(cache_ref, idx_ref, k_tiled, k_ready, k_free, idx_smem, idx_bar, t, tile0,
                              tiles_per_split, r, width, config, hooks.fp8_producer)
            elif config.producer == "cp_async" and not interpret:
                _cp_async_producer(cache_ref, idx_ref, k_tiled, k_ready, k_free, t, tile0, tiles_per_split, width,
                                   config)
            else:
                _tma_producer(cache_ref, idx_ref, k_tiled, k_rows, k_ready, k_free, idx_smem, idx_bar, t, tile0,
                              tiles_per_split, n_cols, config, interpret)


def _plain_consumer(q_ref, idx_ref, o_ref, lse_ref, q_smem, k_tiled, q_bar, k_ready, k_free, p_smem, t, split, wg,
                    tile0, tiles_per_split, half, scale, interpret, hooks):
    """A consumer of the plain schedule (share_p=False): S = q K^T, the online softmax and its P V half."""
    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    m_i = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.zeros((HEADS, half), jnp.float32), plgpu.Layout.WGMMA)

    load_slots = functools.partial(_load_slots, idx_ref, t, tile0, tiles_per_split)

    def step(i, carry):
        acc, m_i, l_i, slots = carry
        b = lax.rem(i, 2)
        plgpu.barrier_wait(k_ready.at[b])
        if hooks.consumers == "idle":
            plgpu.barrier_arrive(k_free.at[b])
            return carry
        slots_next = load_slots(i + 1) if hooks.consumers != "no_mask" else slots

        p, alpha, m_new = _scores_softmax(q_smem, k_tiled.at[b], slots, m_i, scale)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        v = k_tiled.at[b, :, pl.ds(wg * half, half)]
        p16 = p.astype(jnp.bfloat16)
        if interpret:  # the interpreter runs neither wgmma with A in registers nor run_state on an ACC
            p_smem[wg] = p16
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem.at[wg], v)
                return acc_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC((HEADS, half), jnp.float32))
        else:
            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(k_free.at[b])
        return acc, m_new, l_i, slots_next

    if hooks.consumers != "no_mask":
        slots0 = load_slots(0)
    else:
        slots0 = plgpu.layout_cast(jnp.zeros((BLOCK_K,), jnp.int32), plgpu.Layout.WGMMA.reduce(0))
    acc, m_i, l_i, _ = lax.fori_loop(0, tiles_per_split, step, (acc, m_i, l_i, slots0))
    has = l_i > 0.0
    inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
    o_ref[split, t, :, pl.ds(wg * half, half)] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    m_fin = jnp.where(m_i == -jnp.inf, 0.0, m_i)
    lse = jnp.where(has, (m_fin + jnp.log2(jnp.where(has, l_i, 1.0))) * (1.0 / LOG2E), -jnp.inf)

    @pl.when(wg == 0)
    def _():
        lse_ref[split, t, :] = lse


def _write_empty(o_ref, lse_ref, split, t, w, half, live, zero_empty, write_lse):
    """What a split with no valid slot writes, with none of its work done: lse -inf (exp(-inf) = 0: its weight in
    the merge) and, where `zero_empty`, o = 0 in this consumer's half of the columns (what the full schedule gives
    such a split: P = 0, so acc = 0 and 1 / l is taken as 0). Without `zero_empty` its o is left unwritten: the
    merges never read the o of a split whose lse is -inf (`kernels.lse_merge`), and o there would be 2 x 64 heads
    x 512 x 4 bytes a padding row of a decode step, written for nothing."""
    def store_lse():
        lse_ref[split, t, :] = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32),
                                                 plgpu.Layout.WGMMA.reduce(1))

    @pl.when(jnp.logical_not(live))
    def _():
        if zero_empty:
            o_ref[split, t, :, pl.ds(w * half, half)] = plgpu.layout_cast(jnp.zeros((HEADS, half), jnp.float32),
                                                                         plgpu.Layout.WGMMA)
        if write_lse is True:  # a bool: this warpgroup writes it (or, False, not); else a traced "is it this one"
            store_lse()
        elif write_lse is not False:
            pl.when(write_lse)(store_lse)


def _drain(k_free, tiles_per_split):
    """Wait for the consumers to release the last two tiles: every phase of `k_free` is observed (the GPU
    interpreter checks this; on the device the producer just leaves after the consumers)."""
    for j in range(2):
        @pl.when(tiles_per_split - 2 + j >= 0)
        def _():
            plgpu.barrier_wait(k_free.at[lax.rem(tiles_per_split + j, 2)])


def _share_p_consumers(q_ref, idx_ref, o_ref, lse_ref, q_smem, k_tiled, q_bar, k_ready, k_free, share, t, split,
                       wg, tile0, tiles_per_split, half, scale, config, interpret, live, zero_empty):
    """Consumer 0 computes S = q K^T and the online softmax, publishes P (bf16) and the rescale factors in
    shared memory (`p_ready`), and accumulates its P V half from registers; consumer 1 rescales and
    accumulates the other half with P read from shared memory, then frees P (`p_free`). A split with no valid slot
    (not `live`) does none of it (`_write_empty`)."""
    p_share, stats, p_ready, p_free = share  # stats[0]: alpha of the current tile, stats[1]: the final l

    load_slots = functools.partial(_load_slots, idx_ref, t, tile0, tiles_per_split)

    def pv(acc, a, b, w):
        v = k_tiled.at[b, :, pl.ds(w * half, half)]
        if interpret:  # the interpreter runs neither wgmma with A in registers nor run_state on an ACC
            def f(acc_ref):
                plgpu.wgmma(acc_ref, p_share if w == 1 or interpret else a, v)
                return acc_ref[...]
            return acc + pl.run_scoped(f, plgpu.ACC((HEADS, half), jnp.float32))

        def g(acc_ref):
            plgpu.wgmma(acc_ref, a, v)
        return pl.run_state(g)(plgpu.ACC.init(acc))

    def finish(acc, l_i, w):
        has = l_i > 0.0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
        o_ref[split, t, :, pl.ds(w * half, half)] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        return has

    acc0 = plgpu.layout_cast(jnp.zeros((HEADS, half), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _leader():
        plgpu.set_max_registers(config.consumer_registers, action="increase")
        _write_empty(o_ref, lse_ref, split, t, 0, half, live, zero_empty, write_lse=True)

        @pl.when(live)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem, q_bar)
            plgpu.barrier_wait(q_bar)
            m_i = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.zeros((HEADS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

            def step(i, carry):
                acc, m_i, l_i, slots = carry
                b = lax.rem(i, 2)
                plgpu.barrier_wait(k_ready.at[b])
                slots_next = load_slots(i + 1)

                p, alpha, m_new = _scores_softmax(q_smem, k_tiled.at[b], slots, m_i, scale)
                p16 = p.astype(jnp.bfloat16)
                l_i = l_i * alpha + p16.astype(jnp.float32).sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                @pl.when(i >= 1)
                def _():
                    plgpu.barrier_wait(p_free)
                p_share[...] = p16
                stats[0] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
                acc = pv(acc, p16, b, 0)
                plgpu.barrier_arrive(k_free.at[b])
                return acc, m_new, l_i, slots_next

            acc, m_i, l_i, _ = lax.fori_loop(0, tiles_per_split, step, (acc0, m_i, l_i, load_slots(0)))
            plgpu.barrier_wait(p_free)  # consumer 1 is done with the last P before stats[1] is written
            stats[1] = l_i
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            has = finish(acc, l_i, 0)
            m_fin = jnp.where(m_i == -jnp.inf, 0.0, m_i)
            lse_ref[split, t, :] = jnp.where(has, (m_fin + jnp.log2(jnp.where(has, l_i, 1.0))) * (1.0 / LOG2E),
                                             -jnp.inf)

    @pl.when(wg == 1)
    def _follower():
        plgpu.set_max_registers(config.second_consumer_registers, action="increase")
        _write_empty(o_ref, lse_ref, split, t, 1, half, live, zero_empty, write_lse=False)

        @pl.when(live)
        def _():
            def step(i, acc):
                b = lax.rem(i, 2)
                plgpu.barrier_wait(k_ready.at[b])
                plgpu.barrier_wait(p_ready)
                alpha = plgpu.load(stats.at[0], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = pv(acc, p_share, b, 1)
                plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(k_free.at[b])
                return acc

            acc = lax.fori_loop(0, tiles_per_split, step, acc0)
            plgpu.barrier_wait(p_ready)
            finish(acc, plgpu.load(stats.at[1], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False), 1)


def _tma_producer(cache_ref, idx_ref, k_tiled, k_rows, k_ready, k_free, idx_smem, idx_bar, t, tile0,
                  tiles_per_split, n_cols, config, interpret):
    """One TMA per (row, 64-column chunk): 9 x 64 single-thread issues per tile, each arriving on `k_ready`.
    slot_source "smem": the slot ids are read by plain loads (the generic proxy) and their buffer refilled by TMA
    (the async proxy) two tiles later, which the PTX memory model orders only through a proxy fence between the
    two: the producer's `commit_smem` (fence.proxy.async.shared::cta) after its reads, before the refill."""
    def fill(i, _):
        b = lax.rem(i, 2)

        @pl.when(i >= 2)
        def _():
            plgpu.barrier_wait(k_free.at[b])
        base = (tile0 + i) * BLOCK_K
        if config.slot_source == "smem":
            plgpu.commit_smem()  # the reads of idx_smem[b] (tile i - 2's ids) before the TMA rewrites it
            plgpu.copy_gmem_to_smem(idx_ref.at[t, pl.ds(base, BLOCK_K)], idx_smem.at[b], idx_bar.at[b])
            plgpu.barrier_wait(idx_bar.at[b])

        def row(j, _):
            slot = idx_smem[b, j] if config.slot_source == "smem" else idx_ref[t, base + j]
            for c in range(n_cols):
                src = cache_ref.at[pl.ds(slot, 1), pl.ds(c * COL_TILE, COL_TILE)]
                if interpret:
                    dst = k_tiled.at[b, pl.ds(j, 1), pl.ds(c * COL_TILE, COL_TILE)]
                else:
                    dst = k_rows.at[b, j // 8, c, pl.ds(lax.rem(j, 8), 1), :]
                plgpu.copy_gmem_to_smem(src, dst, k_ready.at[b])  # slot -1: out of bounds, reads zeros
            return None
        lax.fori_loop(0, BLOCK_K, row, None)
        return None
    lax.fori_loop(0, tiles_per_split, fill, None)
    if interpret:  # the interpreter checks that a thread waiting on `k_free` observes all its phases
        _drain(k_free, tiles_per_split)


def _l2_prefetch(cache_ref, idx_ref, t, tile0, tiles_per_split, ahead):
    """The producer's L2 prefetch (`MosaicSparseMLAConfig.l2_prefetch`): returns ask(i), which asks L2 for the
    rows of the split's tile i (nothing past its last tile), after asking now for tiles 1 .. ahead - 1. Rows that
    are not a whole number of 16-byte pieces (bulk prefetches need that) are not prefetched."""
    row_bytes = cache_ref.shape[-1] * jnp.dtype(cache_ref.dtype).itemsize
    if not ahead or row_bytes % 16:
        return lambda i: None
    issue = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                         plgpu.Layout.WG_SPLAT))(
        functools.partial(_issue_l2_prefetch, row_bytes=row_bytes))

    def ask(i):
        @pl.when(i < tiles_per_split)
        def _():
            issue(cache_ref, idx_ref, t, (tile0 + i) * BLOCK_K)
    for j in range(1, ahead):
        ask(j)
    return ask


def _issue_l2_prefetch(ctx, cache, idx, t_fa, base_fa, *, row_bytes):
    """Lane code (inline_mgpu): producer threads 0..63 each ask L2 for the cache row of slot idx[t, base + tid]
    with one bulk prefetch (no registers or shared memory held while it is in flight); slot -1 asks nothing."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    del ctx
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()

    def c(v):
        return arith.constant(i32, v)
    t = t_fa.registers.item()
    base = base_fa.registers.item()
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    row = arith.remui(tid, c(BLOCK_K))
    slot = memref.load(idx, [arith.index_cast(index, t), arith.index_cast(index, arith.addi(base, row))])
    want = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, tid, c(BLOCK_K)),
                      arith.cmpi(arith.CmpIPredicate.sge, slot, c(0)))
    slot = arith.select(want, slot, c(0))
    src = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(cache),
                                   [arith.muli(arith.extui(i64, slot), arith.constant(i64, row_bytes))], i8)
    mgpu_utils.inline_ptx(f"cp.async.bulk.prefetch.L2.global [$0], {row_bytes};", src, predicate=want,
                          has_side_effects=True)


def _cp_async_producer(cache_ref, idx_ref, k_tiled, k_ready, k_free, t, tile0, tiles_per_split, width, config):
    """Each of the 128 producer threads copies 16-byte pieces with cp.async straight into the swizzled tile:
    8 threads per row (128 contiguous bytes per warp quarter), 4 rows and width / 64 column tiles per thread.
    Completion: each thread waits for its own copies (cp.async.wait_group, one tile in flight beside the
    one being filled), fences them for the tensor cores (commit_smem) and arrives on `k_ready`."""
    gather = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(),
                                          plgpu.RefType((plgpu.TilingTransform((8, COL_TILE)),
                                                         plgpu.SwizzleTransform(128))),
                                          plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT))(
        functools.partial(_issue_row_copies, width=width))
    prefetch = _l2_prefetch(cache_ref, idx_ref, t, tile0, tiles_per_split, config.l2_prefetch)

    def fill(i, _):
        b = lax.rem(i, 2)
        prefetch(i + config.l2_prefetch)

        @pl.when(i >= 2)
        def _():
            plgpu.barrier_wait(k_free.at[b])
        gather(cache_ref, idx_ref, k_tiled, t, (tile0 + i) * BLOCK_K, b)

        @pl.when(i >= 1)
        def _():
            wait_async_copies(1)
            plgpu.commit_smem()
            plgpu.barrier_arrive(k_ready.at[1 - b])
        return None
    lax.fori_loop(0, tiles_per_split, fill, None)
    wait_async_copies(0)
    plgpu.commit_smem()
    plgpu.barrier_arrive(k_ready.at[lax.rem(tiles_per_split - 1, 2)])
    _drain(k_free, tiles_per_split)


def _fp8_producer(cache_ref, idx_ref, k_tiled, k_ready, k_free, idx_smem, idx_bar, t, tile0, tiles_per_split, r,
                  width, config, mode: str = "full"):
    """fp8_ds_mla rows dequantised into the bf16 tile: each thread loads 16-byte pieces of e4m3 (4 rows x
    R / 128 pieces), converts them exactly (e4m3 -> f16 -> f32, x the piece's f32 tile scale, one rounding to
    bf16) and stores them at their swizzled place; the bf16 rope part goes by cp.async. One tile at a time: the
    loads are synchronous, so the next tile's loads wait for this tile's conversion. With slot_source "smem" the
    next tile's slot ids come by one TMA copy issued before this tile's gather, so no thread waits on a global
    load of its ids before its row loads. `mode`: `Hooks.fp8_producer`."""
    from_smem = config.slot_source == "smem"
    slot_types = (plgpu.RefType(),) if from_smem else ()
    gather = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(),
                                          plgpu.RefType((plgpu.TilingTransform((8, COL_TILE)),
                                                         plgpu.SwizzleTransform(128))),
                                          plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT)
                               + slot_types)(
        functools.partial(_issue_fp8_rows, r=r, width=width, mode=mode))

    def fetch_slots(i):  # tile i's 64 slot ids into idx_smem[i % 2]
        @pl.when(i < tiles_per_split)
        def _():
            b = lax.rem(i, 2)
            plgpu.copy_gmem_to_smem(idx_ref.at[t, pl.ds((tile0 + i) * BLOCK_K, BLOCK_K)], idx_smem.at[b],
                                    idx_bar.at[b])

    if from_smem and mode != "idle":
        fetch_slots(0)

    def fill(i, _):
        b = lax.rem(i, 2)

        @pl.when(i >= 2)
        def _():
            plgpu.barrier_wait(k_free.at[b])
        if mode != "idle":
            if from_smem:
                # idx_smem[1 - b] held tile i - 1's ids, which every thread has read (the warpgroup barrier at the
                # end of the last gather)
                fetch_slots(i + 1)
                plgpu.barrier_wait(idx_bar.at[b])
                gather(cache_ref, idx_ref, k_tiled, t, (tile0 + i) * BLOCK_K, b, idx_smem)
            else:
                gather(cache_ref, idx_ref, k_tiled, t, (tile0 + i) * BLOCK_K, b)
            wait_async_copies(0)
            plgpu.commit_smem()
        plgpu.barrier_arrive(k_ready.at[b])
        return None
    lax.fori_loop(0, tiles_per_split, fill, None)
    _drain(k_free, tiles_per_split)


_E4M3X4_TO_BF16 = """{
.reg .b16 lo, hi;
.reg .b32 h01, h23;
.reg .f16 f0, f1, f2, f3;
.reg .f32 x0, x1, x2, x3;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 x0, f0;
cvt.f32.f16 x1, f1;
cvt.f32.f16 x2, f2;
cvt.f32.f16 x3, f3;
mul.rn.f32 x0, x0, $3;
mul.rn.f32 x1, x1, $3;
mul.rn.f32 x2, x2, $3;
mul.rn.f32 x3, x3, $3;
cvt.rn.bf16x2.f32 $0, x1, x0;
cvt.rn.bf16x2.f32 $1, x3, x2;
}"""  # 4 e4m3 bytes (little-endian word) x an f32 scale -> 2 words of bf16 pairs, in memory order


def _issue_fp8_rows(ctx, cache, idx, k_smem, t_fa, base_fa, b_fa, slots_smem=None, *, r, width, mode):
    """Lane code (inline_mgpu): this thread's share of tile `b` from fp8_ds_mla rows idx[t, base:base + 64]
    (their ids read from `slots_smem`[b] where it is given). Thread (row0 = tid // 8, lane8 = tid % 8) takes
    rows row0 + 16 k and the 16-value pieces lane8 + 8 j of the latent (R / 128 per row: piece j lies in scale
    tile j, so a row's scales are one vector load) plus rope piece lane8. Slot -1: zeros (its words and scales
    selected to 0 before the conversion, the rope by a 0-byte cp.async source). mode: "full", or a part left
    out (`Hooks.fp8_producer`): "no_convert" stores the loaded words as they are, "no_load" converts words it did
    not load (no cache bytes read)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    del ctx
    assert mode in ("full", "no_convert", "no_load"), mode
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    f32 = ir.F32Type.get()
    index = ir.IndexType.get()

    def c(v):
        return arith.constant(i32, v)
    n_tiles = fp8_formats.mla_num_tiles(r)
    assert fp8_formats.mla_tile(r) == 128 and n_tiles % 4 == 0, "supports() admits R = 512 only"
    row_bytes = fp8_formats.mla_row_bytes(r, width - r)
    scale_off, pe_off = r, r + 4 * n_tiles
    n_cols = width // COL_TILE
    tile_bytes = BLOCK_K * 2 * width
    t = t_fa.registers.item()
    base = base_fa.registers.item()
    b = b_fa.registers.item()
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    lane8 = arith.remui(tid, c(8))
    row0 = arith.divui(tid, c(8))
    cache_ptr = mgpu_utils.memref_ptr(cache)
    k_ptr = mgpu_utils.memref_ptr(k_smem)
    zero = c(0)
    fzero = arith.constant(f32, 0.0)
    rows = []
    for rep in range(BLOCK_K // 16):  # issue every load of the tile first: they are in flight together
        row = arith.addi(row0, c(16 * rep))
        if slots_smem is not None:
            slot = memref.load(slots_smem, [arith.index_cast(index, b), arith.index_cast(index, row)])
        else:
            slot = memref.load(idx, [arith.index_cast(index, t), arith.index_cast(index, arith.addi(base, row))])
        valid = arith.cmpi(arith.CmpIPredicate.sge, slot, zero)
        slot = arith.select(valid, slot, zero)
        row_ptr = mgpu_utils.getelementptr(cache_ptr, [arith.muli(arith.extui(i64, slot),
                                                                  arith.constant(i64, row_bytes))], i8)
        r_in = arith.remui(row, c(8))
        row_dst = arith.addi(arith.muli(b, c(tile_bytes)),
                             arith.addi(arith.muli(arith.divui(row, c(8)), c(n_cols * 1024)), arith.muli(r_in, c(128))))
        scales = []
        for j0 in range(0, n_tiles, 4):  # the row's tile scales, four per (16-byte aligned) vector load
            if mode == "no_load":
                scales.extend([arith.constant(f32, 1.0)] * 4)
                continue
            src = mgpu_utils.getelementptr(row_ptr, [scale_off + 4 * j0], i8)
            scales.extend(mgpu_utils.inline_ptx("ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", src,
                                                result_types=[f32] * 4))
        pieces = []
        for j in range(n_tiles):
            piece = arith.addi(lane8, c(8 * j))  # 16 e4m3 values: columns 16 piece .. 16 piece + 15
            if mode == "no_load":  # words the compiler cannot fold (the conversion is opaque PTX anyway)
                words = [arith.addi(slot, c(0x38383838 + w)) for w in range(4)]
            else:
                src = mgpu_utils.getelementptr(row_ptr, [arith.extui(i64, arith.muli(piece, c(16)))], i8)
                words = mgpu_utils.inline_ptx("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", src,
                                              result_types=[i32] * 4)
            pieces.append((piece, words, scales[j]))
        if mode != "no_load":
            pe_src = mgpu_utils.getelementptr(
                row_ptr, [arith.extui(i64, arith.addi(c(pe_off), arith.muli(lane8, c(16))))], i8)
            pe_dst = mgpu_utils.getelementptr(k_ptr, [arith.addi(arith.addi(row_dst, c((n_cols - 1) * 1024)),
                                                                 arith.muli(arith.xori(lane8, r_in), c(16)))], i8)
            mgpu_utils.inline_ptx("cp.async.cg.shared.global [$0], [$1], 16, $2;", pe_dst, pe_src,
                                  arith.select(valid, c(16), zero), has_side_effects=True)
        rows.append((valid, row_dst, r_in, pieces))
    mgpu_utils.inline_ptx("cp.async.commit_group;", has_side_effects=True)
    if slots_smem is not None:  # every thread has read its ids from slots_smem[b] before it is refilled (tile b + 2)
        mgpu_utils.warpgroup_barrier()
    for valid, row_dst, r_in, pieces in rows:
        for piece, words, scale in pieces:
            # slot -1 read row 0, whose bytes may be anything (NaN or inf scales among them): its words and scale
            # become 0 here, so the conversion gives +0 (0 x 0), four selects a piece instead of eight after
            scale = arith.select(valid, scale, fzero)
            if mode == "no_convert":  # 16 bytes loaded, 32 stored: the words twice
                out = [arith.select(valid, w, zero) for w in words] * 2
            else:
                out = []
                for w in words:
                    out.extend(mgpu_utils.inline_ptx(_E4M3X4_TO_BF16, arith.select(valid, w, zero), scale,
                                                     result_types=[i32, i32]))
            # columns 16 piece.. land in column tile piece // 4, 16-byte chunks 2 (piece % 4) and + 1 of the row
            col_tile = arith.divui(piece, c(4))
            chunk = arith.muli(arith.remui(piece, c(4)), c(2))
            for half in range(2):
                off = arith.addi(arith.addi(row_dst, arith.muli(col_tile, c(1024))),
                                 arith.muli(arith.xori(arith.addi(chunk, c(half)), r_in), c(16)))
                dst = mgpu_utils.getelementptr(k_ptr, [off], i8)
                mgpu_utils.inline_ptx("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", dst, *out[4 * half:4 * half + 4],
                                      has_side_effects=True)


def _issue_row_copies(ctx, cache, idx, k_smem, t_fa, base_fa, b_fa, *, width):
    """Lane code (inline_mgpu): issue this thread's cp.async copies of tile `b` (rows idx[t, base:base + 64])
    and commit them as one group. Slot -1 copies 0 source bytes (cp.async zero-fills the 16 bytes)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    del ctx
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()

    def c(v):
        return arith.constant(i32, v)
    t = t_fa.registers.item()
    base = base_fa.registers.item()
    b = b_fa.registers.item()
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    lane8 = arith.remui(tid, c(8))
    row0 = arith.divui(tid, c(8))
    n_cols = width // COL_TILE
    row_bytes = 2 * width
    cache_ptr = mgpu_utils.memref_ptr(cache)
    k_ptr = mgpu_utils.memref_ptr(k_smem)
    tile_bytes = BLOCK_K * row_bytes
    for rep in range(BLOCK_K // 16):
        r = arith.addi(row0, c(16 * rep))
        slot = memref.load(idx, [arith.index_cast(index, t), arith.index_cast(index, arith.addi(base, r))])
        valid = arith.cmpi(arith.CmpIPredicate.sge, slot, c(0))
        slot = arith.select(valid, slot, c(0))
        src_size = arith.select(valid, c(16), c(0))
        src_off = arith.addi(arith.muli(arith.extui(ir.IntegerType.get_signless(64), slot),
                                        arith.constant(ir.IntegerType.get_signless(64), row_bytes)),
                             arith.extui(ir.IntegerType.get_signless(64), arith.muli(lane8, c(16))))
        src = mgpu_utils.getelementptr(cache_ptr, [src_off], i8)
        r_in = arith.remui(r, c(8))
        dst_off = arith.addi(
            arith.addi(arith.muli(b, c(tile_bytes)), arith.muli(arith.divui(r, c(8)), c(n_cols * 1024))),
            arith.addi(arith.muli(r_in, c(128)), arith.muli(arith.xori(lane8, r_in), c(16))))
        dst = mgpu_utils.getelementptr(k_ptr, [dst_off], i8)
        for col in range(n_cols):
            s_ptr = mgpu_utils.getelementptr(src, [128 * col], i8)
            d_ptr = mgpu_utils.getelementptr(dst, [1024 * col], i8)
            mgpu_utils.inline_ptx("cp.async.cg.shared.global [$0], [$1], 16, $2;", d_ptr, s_ptr, src_size,
                                  has_side_effects=True)
    del llvm
    mgpu_utils.inline_ptx("cp.async.commit_group;", has_side_effects=True)


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "config", "interpret", "return_partials",
                                             "hooks", "skip_empty"))
def _run(q, cache, indices, *, scale, kv_lora_rank, config, interpret, return_partials, hooks, skip_empty=True):
    """The launch (and merge). skip_empty=False runs the full schedule for every split, empty or not (what the
    kernel did before it skipped them: tests compare the two bit for bit)."""
    t_rows, h, width = q.shape
    k = indices.shape[1]
    n_split = config.n_split
    tiles = -(-k // BLOCK_K)
    tiles_per_split = -(-tiles // n_split)
    k_pad = tiles_per_split * n_split * BLOCK_K
    indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, k_pad - k)), constant_values=-1)
    # 1 where a (row, split) holds a valid slot: one small XLA reduction over the [T, K] ids (2 MB at 256 rows of
    # top-k 2048), read by each CTA as one scalar. In the kernel the same answer would need each warpgroup (the
    # producer before its first gather, the consumers before their first wait) to read and reduce the split's
    # 1024 ids across its 128 threads, or a barrier to hand one warpgroup's answer to the others.
    live = jnp.any(indices.reshape(t_rows, n_split, tiles_per_split * BLOCK_K) >= 0, axis=-1).astype(jnp.int32)
    if not skip_empty:
        live = jnp.ones_like(live)
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, HEADS - h), (0, 0)))
    r = kv_lora_rank
    n_cols = width // COL_TILE
    tiling = plgpu.TilingTransform((8, COL_TILE))
    swizzle = plgpu.SwizzleTransform(128)
    k_tiled = plgpu.SMEM((2, BLOCK_K, width), jnp.bfloat16, transforms=(tiling, swizzle))
    k_rows = plgpu.SMEM((2, BLOCK_K // 8, n_cols, 8, COL_TILE), jnp.bfloat16, transforms=(swizzle,))
    k_view = (k_tiled, k_rows) if interpret else plgpu.RefUnion(k_tiled, k_rows)
    cp_async = config.producer == "cp_async" and not interpret
    # an empty split's o = 0 is written only where the partials leave this function as they are (the caller's
    # partials, or the one split's o); a merge never reads the o of a split whose lse is -inf
    zero_empty = return_partials or n_split == 1 or not skip_empty
    lane_producer = cp_async or cache.dtype == jnp.uint8  # fp8_ds_mla always takes its own (Lane code) producer
    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, r=r, width=width, tiles_per_split=tiles_per_split, config=config,
                          interpret=interpret, hooks=hooks, zero_empty=zero_empty),
        out_type=(jax.ShapeDtypeStruct((n_split, t_rows, HEADS, r), jnp.float32),
                  jax.ShapeDtypeStruct((n_split, t_rows, HEADS), jnp.float32)),
        scratch_types=(
            plgpu.SMEM((HEADS, width), jnp.bfloat16, transforms=(tiling, swizzle)),
            k_view,
            plgpu.Barrier(num_arrivals=1),
            # one arrival per tile from a Lane-code producer (cp.async, fp8), one per TMA copy otherwise
            plgpu.Barrier(num_arrivals=1 if lane_producer else BLOCK_K * n_cols, num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),
            plgpu.SMEM((2, BLOCK_K), jnp.int32) if _slot_tiles(config) else None,
            plgpu.Barrier(num_arrivals=1, num_barriers=2) if _slot_tiles(config) else None,
            (plgpu.SMEM((HEADS, BLOCK_K), jnp.bfloat16, transforms=(tiling, swizzle)),
             plgpu.SMEM((2, HEADS), jnp.float32), plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1))
            if config.share_p else None,
        ) + ((plgpu.SMEM((2, HEADS, BLOCK_K), jnp.bfloat16, transforms=(tiling, swizzle)),) if interpret else ()),
        grid=(t_rows, n_split),
        grid_names=("t", "s"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=_reduction_scratch(config)),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    o, lse = kernel(q, cache, indices, live)
    if return_partials:
        return o[:, :, :h], lse[:, :, :h]
    if n_split == 1:
        return o[0, :, :h], lse[0, :, :h]
    if config.merge == "launch":  # the kernel merges all HEADS rows; the padding heads are sliced off after
        o, lse = merge_splits(o, lse, impl="triton_interpret" if interpret else "triton")
        return o[:, :h], lse[:, :h]
    return merge_partials(o[:, :, :h], lse[:, :, :h], axis=0)


def sparse_mla_mosaic(q, cache, indices, *, scale: float, kv_lora_rank: int,
                      config: MosaicSparseMLAConfig | None = None, interpret: bool = False,
                      return_partials: bool = False, hooks: Hooks | None = None, **overrides):
    """o [T, H, R] float32, lse [T, H] (natural log) of `q` [T, H, R + Dr] against the bf16 `cache`
    [slots, R + Dr] at `indices` [T, K] (-1 = none), by the warp-specialised Mosaic GPU kernel.

    config: a `MosaicSparseMLAConfig` (default: `default_config(T, K, fp8, share_p)`, share_p as the overrides ask);
    `overrides` replace its fields.
    interpret: run the same kernel in Pallas' GPU interpreter (CPU). return_partials: the per-split
    (o [n_split, T, H, R], lse [n_split, T, H]) instead of their merge. hooks: parts of the work left out for
    timing the rest (`Hooks`; benchmarks/diagnostics only), None for the kernel."""
    why = supports(q, cache, indices, kv_lora_rank=kv_lora_rank, interpret=interpret)
    if why:
        raise ValueError(f"sparse_mla_mosaic: {why}")
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla_mosaic: indices rows {indices.shape[0]} != query rows {q.shape[0]}")
    # the schedule is part of the default's register split: share_p=False asks for the default of that schedule
    config = config or default_config(registry.config_rows(q.shape[0]), indices.shape[1], cache.dtype == jnp.uint8,
                                      share_p=overrides.get("share_p", True) is not False)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    registry.launch("sparse_mla_mosaic", config)
    hooks = hooks or Hooks()
    if hooks.fp8_producer != "full" and cache.dtype != jnp.uint8:
        raise ValueError(f"sparse_mla_mosaic: hooks fp8_producer {hooks.fp8_producer!r} leaves out part of the "
                         f"fp8_ds_mla producer; this cache is {cache.dtype}")
    if hooks.consumers == "idle" and config.share_p:
        raise ValueError("sparse_mla_mosaic: hooks consumers 'idle' needs share_p=False (the idle consumers are the "
                         "plain schedule's)")
    need = shared_memory_bytes(q.shape[-1], config)
    if not interpret and need > SMEM_LIMIT:  # refused before a compile that would fail with the same numbers
        raise ValueError(f"sparse_mla_mosaic: this config needs {need} bytes of shared memory per CTA (share_p="
                         f"{config.share_p}, slot_source={config.slot_source!r}, rows of {q.shape[-1]} columns), "
                         f"over the H200's {SMEM_LIMIT}")
    return _run(q, cache, indices, scale=float(scale), kv_lora_rank=int(kv_lora_rank), config=config,
                interpret=bool(interpret), return_partials=bool(return_partials), hooks=hooks)
