"""The FP8 linear oracle (impl "xla"): both operands dequantised to float32, one float32 matmul
(docs/math.md §11)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common.fp8_formats import block_index, dequantize_weight_blocks, e4m3_to_f32, quantize_activation_blocks


def fp8_linear_xla(x, w_q, w_scale, *, form: str = "w8a16", n_offset=0, k_offset=0, w_layout: str = "nk"):
    """The reference: x [T, K] and the weight dequantised to float32 (W8A8: x quantised first), one float32
    matmul at highest precision; x.dtype [T, N]."""
    if w_layout == "kn":
        w = dequantize_weight_blocks(w_q, w_scale, k_offset, n_offset).T
        k_blocks = w_scale.shape[0]
    else:
        w = dequantize_weight_blocks(w_q, w_scale, n_offset, k_offset)
        k_blocks = w_scale.shape[1]
    if form == "w8a8":
        a_q, s_a = quantize_activation_blocks(x, k_offset, k_blocks)
        a = e4m3_to_f32(a_q) * jnp.take(s_a, block_index(x.shape[1], k_offset), axis=1)
    else:
        a = x.astype(jnp.float32)
    y = jnp.matmul(a, w.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def fp8_swiglu_xla(x, w_gate, w_up, gate_scale, up_scale, *, n_offset=0, k_offset=0, w_layout: str = "nk"):
    """The reference of the op "fp8_swiglu": silu(g) * u in float32 for g, u the W8A8 products of x with the gate
    and up weights (`fp8_linear_xla`, form "w8a8", over x read as float32), rounded once to x.dtype."""
    xf = x.astype(jnp.float32)
    g, u = (fp8_linear_xla(xf, w, s, form="w8a8", n_offset=n_offset, k_offset=k_offset, w_layout=w_layout)
            for w, s in ((w_gate, gate_scale), (w_up, up_scale)))
    return (g / (1.0 + jnp.exp(-g)) * u).astype(x.dtype)
