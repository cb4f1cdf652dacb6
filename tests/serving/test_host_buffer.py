"""`glm_dsa.serving.host_buffer`: a step's host arrays packed into one uint32 buffer come back bit for bit, inside a
jitted function and outside one (the oracle: the arrays themselves), whatever their values; anything that is not a
4-byte word is refused."""

import chex
import jax
import numpy as np
import pytest

from glm_dsa.serving import host_buffer


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_round_trip_is_bit_exact(jit):
    rng = np.random.default_rng(0)
    arrays = (rng.integers(-2**31, 2**31 - 1, (4, 7), dtype=np.int32),
              np.zeros(0, np.int32),  # an empty part (no table resets, say)
              rng.integers(0, 2**32 - 1, (5, 3), dtype=np.uint32),
              np.array([[0.0, -0.0, np.inf], [-np.inf, np.nan, 1e-45]], np.float32),
              np.arange(6, dtype=np.int32))
    packed, layout = host_buffer.pack(*arrays)
    assert packed.dtype == np.uint32 and packed.shape == (sum(a.size for a in arrays),)
    assert layout == (((4, 7), "int32"), ((0,), "int32"), ((5, 3), "uint32"), ((2, 3), "float32"), ((6,), "int32"))
    unpack = jax.jit(host_buffer.unpack, static_argnums=1) if jit else host_buffer.unpack
    got = list(unpack(packed, layout))
    chex.assert_trees_all_equal_shapes_and_dtypes(got, list(arrays))
    # NaN and -0.0 by their bits
    chex.assert_trees_all_equal([np.asarray(g).view(np.uint32) for g in got], [a.view(np.uint32) for a in arrays])


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="array 1 is float64"):
        host_buffer.pack(np.zeros(2, np.int32), np.zeros(2, np.float64))
    packed, layout = host_buffer.pack(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="buffer of shape \\(2,\\), the layout holds 3 words"):
        host_buffer.unpack(packed[:2], layout)
