"""The step's collectives in one place: the real ones over the mesh axes, or local stand-ins of the same shapes.

Every collective the per-shard model issues goes through a `Collectives` object on the step context
(`glm_dsa.model.layers.StepContext.comm`), so that one switch changes all of them:

- `Collectives()` (the default): `jax.lax` over the mesh axes, inside `jax.shard_map`.
- `StandInCollectives(axis_sizes, rank)`: one device's share of a layout run on one device, outside any mesh
  (`glm_dsa.model.shard`). Each collective becomes a local op whose output has the shape the real one's has on
  that device, and costs about what moving the data locally costs: psum -> the local partial (identity);
  all_gather -> the local block repeated to the gathered shape; psum_scatter -> the local block's first slice;
  all_to_all -> the local blocks regrouped (split along one axis, concatenated along the other); axis_index -> the
  fixed `rank` (DCP rank 0 owns the most tokens: the slowest rank of a group). The values are not those of the
  mesh (random weights: speed, not numbers, is what a shard run measures).

Both record each call while the step is traced, when a list is attached (`record(...)`): its kind, the mesh axes,
the group size, the local input's shape and dtype, and the bytes of the local input and output. The stand-in
records what the real step issues on one device, call for call (tests/sharding/test_collectives.py checks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp

from .axes import DCP, TP


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective of a traced step: `kind` (psum, all_gather, psum_scatter, all_to_all), the mesh `axes`, the
    `group` size (devices taking part), the local input's `shape` and `dtype`, the bytes of the local input
    (`in_bytes`) and output (`out_bytes`) on one device, and the call's keywords (`options`: (name, value) pairs,
    e.g. (("axis", 1), ("tiled", True))), so that the call can be made again alone."""

    kind: str
    axes: tuple[str, ...]
    group: int
    shape: tuple[int, ...]
    dtype: str
    in_bytes: int
    out_bytes: int
    options: tuple = ()

    def replay(self, comm: "Collectives", x):
        """Make this call again on `x` through `comm` (e.g. alone, to count its cost apart from the step's)."""
        return getattr(comm, self.kind)(x, self.axes, **dict(self.options))


def _names(axes) -> tuple[str, ...]:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class Collectives:
    """The collectives over the mesh axes (`jax.lax`), for code running inside `jax.shard_map`. Hashable by
    identity; `record` attaches a list that receives a `CollectiveCall` per call while tracing."""

    _log: list = dataclasses.field(default_factory=list, repr=False)
    _on: list = dataclasses.field(default_factory=list, repr=False)  # a one-element switch (the object is frozen)

    @contextlib.contextmanager
    def record(self):
        """Collect the calls made while tracing inside this block: yields the list they are appended to."""
        self._log.clear()
        self._on.append(True)
        try:
            yield self._log
        finally:
            self._on.pop()

    def _note(self, kind, axes, x, out_shape, **options):
        if self._on:
            names = _names(axes)
            self._log.append(CollectiveCall(kind, names, self.axis_size(names), tuple(x.shape), str(x.dtype),
                                            _nbytes(x.shape, x.dtype), _nbytes(out_shape, x.dtype),
                                            tuple(sorted(options.items()))))

    # the mesh's view: overridden by the stand-in
    def axis_size(self, axes) -> int:
        """Devices along `axes` (a name or a tuple of names)."""
        return math.prod(jax.lax.axis_size(a) for a in _names(axes))

    def axis_index(self, axes):
        """This device's index along `axes` (a traced int32)."""
        return jax.lax.axis_index(axes)

    def psum(self, x, axes):
        """The sum of `x` over the devices along `axes`."""
        self._note("psum", axes, x, x.shape)
        return jax.lax.psum(x, axes)

    def all_gather(self, x, axes, *, axis: int = 0, tiled: bool = False):
        """The devices' `x` along `axes` concatenated on `axis` (tiled) or stacked on a new `axis`."""
        n = self.axis_size(axes)
        shape = list(x.shape)
        if tiled:
            shape[axis] *= n
        else:
            shape.insert(axis, n)
        self._note("all_gather", axes, x, shape, axis=axis, tiled=tiled)
        return self._all_gather(x, axes, axis, tiled)

    def _all_gather(self, x, axes, axis, tiled):
        return jax.lax.all_gather(x, axes, axis=axis, tiled=tiled)

    def psum_scatter(self, x, axes, *, scatter_dimension: int, tiled: bool = True):
        """The sum over `axes` of `x`, each device keeping its 1/N slice of `scatter_dimension` (tiled only)."""
        if not tiled:
            raise ValueError("psum_scatter: only tiled=True is used by the model")
        shape = list(x.shape)
        shape[scatter_dimension] //= self.axis_size(axes)
        self._note("psum_scatter", axes, x, shape, scatter_dimension=scatter_dimension, tiled=tiled)
        return self._psum_scatter(x, axes, scatter_dimension)

    def _psum_scatter(self, x, axes, dim):
        return jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)

    def all_to_all(self, x, axes, *, split_axis: int, concat_axis: int, tiled: bool = True):
        """Slice `split_axis` into N blocks, send block j to device j, concatenate the received blocks on
        `concat_axis` (tiled only)."""
        if not tiled:
            raise ValueError("all_to_all: only tiled=True is used by the model")
        n = self.axis_size(axes)
        shape = list(x.shape)
        shape[split_axis] //= n
        shape[concat_axis] *= n
        self._note("all_to_all", axes, x, shape, split_axis=split_axis, concat_axis=concat_axis, tiled=tiled)
        return self._all_to_all(x, axes, split_axis, concat_axis)

    def _all_to_all(self, x, axes, split_axis, concat_axis):
        return jax.lax.all_to_all(x, axes, split_axis=split_axis, concat_axis=concat_axis, tiled=True)


@dataclasses.dataclass(frozen=True, eq=False)
class StandInCollectives(Collectives):
    """One device's collectives of a layout, computed locally (see the module doc): `axis_sizes` is the layout's
    mesh shape ({'tp': TP // DCP, 'dcp': DCP}: `ParallelConfig.mesh_shape`), `rank` this device's index along
    each axis (default 0 everywhere)."""

    axis_sizes: dict = dataclasses.field(default_factory=lambda: {TP: 1, DCP: 1})
    rank: dict = dataclasses.field(default_factory=dict)

    def axis_size(self, axes) -> int:
        return math.prod(self.axis_sizes[a] for a in _names(axes))

    def axis_index(self, axes):
        # row-major over the named axes, as jax.lax.axis_index of a tuple of axes numbers the devices
        idx = 0
        for a in _names(axes):
            idx = idx * self.axis_sizes[a] + self.rank.get(a, 0)
        return jnp.int32(idx)

    def psum(self, x, axes):
        self._note("psum", axes, x, x.shape)
        return x  # the local partial stands for the sum: same shape, no cost beyond the real op's local part

    def _all_gather(self, x, axes, axis, tiled):
        n = self.axis_size(axes)
        if not tiled:
            return jnp.stack([x] * n, axis=axis)
        return jnp.concatenate([x] * n, axis=axis)  # the gathered shape, written once like the real output

    def _psum_scatter(self, x, axes, dim):
        n = self.axis_size(axes)
        return jax.lax.slice_in_dim(x, 0, x.shape[dim] // n, axis=dim)

    def _all_to_all(self, x, axes, split_axis, concat_axis):
        n = self.axis_size(axes)
        if split_axis == concat_axis:
            return x  # blocks exchanged in place: the shape is unchanged
        blocks = jnp.split(x, n, axis=split_axis)
        return jnp.concatenate(blocks, axis=concat_axis)
