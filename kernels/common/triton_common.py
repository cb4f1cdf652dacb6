"""Helpers shared by the Pallas Triton kernels (sparse MLA, indexer, MoE, fused norm + RoPE).

In-kernel: row gathers, dots, column ranges, little-endian byte helpers, the row index of masked stores.
Host side: the 2-4 GiB uint8 addressing check, and (for CPU tests) the lowering to Triton IR without a GPU
and a reader of the kernels' names and grids in that text. Every Triton-specific line lives under `kernels/`
(the Triton backend is deprecated in jax 0.11); the FP8 value rules live in `kernels.common.fp8_formats`.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from . import fp8_formats

# Row index given to masked stores: out of range, so the interpreter (which cannot discharge masked stores)
# drops them too.
MASKED_ROW = 2**30


def is_pow2(v) -> bool:
    """Whether `v` is an int power of two (>= 1): launch-config fields that size Triton tiles must be."""
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def with_options(cfg, options: dict, op: str):
    """The frozen launch config `cfg` with fields replaced by `options`; a name that is not a field of it is a
    ValueError naming the op, the unknown names and the known ones."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = set(options) - fields
    if unknown:
        raise ValueError(f"{op} triton: unknown options {sorted(unknown)} (known: {sorted(fields)})")
    return dataclasses.replace(cfg, **options)


def check_addressable(x, what: str) -> None:
    """Refuse a 1-byte array of more than 2**31 elements and at most 4 GiB. Pallas Triton addresses an array of
    at most 4 GiB with 32-bit element offsets, which Triton adds to the pointer as signed: past 2**31 they read
    and write before the buffer, silently. (Larger arrays get 64-bit offsets; 2- and 4-byte arrays of at most
    4 GiB stay under 2**31 elements.)"""
    if jnp.dtype(x.dtype).itemsize == 1 and 2**31 < x.size <= 2**32:
        raise ValueError(f"{what}: a uint8 array of {x.size / 2**30:.2f} GiB ({x.shape}) is misaddressed by the Pallas "
                         "Triton kernels (32-bit signed offsets between 2 and 4 GiB); keep each layer's FP8 cache "
                         "under 2 GiB (fewer pages) or above 4 GiB")


# ------------------------------------------------------------------------------------------- in-kernel

def gather(ref, rows, cols, valid, interpret):
    """ref[rows[:, None], cols[None, :]] ([len(rows), len(cols)]), zero where not `valid` (rows not read)."""
    shape = (rows.shape[0], cols.shape[0])
    if interpret:  # the interpreter cannot discharge masked gathers
        x = ref[rows[:, None], cols[None, :]]
        return jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=jnp.broadcast_to(valid[:, None], shape), other=0)


def dot(a, b, trans_b=False):
    """float32 accumulation; float32 operands exactly (IEEE, not TF32): the tiny test models are float32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def div_rn(a, b, interpret: bool):
    """IEEE float32 a / b, b broadcast to a's shape (Triton's `/` is div.full.f32, ~2 ulp; XLA turns
    A / broadcast(b) into A * 1/b): the quotient `kernels.common.fp8_formats.exact_div` computes, for kernels that
    quantise bit for bit as the jnp references do."""
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape)
    if interpret:
        return fp8_formats.exact_div(a, b)
    [out] = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def col_range(start, size, stride=1):
    """int32 [size]: start, start + stride, ..."""
    return start + stride * jax.lax.iota(jnp.int32, size)


def u8_words(b):
    """uint8 [N, 4 n] (little-endian words) -> list of n int32 [N, 1] words."""
    n = b.shape[1] // 4
    x = b.astype(jnp.int32)
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    shifted = x << (8 * (col % 4))
    return [jnp.sum(jnp.where(col // 4 == g, shifted, 0), axis=1, keepdims=True) for g in range(n)]


def u8_pairs_to_bf16(lo, hi):
    """Low and high bytes (same shape) -> the bfloat16 they spell."""
    bits = (lo.astype(jnp.int32) | (hi.astype(jnp.int32) << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def unpair(b):
    """[N, 2 m] -> ([N, m] even columns, [N, m] odd columns): a reshape and Triton's 2-way split."""
    return jax.lax.unstack(b.reshape(b.shape[0], b.shape[1] // 2, 2), axis=2)


def u8_to_bf16(b):
    """uint8 [N, 2 n] (n little-endian bfloat16, one contiguous byte run per row) -> bfloat16 [N, n]."""
    return u8_pairs_to_bf16(*unpair(b))


def u8_to_f32(b):
    """uint8 [N, 4 n] (n little-endian float32, one contiguous byte run per row) -> float32 [N, n]."""
    lo, hi = unpair(b)
    h_lo, h_hi = unpair(lo.astype(jnp.int32) | (hi.astype(jnp.int32) << 8))  # 16-bit halves
    return jax.lax.bitcast_convert_type(h_lo | (h_hi << 16), jnp.float32)


def bytes_of(bits, nbytes: int):
    """int32 bits [...] -> uint8 [..., nbytes] little-endian."""
    shift = 8 * jax.lax.broadcasted_iota(jnp.int32, (1,) * bits.ndim + (nbytes,), bits.ndim)
    return ((bits[..., None] >> shift) & 0xFF).astype(jnp.uint8)


# ------------------------------------------------------------------------------------------- CPU checks

def lower_for_gpu(fn, *args, compute_capability: int = 90):
    """Lower `fn(*args)` (args may be ShapeDtypeStructs) to StableHLO for CUDA on a machine with no GPU:
    runs the Pallas -> Triton IR lowering of every kernel inside (not Triton's own compiler). A check for
    CPU CI that the kernels lower at production shapes. Returns the lowered text."""
    import types
    from unittest import mock

    from jax._src.pallas.triton import pallas_call_registration as reg

    info = types.SimpleNamespace(compute_capability=compute_capability)
    with mock.patch.object(reg.gpu_info_lib, "get_gpu_info", lambda *a, **k: info):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Pallas Triton kernel launch in lowered text: its name, grid (x, y, z), warps and stages."""
    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int


_GRID = re.compile(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32")
_LAUNCH = re.compile(r'name = "([^"]*)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def triton_calls(text: str) -> list[TritonCall]:
    """The Triton kernel launches (`__gpu$xla.gpu.triton` custom calls) of `lower_for_gpu`'s text, in order.
    The serialised Triton IR between the grid and the name is skipped (it is bytes, not text)."""
    calls = []
    for line in text.splitlines():
        if "@__gpu$xla.gpu.triton" not in line:
            continue
        grid = _GRID.search(line)
        ir_end = line.rfind('", name = "')
        launch = _LAUNCH.search(line, ir_end + 1) if ir_end >= 0 else None
        if grid is None or launch is None:
            raise ValueError(f"triton_calls: no grid or name in the custom call {line[:200]!r}...")
        calls.append(TritonCall(launch.group(1), tuple(int(g) for g in grid.groups()), int(launch.group(3)),
                                int(launch.group(2))))
    return calls
