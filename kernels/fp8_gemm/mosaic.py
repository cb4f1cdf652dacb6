"""Pallas Mosaic GPU W8A8 grouped GEMM (SPEC §11): e4m3 x e4m3 wgmma with float32 accumulation, the 1 x 128
activation scales and 128 x 128 weight block scales applied per K block in registers.

out[r, n] = sum_kb (s_a[r, kb] * s_w[g, n // 128, kb]) * P_kb[r, n], P_kb the float32 wgmma partial of K block kb,
g the group of row r's tile (rows grouped by group in tiles of `tile_m`, `reference.group_layout`).

A persistent launch (one CTA per SM) walks the (row tile, column tile) pairs, column tile fastest, so the CTAs in
flight share a row tile in L2 and stream the group's weights. With `Fp8GemmConfig.chain` a CTA's tile pipelines
run as one chain (Pallas's pipeline_state): the producer refills the ring with the next tile's K blocks while the
compute warpgroups finish the current tile and store it. Per tile, a warp-specialised pipeline
(`plgpu.emit_pipeline_warp_specialized`): the producer warpgroup TMA-copies each K block's e4m3 row tile, weight
tile(s) and their scales into a ring of `stages` buffers; each compute warpgroup, per K block, loads the block's
scales into registers, issues its wgmma into a fresh accumulator, fences the scale loads against the TMA that will
refill the slot (`commit_smem`, while the wgmma runs), waits for the wgmma, and adds partial x (s_a * s_w) to its
running float32 accumulator (the promotion that keeps fp8 wgmma's short accumulator to one block). Where a K
block's wgmmas have small partials (the narrow SwiGLU tile's two 64 x 64, swap-AB SwiGLU's at decode) they are
issued back to back and waited for once (`Fp8GemmConfig.issue_together`): the tensor core gets a plain 64 x 128
tile's work between two waits. The two compute warpgroups interleave: one scales while the other's wgmma runs. The
epilogue stores bf16 (or float32) through shared memory by TMA. Tiles whose group is -1 store zeros and read nothing.

swap_ab (decode): the weight rows go on wgmma's M side (64 per compute warpgroup) and the few activation rows of
a group on its N side (8..256), so the tensor core is not 3/4 idle on a 16-row tile; the kernel writes out^T.

swiglu: two weight operands, gate and up, as stored (each [G, N, K]); a tile reads the same rows of both, and the
epilogue stores silu(gate) * up.

Scales travel with the tiles: the activation scales as s_a^T [K/128, M] (a tile's scales for one K block are one
contiguous run), the weight scales as [G, K/128, 32 N/128] with each scale repeated 32 times: every stage's
buffer of a TMA destination must start on a 128-byte boundary, so each stage's scale block is whole 128 bytes
(`config.scale_block_widths`). The shared memory this takes is `Fp8GemmConfig.smem_bytes`, as Mosaic GPU counts it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..common import mosaic_common
from .config import BLOCK, SCALE_REPEAT, SMEM_LIMIT, WGMMA_M, Fp8GemmConfig, scale_block_widths
from .reference import FP8

SM_COUNT = 132  # Hopper SXM (H100, H200)


def _swizzle(cols: int, dtype) -> int | None:
    """The shared-memory swizzle (bytes) of a tile of rows of `cols` elements: None for rows under 32 bytes (a
    decode store tile of 8 bf16 rows), which take none; else the largest that divides a row (16 for rows of an odd
    number of 16 bytes, which Mosaic GPU does not take: `grouped_matmul_mosaic` refuses those configs)."""
    row_bits = cols * jnp.dtype(dtype).itemsize * 8
    return None if row_bits < 32 * 8 else plgpu.find_swizzle(row_bits)


def _tile_transforms(cols: int, dtype):
    """The tiled, swizzled shared-memory form of a tile of rows of `cols` elements (wgmma operands, store tiles);
    none for rows under 32 bytes (`_swizzle`)."""
    swizzle = _swizzle(cols, dtype)
    if swizzle is None:
        return ()
    bits = jnp.dtype(dtype).itemsize * 8
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _kernel(group_ref, ends_ref, a_ref, sa_ref, *refs, config: Fp8GemmConfig, m_tiles: int, n_tiles: int,
            k_blocks: int):
    cfg = config
    n_w = cfg.n_operands
    w_refs, sw_refs, o_ref = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w]
    wgs, n_sub, swap = cfg.compute_wgs, cfg.n_sub, cfg.swap_ab
    w_rows = cfg.operand_rows
    f32 = jnp.float32
    out_r, out_c = cfg.out_tile()
    e4m3 = _tile_transforms(BLOCK, FP8)
    sa_w, sw_w = scale_block_widths(cfg)

    def make_pipeline(body, compute_context, state=None):
        # a (rows) tile [tile_m, 128], each weight operand's tile [operand_rows, 128], s_a^T run [1, sa_w], each
        # operand's s_w run [1, sw_w]
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_blocks,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cfg.tile_m, BLOCK), lambda k: (0, k), transforms=e4m3, memory_space=plgpu.SMEM),
                *[plgpu.BlockSpec((w_rows, BLOCK), lambda k: (0, k), transforms=e4m3, memory_space=plgpu.SMEM)
                  for _ in range(n_w)],
                plgpu.BlockSpec((1, sa_w), lambda k: (k, 0), memory_space=plgpu.SMEM),
                *[plgpu.BlockSpec((1, sw_w), lambda k: (k, 0), memory_space=plgpu.SMEM) for _ in range(n_w)],
            ],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=cfg.stages,
            compute_context=compute_context,
            pipeline_state=state,
        )

    def operands(m_idx, n_idx, g):
        sw_col = (n_idx * w_rows // BLOCK) * SCALE_REPEAT
        return (a_ref.at[pl.ds(m_idx * cfg.tile_m, cfg.tile_m)],
                *[w.at[g, pl.ds(n_idx * w_rows, w_rows)] for w in w_refs],
                sa_ref.at[:, pl.ds(m_idx * cfg.tile_m, sa_w)],
                *[s.at[g, :, pl.ds(sw_col, sw_w)] for s in sw_refs])

    ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the body)

    @functools.partial(
        pl.run_scoped,
        allocs=make_pipeline(ignore, ignore).get_allocations(*operands(0, 0, 0)),
        out_smem=plgpu.SMEM((wgs, out_r, out_c), o_ref.dtype, transforms=_tile_transforms(out_c, o_ref.dtype)),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        wg_rows = WGMMA_M * cfg.m_sub  # this warpgroup's rows of the wgmma M side

        def my_rows(i):
            return pl.ds(wg * wg_rows + i * WGMMA_M, WGMMA_M)

        def out_window(m_idx, n_idx, i, s):
            """The gmem window of this warpgroup's store tile (m sub-tile i, column block s)."""
            if swap:  # out^T [N, M]: weight rows x activation rows
                return o_ref.at[pl.ds(n_idx * w_rows + wg * WGMMA_M, WGMMA_M),
                                pl.ds(m_idx * cfg.tile_m, cfg.tile_m)]
            cols = n_idx * w_rows if cfg.swiglu else n_idx * cfg.tile_n + s * BLOCK
            return o_ref.at[pl.ds(m_idx * cfg.tile_m + wg * wg_rows + i * WGMMA_M, WGMMA_M), pl.ds(cols, out_c)]

        def store(acc, window):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read out_smem
            out_smem[wg] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], window)

        def store_all(accs, m_idx, n_idx):
            for i in range(cfg.m_sub):
                if cfg.swiglu:  # the gate accumulator, then the up one: silu(gate) * up
                    gate, up = accs[i * n_sub], accs[i * n_sub + 1]
                    store(gate / (1.0 + jnp.exp(-gate)) * up, out_window(m_idx, n_idx, i, 0))
                else:
                    for s in range(n_sub):
                        store(accs[i * n_sub + s], out_window(m_idx, n_idx, i, s))

        def zeros():
            return plgpu.layout_cast(jnp.zeros((out_r, out_c), f32), plgpu.Layout.WGMMA)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tiles(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            m_idx, n_idx = lin // n_tiles, lin % n_tiles
            g = group_ref[m_idx]
            alone = g >= 0  # this tile's pipeline fills the ring and drains it on its own
            chained = None
            if cfg.chains(k_blocks):
                # The CTA's tile pipelines as one chain (`Fp8GemmConfig.chain`): its first tile with a group fills
                # the ring (START), the next ones find it filled by the producer while the last one computed
                # (STEADY), and its last one waits for every slot's release (STOP). A CTA with one such tile has
                # no chain: that tile's pipeline stands alone (a chain's state is START or STOP, not both).
                sm = lax.axis_index("sm")
                first, last = ends_ref[0, sm], ends_ref[1, sm]
                alone, chained = alone & (first == last), alone & (first != last)
                state = jnp.where(lin == first, int(plgpu.PipelinePipeline.START),
                                  jnp.where(lin == last, int(plgpu.PipelinePipeline.STOP),
                                            int(plgpu.PipelinePipeline.STEADY))).astype(jnp.int32)

            def compute_context(run):
                store_all(run(tuple(zeros() for _ in range(cfg.m_sub * n_sub))), m_idx, n_idx)

            def body(_, a_smem, *rest):
                w_smems, sa_smem, sw_smems, accs = rest[:n_w], rest[n_w], rest[n_w + 1:2 * n_w + 1], rest[-1]

                def weight(s):
                    """(the smem rows of wgmma s of m sub-tile i, as a function of i; its weight scale)"""
                    j, b = (s, 0) if cfg.swiglu else (0, s)  # operand, 128-row block inside the operand's tile
                    scale = sw_smems[j][0, b * SCALE_REPEAT]
                    if swap:
                        return (lambda i: w_smems[j].at[my_rows(i)]), scale
                    return (lambda i: w_smems[j].at[pl.ds(b * BLOCK, out_c)]), scale

                # Every read of this stage's scales, before the first wgmma: see `mma` for the fence after them.
                ws = [weight(s) for s in range(n_sub)]
                sas = [plgpu.load(sa_smem.at[0, pl.ds(0, cfg.tile_m) if swap else my_rows(i)],  # swap_ab: m_sub 1
                                  layout=plgpu.Layout.WGMMA.reduce(0 if swap else 1), optimized=False)
                       for i in range(cfg.m_sub)]
                # wgmmas issued before one wait: all of an m sub-tile's where their partials are small
                # (`Fp8GemmConfig.issue_together`), else one at a time
                issues = [tuple(range(n_sub))] if cfg.issue_together else [(s,) for s in range(n_sub)]
                new = []  # accs' order: m sub-tile i, then wgmma s (the issues cover s in order)
                for i in range(cfg.m_sub):
                    sa = sas[i]
                    for subs in issues:

                        def mma(*acc_refs, subs=subs, first=i == 0 and subs[0] == 0):
                            for s, acc_ref in zip(subs, acc_refs):
                                w_tile = ws[s][0]
                                if swap:
                                    plgpu.wgmma(acc_ref, w_tile(i), a_smem.transpose((1, 0)))
                                else:
                                    plgpu.wgmma(acc_ref, a_smem.at[my_rows(i)], w_tile(i).transpose((1, 0)))
                            if first:
                                # The scales above were read by plain loads (the generic proxy); the producer's TMA
                                # (the async proxy) refills this slot once every compute thread has arrived on the
                                # pipeline's consumed barrier, after this body returns. The barrier orders accesses
                                # of one proxy; across proxies the PTX memory model asks for a proxy fence
                                # (fence.proxy.async.shared::cta: `commit_smem`) between the read and the write, as
                                # CUTLASS's TMA epilogue has before it releases a loaded C stage. Issued while the
                                # first wgmma runs. The e4m3 tiles need none: wgmma reads them through the async
                                # proxy, and `acc_ref[...]` waits for it (wgmma.wait_group 0) before the release.
                                plgpu.commit_smem()
                            # the first read waits for every wgmma issued (wait_group 0); the others need no wait
                            return tuple(plgpu.wgmma_accumulator_load(a, wait_n=0 if n == 0 else None)
                                         for n, a in enumerate(acc_refs))

                        parts = pl.run_scoped(mma, *[plgpu.ACC((out_r, out_c), f32) for _ in subs])
                        for s, part in zip(subs, parts):
                            scale = lax.broadcast_in_dim(sa * ws[s][1], (out_r, out_c), [1] if swap else [0])
                            new.append(accs[i * n_sub + s] + part * scale)
                return tuple(new)

            if chained is not None:
                @pl.when(chained)
                def _chained():
                    make_pipeline(body, compute_context, state)(*operands(m_idx, n_idx, g), allocations=allocs)

            @pl.when(alone)
            def _alone():
                make_pipeline(body, compute_context)(*operands(m_idx, n_idx, g), allocations=allocs)

            @pl.when((g < 0) & (wg < wgs))
            def _empty():
                store_all(tuple(zeros() for _ in range(cfg.m_sub * n_sub)), m_idx, n_idx)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _chain_ends(tile_group, n_tiles: int, grid: int):
    """int32 [2, grid]: each CTA's first and last tile with a group (lin = row tile x n_tiles + column tile; CTA c
    takes lin = c, c + grid, ...), -1 for a CTA with none: where a chained kernel's pipelines start and stop."""
    busy = jnp.repeat(tile_group >= 0, n_tiles)
    steps = -(-busy.size // grid)
    busy = jnp.pad(busy, (0, steps * grid - busy.size)).reshape(steps, grid)
    lin = jnp.arange(steps * grid, dtype=jnp.int32).reshape(steps, grid)
    first = jnp.min(jnp.where(busy, lin, steps * grid), axis=0)
    last = jnp.max(jnp.where(busy, lin, -1), axis=0)
    return jnp.stack([jnp.where(first == steps * grid, -1, first), last]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret", "max_ctas"))
def _run(a_q, a_scale, w_qs, w_scales, tile_group, *, config, out_dtype, interpret, max_ctas=SM_COUNT):
    m, k = a_q.shape
    g, n, _ = w_qs[0].shape
    kb = k // BLOCK
    m_tiles, n_tiles = m // config.tile_m, n // config.operand_rows
    sa_w, _ = scale_block_widths(config)
    # [KB, M + pad]: the last tile's block of sa_w scales stays inside the array
    sa_t = jnp.pad(a_scale.astype(jnp.float32).T, ((0, 0), (0, sa_w - config.tile_m)), constant_values=1.0)
    sws = [jnp.repeat(jnp.swapaxes(s.astype(jnp.float32), 1, 2), SCALE_REPEAT, axis=2)  # [G, KB, 32 NB]
           for s in w_scales]
    out_shape = (n, m) if config.swap_ab else (m, n)
    grid = min(max_ctas, m_tiles * n_tiles)
    ends = _chain_ends(tile_group, n_tiles, grid) if config.chains(kb) else jnp.zeros((2, 1), jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, m_tiles=m_tiles, n_tiles=n_tiles, k_blocks=kb),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(grid,),
        grid_names=("sm",),
        num_threads=config.compute_wgs + 1,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    out = kernel(tile_group.astype(jnp.int32), ends, a_q, sa_t, *w_qs, *sws)
    return out.T if config.swap_ab else out


def lowered_smem_bytes(config: Fp8GemmConfig, out_dtype=jnp.bfloat16, k_blocks: int = 8) -> int:
    """Mosaic GPU's own count of the kernel's shared memory (bytes a CTA): the kernel lowered for CUDA (no device
    needed) with `k_blocks` K blocks (`mosaic_common.lowered_smem_bytes`; the figure does not depend on M, N or G).
    `config` may be one that `Fp8GemmConfig` rejects, built without its checks. ValueError when the lowering fails
    otherwise."""
    g, k = 2, k_blocks * BLOCK
    m, n = 2 * config.tile_m, 2 * config.operand_rows
    S = jax.ShapeDtypeStruct
    w, ws = S((g, n, k), FP8), S((g, n // BLOCK, k // BLOCK), jnp.float32)
    args = (S((m, k), FP8), S((m, k // BLOCK), jnp.float32), (w,) * config.n_operands, (ws,) * config.n_operands,
            S((m // config.tile_m,), jnp.int32))
    return mosaic_common.lowered_smem_bytes(
        lambda: _run.trace(*args, config=config, out_dtype=jnp.dtype(out_dtype), interpret=False).lower(
            lowering_platforms=("cuda",)), f"fp8 grouped matmul {config}")


def operand_list(w, name: str, config: Fp8GemmConfig) -> tuple:
    """The weight operands as a tuple: (gate, up) for swiglu configs, (w,) otherwise (TypeError naming `name`)."""
    pair = isinstance(w, (tuple, list))
    if config.swiglu != pair or (pair and len(w) != 2):
        want = "a pair (gate, up)" if config.swiglu else "one array"
        raise TypeError(f"fp8 grouped matmul: {name} must be {want} for {config}, got "
                        f"{type(w).__name__}{' of ' + str(len(w)) if pair else ''}")
    return tuple(w) if pair else (w,)


def check_operands(a_q, a_scale, w_q, w_scale, tile_group, config: Fp8GemmConfig) -> tuple[tuple, tuple]:
    """Refuse operands the kernel does not take, naming the shapes (TypeError for dtypes and operand counts,
    ValueError for shapes); returns the weights and their scales as tuples (`operand_list`)."""
    w_qs, w_ss = operand_list(w_q, "w_q", config), operand_list(w_scale, "w_scale", config)
    if jnp.dtype(a_q.dtype) != FP8 or any(jnp.dtype(w.dtype) != FP8 for w in w_qs):
        raise TypeError(f"fp8 grouped matmul: a_q and w_q must be float8_e4m3fn, got {a_q.dtype}, "
                        f"{', '.join(str(w.dtype) for w in w_qs)}")
    w0 = w_qs[0]
    if a_q.ndim != 2 or w0.ndim != 3 or a_q.shape[1] != w0.shape[2] or any(w.shape != w0.shape for w in w_qs):
        raise ValueError(f"fp8 grouped matmul: a_q [M, K] and w_q [G, N, K] (swiglu: gate and up alike), got "
                         f"{a_q.shape}, {', '.join(str(w.shape) for w in w_qs)}")
    m, k = a_q.shape
    g, n, _ = w0.shape
    if k % BLOCK or n % config.operand_rows or m % config.tile_m:
        raise ValueError(f"fp8 grouped matmul: K = {k} must be a multiple of {BLOCK}, N = {n} of "
                         f"{config.operand_rows} (the weight rows of an operand in a tile), M = {m} of tile_m "
                         f"{config.tile_m}")
    want = (g, n // BLOCK, k // BLOCK)
    if a_scale.shape != (m, k // BLOCK) or any(s.shape != want for s in w_ss):
        raise ValueError(f"fp8 grouped matmul: a_scale {a_scale.shape} must be {(m, k // BLOCK)}, w_scale "
                         f"{', '.join(str(s.shape) for s in w_ss)} must be {want}")
    if tile_group.shape != (m // config.tile_m,):
        raise ValueError(f"fp8 grouped matmul: tile_group {tile_group.shape} must be [{m // config.tile_m}] "
                         f"(one group per {config.tile_m}-row tile)")
    return w_qs, w_ss


def grouped_matmul_mosaic(a_q, a_scale, w_q, w_scale, tile_group, *, config: Fp8GemmConfig,
                          out_dtype=jnp.bfloat16, interpret: bool = False, max_ctas: int = SM_COUNT):
    """out_dtype [M, N]: the W8A8 grouped product of e4m3 rows `a_q` [M, K] (float32 scales `a_scale` [M, K/128])
    with e4m3 weights `w_q` [G, N, K] (float32 block scales `w_scale` [G, N/128, K/128]); swiglu configs take
    `w_q` = (gate, up) and `w_scale` = (gate scales, up scales), each as above, and give silu(gate) * up. Row tile
    t (of config.tile_m rows) uses group tile_group[t]'s weights, and its rows are zeros where that is -1.
    interpret: run under the Pallas Mosaic GPU interpreter (CPU tests). max_ctas: CTAs launched at most (one per
    SM of a Hopper SXM by default; a test takes fewer, so that each CTA walks several tiles)."""
    w_qs, w_ss = check_operands(a_q, a_scale, w_q, w_scale, tile_group, config)
    itemsize = jnp.dtype(out_dtype).itemsize
    need = config.smem_bytes(itemsize, a_q.shape[1] // BLOCK)
    if need > SMEM_LIMIT:
        raise ValueError(f"fp8 grouped matmul: {config} with {jnp.dtype(out_dtype).name} output needs {need} bytes "
                         f"of shared memory, over {SMEM_LIMIT}")
    if _swizzle(config.out_tile()[1], out_dtype) == 16:  # Mosaic GPU swizzles 32, 64 or 128 bytes, not 16
        raise ValueError(f"fp8 grouped matmul: {config} with {jnp.dtype(out_dtype).name} output has store-tile rows "
                         f"of {config.out_tile()[1] * itemsize} bytes, which no shared-memory swizzle takes (under "
                         f"32 bytes or a multiple of 32: swap_ab tile_m 8 or a multiple of {32 // itemsize})")
    if not isinstance(max_ctas, int) or max_ctas < 1:
        raise ValueError(f"fp8 grouped matmul: max_ctas must be an int >= 1, got {max_ctas!r}")
    return _run(a_q, a_scale, w_qs, w_ss, tile_group, config=config, out_dtype=jnp.dtype(out_dtype),
                interpret=bool(interpret), max_ctas=max_ctas)
