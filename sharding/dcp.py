"""Decode context parallelism (docs/dcp.md; formulas in docs/math.md §6): who owns which token, and the collectives of one attention layer.

N ranks of a DCP group split the KV tokens by position in runs of I (`cp_kv_cache_interleave_size`):
position p lives on rank (p // I) % N at local position (p // (N I)) I + p % I. Every rank attends the
whole group's query heads over its local tokens; the partial results are merged by their LSE.
All functions here run per shard inside `shard_map` (axis `DCP`); with N = 1 they reduce to identities. Their
collectives go through `comm` (`sharding.collectives`: the mesh's by default, or one device's stand-ins).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.lse_merge import merge_partials

from .axes import DCP
from .collectives import Collectives


def owner(p, n: int, interleave: int = 1):
    """The DCP rank that stores position p."""
    return (p // interleave) % n


def local_position(p, n: int, interleave: int = 1):
    """Where position p sits among its owner's tokens."""
    return (p // (n * interleave)) * interleave + p % interleave


def global_position(lp, rank, n: int, interleave: int = 1):
    """Inverse of `local_position` on `rank`."""
    return (lp // interleave) * n * interleave + rank * interleave + lp % interleave


def local_length(length, rank, n: int, interleave: int = 1):
    """How many of the positions [0, length) rank `rank` owns."""
    base = (length // interleave // n) * interleave
    extra = length - base * n - rank * interleave
    extra = extra * (extra > 0)  # clip to [0, I] with plain arithmetic: works on ints, numpy and jax arrays
    return base + extra - (extra - interleave) * (extra > interleave)


def global_topk(scores, local_pos, rank, *, n: int, interleave: int, topk: int, comm: Collectives | None = None):
    """Exact top-k over the group from each rank's local top-k (scores [T, K], local positions [T, K], -1 = none).

    All-gathers (score, global position) candidates, sorts by (score desc, position asc) — the one tie rule
    — keeps the first `topk`, and returns the local positions of the entries this rank owns (others -1).
    Exact because a token of the global top-k is always in its owner's local top-k.
    """
    comm = comm or Collectives()
    big = jnp.iinfo(jnp.int32).max
    gpos = jnp.where(local_pos >= 0, global_position(local_pos, rank, n, interleave), big)
    scores = jnp.where(local_pos >= 0, scores, -jnp.inf)
    all_s = comm.all_gather(scores, DCP, axis=1, tiled=True)  # [T, N K]
    all_p = comm.all_gather(gpos, DCP, axis=1, tiled=True)
    neg, pos = jax.lax.sort((-all_s, all_p), dimension=1, num_keys=2)
    neg, pos = neg[:, :topk], pos[:, :topk]
    mine = (pos != big) & (owner(pos, n, interleave) == rank) & (neg != jnp.inf)
    return jnp.where(mine, local_position(pos, n, interleave), -1).astype(jnp.int32)


def gather_query_heads(q, comm: Collectives | None = None):
    """[T, H_local, D] -> [T, N H_local, D]: the group's heads, rank-major."""
    return (comm or Collectives()).all_gather(q, DCP, axis=1, tiled=True)


def merge_ag_rs(o, lse, comm: Collectives | None = None):
    """Partials over the group's heads (o [T, N h, R] float32, lse [T, N h]) -> this rank's heads merged.

    All-gather the lse, rescale the local o by exp(lse - L), reduce-scatter over heads.
    """
    comm = comm or Collectives()
    all_lse = comm.all_gather(lse, DCP, axis=0)  # [N, T, N h]
    _, total = merge_partials(jnp.zeros(all_lse.shape + (1,), jnp.float32), all_lse, axis=0)
    lse = jnp.where(jnp.isnan(lse) | (lse == jnp.inf), -jnp.inf, lse)
    w = jnp.where(jnp.isfinite(total) & jnp.isfinite(lse),
                  jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0)), 0.0)
    scaled = jnp.where(w[..., None] > 0, w[..., None] * o, 0.0)
    merged = comm.psum_scatter(scaled, DCP, scatter_dimension=1, tiled=True)
    n = comm.axis_size(DCP)
    h = lse.shape[1] // n
    my_total = jax.lax.dynamic_slice_in_dim(total, comm.axis_index(DCP) * h, h, axis=1)
    return merged, my_total


def merge_a2a(o, lse, comm: Collectives | None = None):
    """Same result with one all-to-all of (o | lse) packed together, merged locally in float32."""
    comm = comm or Collectives()
    n = comm.axis_size(DCP)
    t, nh, r = o.shape
    packed = jnp.concatenate([o.astype(jnp.float32), lse.astype(jnp.float32)[..., None]], axis=-1)
    packed = packed.reshape(t, n, nh // n, r + 1)
    recv = comm.all_to_all(packed, DCP, split_axis=1, concat_axis=1, tiled=True)  # [T, N(src), h, R+1]
    return merge_partials(recv[..., :r], recv[..., r], axis=1)
