"""The tracer on the step context: records a step's intermediates (names and layouts in glm_dsa.debug.trace) without
the model's math knowing how they are gathered.

Every method is a no-op on an inactive tracer (`NO_TRACE`, the step's default): no op, no collective is added
to the step. An active tracer gathers each value to full width inside `shard_map` (the heads of every device,
each DCP rank's partials, the cache rows as written on their owning rank), so the recorded tensors are the
same on every device and can leave the shard_map replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import fp8_formats
from kernels.moe.tiles import routed_pairs
from sharding import DCP, TP, TP_AXES, dcp


class Tracer:
    """Records into `records` (a dict; None: inactive) under the key `prefix + name`."""

    def __init__(self, records: dict | None = None, prefix: str = ""):
        self.records = records
        self.prefix = prefix

    @property
    def active(self) -> bool:
        return self.records is not None

    def at(self, layer: int) -> Tracer:
        """The tracer of layer `layer`: names become `layers.{layer}.{name}`."""
        return Tracer(self.records, f"layers.{layer}.") if self.active else self

    def record(self, name: str, value) -> None:
        """Record `value` as it is (a tensor replicated over the mesh)."""
        if self.active:
            self.records[self.prefix + name] = value

    def heads(self, name: str, x, q_replicate: bool = False) -> None:
        """Record all heads of a per-head tensor (heads on axis 1): heads are split over TP_AXES, or over TP
        alone for the query-side tensors under QREP (each DCP rank holds its whole group's heads)."""
        if self.active:
            self.record(name, jax.lax.all_gather(x, TP if q_replicate else TP_AXES, axis=1, tiled=True))

    def cache_latents(self, mla_cache, slots, kv_lora_rank: int, rope_dim: int) -> None:
        """Record `attn.kv_norm` and `attn.k_pe` as the fused op wrote them: the rows at `slots` [T] (-1 on the
        ranks that do not own the token) read back from the owning rank's cache [slots, width], float32."""
        if not self.active:
            return
        row = mla_cache[jnp.maximum(slots, 0)]
        if row.dtype == jnp.uint8:  # fp8_ds_mla byte rows
            kv_row, pe_row = fp8_formats.dequantize_mla_rows(row, kv_lora_rank, rope_dim)
            row = jnp.concatenate([kv_row.astype(jnp.float32), pe_row.astype(jnp.float32)], axis=-1)
        row = jax.lax.psum(jnp.where((slots >= 0)[:, None], row.astype(jnp.float32), 0.0), DCP)
        self.record("attn.kv_norm", row[:, :kv_lora_rank])
        self.record("attn.k_pe", row[:, kv_lora_rank:])

    def positions(self, name: str, local_pos, n: int, interleave: int) -> None:
        """Record the global positions of this rank's local positions [T, K] (-1 = none), merged over the DCP
        ranks: each selected position is owned by exactly one rank."""
        if self.active:
            rank = jax.lax.axis_index(DCP)
            gpos = jnp.where(local_pos >= 0, dcp.global_position(local_pos, rank, n, interleave), -1)
            self.record(name, jax.lax.pmax(gpos, DCP))

    def dcp_partials(self, o, lse) -> None:
        """Record `dcp.partial_o` / `dcp.partial_lse`: every rank's partial over all heads, [N, T, H, .]."""
        if self.active:
            self.record("dcp.partial_o", jax.lax.all_gather(jax.lax.all_gather(o, TP, axis=1, tiled=True), DCP))
            self.record("dcp.partial_lse", jax.lax.all_gather(jax.lax.all_gather(lse, TP, axis=1, tiled=True), DCP))

    def dcp_merged(self, o, lse) -> None:
        """Record `dcp.merged_o` / `dcp.merged_lse`: the merged result of this rank's heads, gathered."""
        self.heads("dcp.merged_o", o)
        self.heads("dcp.merged_lse", lse)

    def experts(self, experts, weights, n_exp: int) -> None:
        """Record `moe.experts` / `moe.weights` [T, k] in a canonical order: by expert id. A padding row's
        sentinel (an id outside [0, n_exp): no expert) is recorded as -1, "none", as `attn.topk` records an unfilled
        entry, so the trace diff's set comparison skips it (two padding rows compare as equal empty sets)."""
        if self.active:
            experts = jnp.where(routed_pairs(experts, n_exp), experts, -1)
            order = jnp.argsort(experts, axis=1)
            self.record("moe.experts", jnp.take_along_axis(experts, order, axis=1))
            self.record("moe.weights", jnp.take_along_axis(weights, order, axis=1))


NO_TRACE = Tracer()  # the inactive tracer: every method returns at once
