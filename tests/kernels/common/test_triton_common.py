"""Shared Triton helpers (kernels/common/triton_common.py): byte reassembly, the 2-4 GiB check, the lowered-text
reader."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.common import triton_common as tc


def test_byte_run_reassembly_is_exact():
    """u8_to_f32 / u8_to_bf16 (reshape + 2-way split) and u8_words give back the little-endian values bit for bit;
    bytes_of is their inverse."""
    rng = np.random.default_rng(5)
    f32 = rng.normal(size=(8, 4)).astype(np.float32) * np.float32(1e-30)
    bf = jnp.asarray(rng.normal(size=(8, 64)), jnp.bfloat16)
    got32 = tc.u8_to_f32(jnp.asarray(f32.view(np.uint8)))
    gotbf = tc.u8_to_bf16(jax.lax.bitcast_convert_type(bf, jnp.uint8).reshape(8, 128))
    np.testing.assert_array_equal(np.asarray(got32).view(np.uint32), f32.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(gotbf, jnp.uint16)),
                                  np.asarray(jax.lax.bitcast_convert_type(bf, jnp.uint16)))
    words = tc.u8_words(jnp.asarray(f32.view(np.uint8)))
    np.testing.assert_array_equal(np.concatenate([np.asarray(w) for w in words], 1), f32.view(np.int32))
    back = tc.bytes_of(jnp.asarray(f32.view(np.int32)), 4).reshape(8, 16)
    np.testing.assert_array_equal(np.asarray(back), f32.view(np.uint8))


def test_check_addressable():
    s = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="my cache: a uint8 array of 2.44 GiB"):
        tc.check_addressable(s((4_000_000, 656), jnp.uint8), "my cache")
    for ok in (s((3_000_000, 656), jnp.uint8), s((7_000_000, 656), jnp.uint8), s((4_000_000, 576), jnp.bfloat16)):
        tc.check_addressable(ok, "cache")


def test_triton_calls_reads_name_and_grid():
    line = ('%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0) {backend_config = "", mhlo.backend_config = '
            '{debug = false, grid_x = 7 : i32, grid_y = 2 : i32, grid_z = 1 : i32, ir = "ML\\EFR, name = \\"x\\"", '
            'name = "moe_up", num_stages = 3 : i32, num_warps = 8 : i32}}')
    assert tc.triton_calls("module {\n" + line + "\n}") == [tc.TritonCall("moe_up", (7, 2, 1), 8, 3)]
    assert tc.triton_calls("stablehlo.add") == []
    with pytest.raises(ValueError, match="no grid or name"):
        tc.triton_calls("stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0) {}")
