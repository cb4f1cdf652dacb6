"""Pallas Mosaic GPU W8A8 grouped GEMM (SPEC §11): e4m3 x e4m3 wgmma with float32 accumulation, the 1 x 128
activation scales and 128 x 128 weight block scales applied per K block in registers.

out[r, n] = sum_kb (s_a[r, kb] * s_w[g, n // 128, kb]) * P_kb[r, n], P_kb the float32 wgmma partial of K block kb,
g the group of row r's tile (rows grouped by group in tiles of `tile_m`, `reference.group_layout`).

A persistent launch (one CTA per SM, at most `max_ctas`) walks the (row tile, column tile) pairs, column tile
fastest, so the CTAs in flight share a row tile in L2 and stream the group's weights; CTA c takes pairs c, c + n,
c + 2n, ... of the row tiles up to the last used one (`used_tiles`, a runtime count: the layouts' used tiles are a
prefix, and at decode about half of the worst-case tiles are unused). Each CTA runs ONE warp-specialised pipeline
(`plgpu.emit_pipeline_warp_specialized`) over all its tiles, grid (its tiles, K blocks), the first dimension a
runtime count: the producer warpgroup TMA-copies each step's e4m3 row tile, weight tile(s) and their scales into a
ring of `stages` buffers, its index maps reading the tile's group from tile_group, and runs ahead across tile
boundaries, so the next tile's first K blocks arrive while the consumers finish the current one and store it (a
pipeline per tile would fill and drain its ring every tile: with the down GEMM's 2 K blocks a tile at decode the
ring was never full). Each compute warpgroup, per K block, issues its wgmma into a fresh accumulator, waits for it,
and adds partial x (s_a * s_w) to its running float32 accumulators, the pipeline's carry (the promotion that keeps
fp8 wgmma's short accumulator to one block); the carry restarts from zeros at a tile's first K block and is stored
at its last. The two compute warpgroups interleave: one scales while the other's wgmma runs. The epilogue stores
bf16 (or float32) through shared memory by TMA, overlapping the next tile's loads.

Overlapped promotion (config.overlap, prefill layout): a step's wgmmas (k_step K blocks x m sub-tiles x column
blocks x split_n pieces) are issued as a chain, partial n promoted after wgmma n + 1 is issued (`wgmma_wait(1)`), so
the warpgroup's own wgmma covers each promotion but the step's last; the same partials in the same order, the same
bits (see the body for why the chain stays inside a step).

Unused tiles (group -1) are neither loaded nor stored: their output rows are undefined (never written; NaN under
the interpreter) and callers must not read them (the routed experts do not: `experts.routed_experts_w8a8`). A -1
tile before the last used one (a tile_group that is not a prefix; none of this package's layouts) is walked as
group 0 but not stored.

swap_ab (decode): the weight rows go on wgmma's M side (64 per compute warpgroup) and the few activation rows of
a group on its N side (8..256), so the tensor core is not 3/4 idle on a 16-row tile; the kernel writes out^T.

swiglu: two weight operands, gate and up, as stored (each [G, N, K]); a tile reads the same rows of both, and the
epilogue stores silu(gate) * up.

Scales travel with the tiles: the activation scales as s_a^T [K/128, M] (a tile's scales for one K block are one
contiguous run), the weight scales as [G, K/128, 32 N/128] with each scale repeated 32 times: every stage's
buffer of a TMA destination must start on a 128-byte boundary, so each stage's scale block is whole 128 bytes
(`scale_block_widths`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .config import BLOCK, SMEM_LIMIT, WGMMA_M, Fp8GemmConfig
from .reference import FP8

SM_COUNT = 132  # Hopper SXM (H100, H200)
TMA_SMEM_ALIGN = 128  # bytes: a TMA's shared-memory address must be a multiple of this
SCALE_REPEAT = TMA_SMEM_ALIGN // 4  # float32 copies of each weight scale: one stage's block is whole 128 bytes


def scale_block_widths(config: Fp8GemmConfig) -> tuple[int, int]:
    """float32 widths of one stage's activation-scale block and of each weight operand's scale block. Every
    stage's buffer must start on a TMA_SMEM_ALIGN boundary, so each block is a multiple of 128 bytes: the
    activation block covers tile_m scales rounded up to 32 (a decode tile of 8 rows reads 24 scales past it, from
    padding), a weight block SCALE_REPEAT copies of each of the operand's `operand_blocks` scales."""
    per = TMA_SMEM_ALIGN // 4
    return -(-config.tile_m // per) * per, SCALE_REPEAT * config.operand_blocks


def _tile_transforms(cols: int, dtype):
    """The tiled, swizzled shared-memory form of a tile of rows of `cols` elements (wgmma operands, store tiles);
    none for rows under 32 bytes (a decode store tile of 8 bf16 rows), which no swizzle takes."""
    bits = jnp.dtype(dtype).itemsize * 8
    if cols * bits < 32 * 8:
        return ()
    swizzle = plgpu.find_swizzle(cols * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _kernel(group_ref, used_ref, a_ref, sa_ref, *refs, config: Fp8GemmConfig, n_tiles: int, k_steps: int):
    cfg = config
    n_w = cfg.n_operands
    w_refs, sw_refs, o_ref = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w]
    wgs, n_sub, swap = cfg.compute_wgs, cfg.n_sub, cfg.swap_ab
    w_rows = cfg.operand_rows
    f32 = jnp.float32
    out_r, out_c = cfg.out_tile()
    e4m3 = _tile_transforms(BLOCK, FP8)
    sa_w, sw_w = scale_block_widths(cfg)
    kps, split = cfg.k_step, cfg.split_n  # K blocks a pipeline step; wgmmas a 64 x 128 output block is issued as
    k_cols = kps * BLOCK
    part_c = out_c // split  # columns of one partial and of one running accumulator piece

    # The CTA's walk: the (row tile, column tile) pairs lin = m_idx * n_tiles + n_idx below used * n_tiles (`used`
    # the row tiles up to the last one with a group, `used_tiles`: a runtime count), column tile fastest so the CTAs
    # in flight share a row tile; CTA `sm` takes lin = sm, sm + n_sm, sm + 2 n_sm, ... Its count is runtime data,
    # and the pipeline's grid takes it as such (a dynamic first grid dimension: the producer's and the consumers'
    # loops run to tiles x K blocks). A static grid over the worst case would step through (and, its index maps
    # clamped, load) the unused tiles, about half of them at decode; compacting the tile list would cost an XLA sort
    # per call, and the used tiles of `reference.group_layout` are a prefix already.
    sm, n_sm = lax.axis_index("sm"), lax.axis_size("sm")
    my_tiles = (used_ref[0] * n_tiles - sm + n_sm - 1) // n_sm  # >= 0: sm < n_sm

    def tile_of(t):
        """(row tile, column tile) of this CTA's t-th tile."""
        lin = sm + t * n_sm
        return lin // n_tiles, lin % n_tiles

    def group_of(t):
        """The weights' group of this CTA's t-th tile, 0 for a tile of group -1 (one before the last used row tile
        of a tile_group that is not a prefix: loaded and multiplied, never stored)."""
        return jnp.maximum(group_ref[tile_of(t)[0]], 0)

    def sw_block(n_idx):
        # the operand's first 128-row scale block of the tile, in units of sw_w (operand_blocks blocks of 32)
        return (n_idx * w_rows // BLOCK) // cfg.operand_blocks

    def make_pipeline(body, compute_context, grid):
        # a (rows) tile [tile_m, 128 k_step], each weight operand's tile [operand_rows, 128 k_step] of group g, s_a^T
        # runs [k_step, sa_w] from the tile's first row (an element offset: sa_w may pass tile_m), each operand's
        # s_w runs [k_step, sw_w]; each index map reads the tile's group from tile_group (k: the step, k_step
        # K blocks)
        def a_map(t, k):
            return tile_of(t)[0], k

        def w_map(t, k):
            return group_of(t), tile_of(t)[1], k

        def sa_map(t, k):
            return k, tile_of(t)[0] * cfg.tile_m

        def sw_map(t, k):
            return group_of(t), k, sw_block(tile_of(t)[1])

        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=grid,
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cfg.tile_m, k_cols), a_map, transforms=e4m3, memory_space=plgpu.SMEM),
                *[plgpu.BlockSpec((None, w_rows, k_cols), w_map, transforms=e4m3, memory_space=plgpu.SMEM)
                  for _ in range(n_w)],
                plgpu.BlockSpec((kps, pl.Element(sa_w)), sa_map, memory_space=plgpu.SMEM),
                *[plgpu.BlockSpec((None, kps, sw_w), sw_map, memory_space=plgpu.SMEM) for _ in range(n_w)],
            ],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=cfg.stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731  (the allocations depend on neither the body nor the grid's size)
    gmem = (a_ref, *w_refs, sa_ref, *sw_refs)

    @functools.partial(
        pl.run_scoped,
        allocs=make_pipeline(ignore, ignore, (my_tiles, k_steps)).get_allocations(*gmem),
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
            cols = n_idx * BLOCK if cfg.swiglu else n_idx * cfg.tile_n + s * BLOCK
            return o_ref.at[pl.ds(m_idx * cfg.tile_m + wg * wg_rows + i * WGMMA_M, WGMMA_M), pl.ds(cols, BLOCK)]

        def store(pieces, window):
            """One store tile from its `split` column pieces (each 64 x part_c)."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store (of this tile or the last) has read it
            if split == 1:
                out_smem[wg] = pieces[0].astype(out_smem.dtype)
            else:
                for h, piece in enumerate(pieces):
                    out_smem[wg, :, pl.ds(h * part_c, part_c)] = piece.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], window)

        def store_all(accs, m_idx, n_idx):
            # accs[(i n_sub + s) split + h]: m sub-tile i, wgmma s (column block, or the gate / up operand), piece h
            def pieces(i, s):
                return accs[(i * n_sub + s) * split:(i * n_sub + s + 1) * split]

            for i in range(cfg.m_sub):
                if cfg.swiglu:  # the gate accumulator, then the up one: silu(gate) * up
                    store([gate / (1.0 + jnp.exp(-gate)) * up for gate, up in zip(pieces(i, 0), pieces(i, 1))],
                          out_window(m_idx, n_idx, i, 0))
                else:
                    for s in range(n_sub):
                        store(pieces(i, s), out_window(m_idx, n_idx, i, s))

        def zeros():
            return tuple(plgpu.layout_cast(jnp.zeros((out_r, part_c), f32), plgpu.Layout.WGMMA)
                         for _ in range(cfg.m_sub * n_sub * split))

        def compute_context(run):
            run(zeros())  # the carry is reset at each tile's first K block and stored at its last, in the body

        def body(idx, a_smem, *rest):
            t, k = idx
            w_smems, sa_smem, sw_smems, carry = rest[:n_w], rest[n_w], rest[n_w + 1:2 * n_w + 1], rest[-1]
            # a tile's first K block starts from zeros (as the per-tile pipeline's fresh carry did: 0 + partial x
            # scale, the same float32 bits); a uniform branch, the K block being the same for the whole CTA
            accs = lax.cond(k == 0, zeros, lambda: carry)

            if swap:
                new = list(accs)
                sa = plgpu.load(sa_smem.at[0, pl.ds(0, cfg.tile_m)], layout=plgpu.Layout.WGMMA.reduce(0),
                                optimized=False)
                for s in range(n_sub):  # one wgmma per weight operand: 64 weight rows x tile_m
                    def mma(acc_ref, s=s):
                        plgpu.wgmma(acc_ref, w_smems[s].at[my_rows(0)], a_smem.transpose((1, 0)))
                        return acc_ref[...]

                    part = pl.run_scoped(mma, plgpu.ACC((out_r, out_c), f32))
                    scale = lax.broadcast_in_dim(sa * sw_smems[s][0, 0], (out_r, out_c), [1])
                    new[s] = accs[s] + part * scale
                return finish(t, k, tuple(new))

            # The step's wgmmas, in promotion order: K block kk of the step, m sub-tile i, wgmma s (a 128-row weight
            # block of the tile, or the gate / up operand), column piece h; each a 64 x part_c partial promoted
            # into running piece (i n_sub + s) split + h. Each running piece takes its K blocks in order, so the
            # float32 sums are those of one K block a step.
            jobs = [(kk, i, s, h) for kk in range(kps) for i in range(cfg.m_sub) for s in range(n_sub)
                    for h in range(split)]
            sas = {(kk, i): plgpu.load(sa_smem.at[kk, my_rows(i)], layout=plgpu.Layout.WGMMA.reduce(1),
                                       optimized=False)
                   for kk in range(kps) for i in range(cfg.m_sub)}

            def operand(s):
                """(weight operand, 128-row block inside the operand's tile) of wgmma s."""
                return (s, 0) if cfg.swiglu else (0, s)

            sws = {(kk, s): sw_smems[operand(s)[0]][kk, operand(s)[1] * SCALE_REPEAT]
                   for kk in range(kps) for s in range(n_sub)}

            def issue(job, acc_ref):
                kk, i, s, h = job
                j, b = operand(s)
                rows = pl.ds(b * BLOCK + h * part_c, part_c)
                if kps == 1:
                    a_tile, w_tile = a_smem.at[my_rows(i)], w_smems[j].at[rows]
                else:
                    cols = pl.ds(kk * BLOCK, BLOCK)
                    a_tile, w_tile = a_smem.at[my_rows(i), cols], w_smems[j].at[rows, cols]
                plgpu.wgmma(acc_ref, a_tile, w_tile.transpose((1, 0)))

            def promote(vals, job, part):
                """vals (a list of the running pieces) with `part`, the partial of `job`, promoted into its piece."""
                kk, i, s, h = job
                scale = lax.broadcast_in_dim(sas[kk, i] * sws[kk, s], (out_r, part_c), [0])
                r = (i * n_sub + s) * split + h
                vals[r] = vals[r] + part * scale

            new = list(accs)
            if not cfg.overlap:
                # each wgmma into a fresh accumulator, waited for (the scope's end) and promoted before the next:
                # the tensor core idles during the promotion unless the other warpgroup's wgmma covers it
                for job in jobs:
                    def mma(acc_ref, job=job):
                        issue(job, acc_ref)
                        return acc_ref[...]

                    promote(new, job, pl.run_scoped(mma, plgpu.ACC((out_r, part_c), f32)))
            else:
                # The chain: wgmma n into a fresh partial; once wgmma n + 1 is issued, wait until it alone is in
                # flight (wgmma_wait 1: wgmma n done) and promote partial n while the tensor core runs n + 1; the
                # last one waits for the tensor core (wait 0), so the step's shared memory is released at its end as
                # without overlap. Partial n is the accumulator of a scope opened just before wgmma n and nested in
                # partial n - 1's (a scope's end waits for every wgmma: all of them end together, after the last
                # promotion), so its zeroed registers live from its wgmma to its promotion: two partials at a time.
                # (Two accumulators zeroed and reused in turn would be the same registers, but the interpreter does
                # not take a store into an accumulator; one scope of all the chain's partials would zero them all
                # at its start, every one live from there.)
                # Why a chain inside a step rather than carrying a wgmma in flight into the next step (the pipeline's
                # delay_release, which would overlap every promotion): an in-flight accumulator would cross the
                # loop's back edge and the tile boundary's branches (the reset at a tile's first K block, the store
                # at its last: its partial promoted there, a step late), where ptxas serialises wgmmas whose
                # accumulator registers it cannot prove untouched, and delay_release holds every slot a step longer
                # (one stage fewer in flight at the same shared memory). The chain keeps the release, the reset and
                # the store as they are; the promotion left uncovered per step (1 of 2 with k_step 2 or split_n 2,
                # 1 of 4 with both or with SwiGLU's split_n 2) is what the other warpgroup's wgmmas cover.
                def chain(n, prev, vals):
                    def scope(part_ref):
                        issue(jobs[n], part_ref)
                        out = list(vals)
                        if prev is not None:
                            promote(out, jobs[n - 1], plgpu.wgmma_accumulator_load(prev, wait_n=1))
                        if n + 1 < len(jobs):
                            return chain(n + 1, part_ref, out)
                        promote(out, jobs[n], plgpu.wgmma_accumulator_load(part_ref, wait_n=0))
                        return tuple(out)  # the values promoted in the scope leave it as its result

                    return pl.run_scoped(scope, plgpu.ACC((out_r, part_c), f32))

                new = list(chain(0, None, tuple(new)))
            return finish(t, k, tuple(new))

        def finish(t, k, new):
            # the tile's last K block: store it (the stores of tile t overlap the producer's loads of tile t + 1,
            # already in the ring); a tile of group -1 is not stored (its rows are the caller's to ignore)
            @pl.when(k == k_steps - 1)
            def _last():
                m_idx, n_idx = tile_of(t)

                @pl.when(group_ref[m_idx] >= 0)
                def _store():
                    store_all(new, m_idx, n_idx)

            return new

        make_pipeline(body, compute_context, (my_tiles, k_steps))(*gmem, allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def used_tiles(tile_group):
    """int32 [1]: the number of row tiles up to the last one with a group (0 when none has): the bound of the
    kernel's walk. With `reference.group_layout`'s tiles (the routed experts', `experts.pair_layout`), where the used
    tiles are a prefix, it is the count of used tiles; a tile of group -1 before the last used one is computed (as
    group 0) but not stored."""
    idx = jnp.arange(1, tile_group.shape[0] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(tile_group >= 0, idx, 0), initial=0, keepdims=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret", "max_ctas"))
def _run(a_q, a_scale, w_qs, w_scales, tile_group, *, config, out_dtype, interpret, max_ctas):
    m, k = a_q.shape
    g, n, _ = w_qs[0].shape
    kb = k // BLOCK
    if kb % config.k_step:  # k_step 2 and odd K blocks: one zero block more (a zero partial, scaled by 1: + 0.0)
        pad = config.k_step - kb % config.k_step
        a_q, a_scale = jnp.pad(a_q, ((0, 0), (0, pad * BLOCK))), jnp.pad(a_scale, ((0, 0), (0, pad)),
                                                                          constant_values=1.0)
        w_qs = tuple(jnp.pad(w, ((0, 0), (0, 0), (0, pad * BLOCK))) for w in w_qs)
        w_scales = tuple(jnp.pad(s, ((0, 0), (0, 0), (0, pad)), constant_values=1.0) for s in w_scales)
        kb += pad
    m_tiles, n_tiles = m // config.tile_m, n // config.operand_rows
    sa_w, _ = scale_block_widths(config)
    # [KB, M + pad]: the last tile's block of sa_w scales stays inside the array
    sa_t = jnp.pad(a_scale.astype(jnp.float32).T, ((0, 0), (0, sa_w - config.tile_m)), constant_values=1.0)
    sws = [jnp.repeat(jnp.swapaxes(s.astype(jnp.float32), 1, 2), SCALE_REPEAT, axis=2)  # [G, KB, 32 NB]
           for s in w_scales]
    out_shape = (n, m) if config.swap_ab else (m, n)
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, n_tiles=n_tiles, k_steps=kb // config.k_step),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(max(1, min(max_ctas, m_tiles * n_tiles)),),
        grid_names=("sm",),
        num_threads=config.compute_wgs + 1,
        thread_name="wg",
        # unwritten memory reads NaN under the interpreter: rows the kernel does not store show as such in tests
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )
    tile_group = tile_group.astype(jnp.int32)
    out = kernel(tile_group, used_tiles(tile_group), a_q, sa_t, *w_qs, *sws)
    return out.T if config.swap_ab else out


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
    t (of config.tile_m rows) uses group tile_group[t]'s weights; where that is -1 the kernel stores nothing and
    the tile's rows are undefined (never written: NaN under the interpreter), unlike the xla form's zeros: the
    caller must not read them. A used tile's padding rows (zero rows of a_q) are stored, as zeros.
    interpret: run under the Pallas Mosaic GPU interpreter (CPU tests). max_ctas: the most CTAs launched (one per
    SM by default); each walks its share of the tiles in one pipeline (tests take a few, so that every CTA walks
    many tiles)."""
    w_qs, w_ss = check_operands(a_q, a_scale, w_q, w_scale, tile_group, config)
    need = config.smem_bytes(jnp.dtype(out_dtype).itemsize)
    if need > SMEM_LIMIT:
        raise ValueError(f"fp8 grouped matmul: {config} with {jnp.dtype(out_dtype).name} output needs {need} bytes "
                         f"of shared memory, over {SMEM_LIMIT}")
    if not isinstance(max_ctas, int) or max_ctas < 1:
        raise ValueError(f"fp8 grouped matmul: max_ctas must be an int >= 1, got {max_ctas!r}")
    return _run(a_q, a_scale, w_qs, w_ss, tile_group, config=config, out_dtype=jnp.dtype(out_dtype),
                interpret=bool(interpret), max_ctas=max_ctas)
