"""One host-to-device transfer per step: a step's small host arrays packed into one uint32 buffer on the host and
split back into them inside the compiled step.

Each transfer costs tens of microseconds of the serving loop's host time before the step can start (the loop waits
for its step when it reads the ids), so the engine's step (six arrays) and the speculative turn (eight) each send
one buffer. int32 and float32 arrays travel as their bit patterns; the layout (every array's shape and dtype) is a
static, hashable argument, so steps of one shape reuse one executable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("int32", "uint32", "float32")  # 4-byte dtypes: each element is one uint32 word

Layout = tuple[tuple[tuple[int, ...], str], ...]


def pack(*arrays) -> tuple[np.ndarray, Layout]:
    """(uint32 buffer holding `arrays` one after the other as bit patterns, their layout: ((shape, dtype), ...)).
    Each array must be int32, uint32 or float32 (numpy or anything `np.asarray` takes as such)."""
    parts, layout = [], []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype.name not in _DTYPES:
            raise TypeError(f"host_buffer.pack: array {i} is {a.dtype}; only {', '.join(_DTYPES)} travel as words")
        parts.append(np.ascontiguousarray(a).reshape(-1).view(np.uint32))
        layout.append((tuple(int(d) for d in a.shape), a.dtype.name))
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return buffer, tuple(layout)


def unpack(buffer, layout: Layout) -> list:
    """The arrays `pack` put in `buffer` (a jax or numpy uint32 vector), by their static `layout`: inside a jitted
    step, slices and bitcasts of the one transferred buffer."""
    sizes = [math.prod(shape) for shape, _ in layout]
    if buffer.shape != (sum(sizes),):
        raise ValueError(f"host_buffer.unpack: buffer of shape {tuple(buffer.shape)}, the layout holds {sum(sizes)} "
                         "words")
    out, start = [], 0
    for (shape, dtype), n in zip(layout, sizes):
        words = buffer[start:start + n]
        start += n
        if dtype != "uint32":
            words = jax.lax.bitcast_convert_type(words, jnp.dtype(dtype))
        out.append(words.reshape(shape))
    return out
