"""Routed FP8 experts through tokamax's ragged dot: the MoE impl "tokamax" (docs/math.md §2 and §11).

tokamax (a library of Pallas kernels, `pip install 'glm-dsa[tokamax]'`) has a Mosaic GPU grouped GEMM for Hopper
that reads quantised weights through TMA in a warp-specialised pipeline. It reads GLM-5.2's TP = 1 expert stacks
(256 x 6144 x 2048 e4m3, 2**31+ elements each) faster than our Pallas Triton kernel from 8 rows to 128, and is
slower at a TP = 8 shard (256 x 6144 x 256) and at one row (BENCHMARKS.md, tokamax). The MoE's "auto" rule does
not take it: with it taken the engine's FP8 prefill ran several times slower (cause not found), so it runs when
named (`moe.routed_experts(impl="tokamax")`).

Arithmetic: W8A16 in float16, since that kernel dequantises each weight tile in registers and, with jax 0.11.2's
ptxas, Mosaic GPU converts e4m3 only to float16, not bf16. Per projection a [M, K] @ W^T with W[n, k] = w[n, k] *
s[n // 128, k // 128] (K-major e4m3 stacks, float32 128 x 128 block scales):
  a16 = f16(a * 2**-ea[m]), ea[m] = the exponent of row m's largest |a| (so |a16| <= 1: no float16 overflow);
  c16 = f16(s * 2**(RS - es)), es = the exponent of the stack's largest scale (so |w * c16| <= 448 * 2**RS);
  w16 = f16(f16(w) * c16) (e4m3 -> float16 is exact), one scale per output column and 128-wide K block;
  out = f32(f16(sum_k a16 * w16, accumulated in float32)) * 2**ea[m] * 2**(es - RS).
The powers of two are exact, so the result is the float16 rounding of the dot over (x, W) rescaled, without the
overflow of a plain float16 cast: the float16 inputs keep 11 bits against bf16's 8 and W8A8's e4m3 4. gate and
up run as two ragged dots over the pairs sorted by expert, h = silu(g) * u in float32, then down the same way,
and the pairs' outputs are weighted and summed per token in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..common.fp8_formats import FP8, WEIGHT_BLOCK
from .tiles import sort_pairs

RS = -5  # the largest column scale becomes 2**-5 at most: |w16| <= 14, |a16| <= 1 keeps the float16 sums in range


@dataclasses.dataclass(frozen=True)
class TokamaxMoEConfig:
    """Launch config of tokamax's Mosaic GPU ragged dot (its `Config` fields; the output tile is 64 columns, as
    the kernel requires for a 16-bit output, and K steps are one scale block). The default is the best of the
    configs tried on the GPU at both stack sizes (BENCHMARKS.md, tokamax): 16-row tiles, 4 stages."""
    block_m: int = 16
    num_stages: int = 4
    persistent: bool = True
    grid_minor_dim: str = "m"

    def __post_init__(self):
        if self.grid_minor_dim not in ("m", "n"):
            raise ValueError(f"TokamaxMoEConfig.grid_minor_dim must be 'm' or 'n', got {self.grid_minor_dim!r}")
        for name, multiple in (("block_m", 8), ("num_stages", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v % multiple:
                raise ValueError(f"TokamaxMoEConfig.{name} must be a positive multiple of {multiple}, got {v!r}")


@functools.cache
def missing() -> str | None:
    """None when tokamax (and qwix, its quantised-array type) import, else why not."""
    try:
        import qwix  # noqa: F401
        import tokamax  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency of tokamax's that fails at import
        return f"tokamax is not importable ({type(exc).__name__}: {exc}); pip install 'glm-dsa[tokamax]'"
    return None


def supports(x, experts, weights, wg, wu, wd, *, wg_scale=None, wu_scale=None, wd_scale=None, i_offset=0,
             w_layout: str = "kn", **_) -> str | None:
    """Why tokamax cannot take these experts (None when it can): FP8 K-major stacks of whole 128-blocks on a block
    boundary, tokamax importable."""
    if wg_scale is None or jnp.dtype(wg.dtype) != FP8:
        return f"the tokamax impl is for FP8 experts (float8_e4m3fn with block scales), got {wg.dtype}"
    if w_layout != "nk":
        return "the tokamax impl takes K-major FP8 stacks (w_layout 'nk')"
    if not (isinstance(i_offset, int) and i_offset == 0):
        return f"the tokamax impl needs the shard on a scale-block boundary (i_offset 0), got {i_offset!r}"
    _, i, d = wg.shape
    if d % WEIGHT_BLOCK or i % WEIGHT_BLOCK:
        return f"the tokamax impl needs hidden and expert widths that are multiples of 128, got {d} and {i}"
    return missing()


def _row_exponents(a):
    """Per row, e with max |a| <= 2**e (0 for an all-zero row), as float32 powers 2**e and 2**-e."""
    _, e = jnp.frexp(jnp.max(jnp.abs(a.astype(jnp.float32)), axis=-1, keepdims=True))
    return jnp.ldexp(jnp.float32(1), e), jnp.ldexp(jnp.float32(1), -e)


def column_scales(grid, n: int):
    """float16 [E, K / 128, N] column scales of a K-major stack's float32 grid [E, N / 128, K / 128], steered into
    float16's range (module docstring): the grid's scales times 2**(RS - es), and 2**(es - RS) to undo it."""
    _, es = jnp.frexp(jnp.max(grid))
    up = jnp.ldexp(jnp.float32(1), RS - es)
    cols = jnp.repeat(jnp.swapaxes(grid, 1, 2), WEIGHT_BLOCK, axis=2)[:, :, :n]
    return (cols * up).astype(jnp.float16), jnp.ldexp(jnp.float32(1), es - RS)


def tokamax_dot(config: TokamaxMoEConfig | None = None):
    """dot(a16 [M, K], w [E, N, K] e4m3, c16 [E, K / 128, N], sizes [E]) -> float16 [M, N]: tokamax's Mosaic GPU
    ragged dot over the rows grouped by expert (`sizes` rows each, in expert order)."""
    import qwix
    import tokamax
    # the op and its config by their module path: tokamax.ops.gpu, which re-exports them, imports jax_triton
    # for its Triton ops, which the GPU image lacks (the path is pinned with the version, pyproject's extra)
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu, pallas_mosaic_gpu_common as common

    cfg = config or TokamaxMoEConfig()
    minor = {"m": common.MatmulDimension.M, "n": common.MatmulDimension.N}[cfg.grid_minor_dim]
    op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=common.Config(
        block_m=cfg.block_m, block_n=64, block_k=WEIGHT_BLOCK, num_stages=cfg.num_stages, split_k=1,
        persistent=cfg.persistent, grid_minor_dim=minor, grid_tile_width=1))

    def dot(a16, w, c16, sizes):
        # the kernel reads the QArray's [E, K, N] values transposed back to [E, N, K]: XLA folds the two
        # transposes, so the stack is read as stored
        q = qwix.QArray(qvalue=jnp.swapaxes(w, 1, 2), scale=c16, qtype=w.dtype)
        return tokamax.ragged_dot(a16, q, sizes, preferred_element_type=jnp.float16, implementation=[op])
    return dot


def _project(a, w, grid, sizes, dot):
    """float32 [M, N]: rows `a` (grouped by expert) through the K-major FP8 stack (module docstring)."""
    up, down = _row_exponents(a)
    c16, undo = column_scales(grid, w.shape[1])
    a16 = (a.astype(jnp.float32) * down).astype(jnp.float16)
    return dot(a16, w, c16, sizes).astype(jnp.float32) * (up * undo)


def routed_experts(x, experts, weights, wg, wu, wd, *, wg_scale, wu_scale, wd_scale, i_offset=0,
                   w_layout: str = "nk", config: TokamaxMoEConfig | None = None, dot=None):
    """float32 [T, D]: the routed SwiGLU experts (`kernels.moe.routed_experts`) of FP8 K-major stacks (gate/up
    [E, I, D], down [E, D, I], grids [E, I / 128, D / 128] and [E, D / 128, I / 128]) through tokamax. `config`:
    its launch config; `dot`: the ragged dot to use instead of tokamax's (`tokamax_dot`'s signature; tests). The
    inputs are checked by `supports` where the registry dispatches here (`moe.routed_experts(impl="tokamax")`)."""
    dot = dot or tokamax_dot(config)
    t, k = experts.shape
    n_exp = wg.shape[0]
    key, order, sizes = sort_pairs(experts, n_exp)  # unrouted pairs (padding rows) after every expert
    token = order // k
    kept = (key[order] < n_exp)[:, None]
    # the kernel's row tiles are TMA copies of whole 8-row groups: pad the pairs to a multiple of 8 with zero
    # rows in the last expert's group (they compute zeros, dropped below). The unrouted pairs (an expert id
    # outside [0, n_exp): padding rows) go there too, as zero rows with their results dropped, not into no group:
    # tokamax's ragged dot has only been run with groups covering every row, and what it writes to rows past
    # them is not known. They cost rows of the last expert's GEMMs (impl "tokamax" runs only when named)
    pad = -(t * k) % 8
    xs = jnp.pad(jnp.where(kept, x[token], jnp.zeros((), x.dtype)), ((0, pad), (0, 0)))
    sizes = sizes.at[-1].add(t * k + pad - jnp.sum(sizes))
    g = _project(xs, wg, wg_scale, sizes, dot)
    u = _project(xs, wu, wu_scale, sizes, dot)
    y = _project(jax.nn.silu(g) * u, wd, wd_scale, sizes, dot)[: t * k]
    y = jnp.where(kept, y * weights.reshape(-1)[order][:, None].astype(jnp.float32), 0.0)
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y)
