"""Per-layer activation dumps and a diff that names the first divergence, for cross-framework debugging.

Every tensor is tokens-major for one sequence, with heads as an explicit axis and rope dims in the
interleaved order of docs/math.md §2 (pairs (x[2i], x[2i+1])). Names, in model order within a layer:

| name (prefix `layers.{L}.`) | shape | what |
|---|---|---|
| `attn.q_norm` | [T, q_lora_rank] | q latent after q_a_layernorm |
| `attn.kv_norm` | [T, kv_lora_rank] | kv latent after kv_a_layernorm, as written to the MLA cache |
| `attn.k_pe` | [T, qk_rope_head_dim] | the shared rope key after RoPE, as written to the cache |
| `attn.q_pe` | [T, H, qk_rope_head_dim] | rope part of the queries after RoPE |
| `attn.topk` | [T, K] | positions the layer attends to (indexer top-k; shared layers reuse it); -1 = none |
| `dcp.partial_o` | [N, T, H, kv_lora_rank] | DCP only: each rank's partial attention over its own tokens |
| `dcp.partial_lse` | [N, T, H] | DCP only: each rank's partial log-sum-exp |
| `dcp.merged_o` / `dcp.merged_lse` | [T, H, kv_lora_rank] / [T, H] | DCP only: after the LSE merge |
| `attn.out` | [T, H, v_head_dim] | attention output per head, before o_proj |
| `moe.experts` / `moe.weights` | [T, k] | MoE layers: chosen experts (ascending id; -1 = none) and their weights |
| `residual` | [T, hidden] | the residual stream after the layer |

`attn.topk` rows are compared as sets (Jaccard overlap): the order within a top-k is not part of the math.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from kernels import registry
from sharding import ParallelConfig

from ..model.config import GlmDsaConfig
from ..model.layers import StepBatch, StepContext
from ..model.options import StepOptions, resolve_options
from ..model.step import fp8_paths, model_graphdef, prefill_inputs, resolve_parallel, run_sharded
from ..model.taps import Tracer

ORDER = ["attn.q_norm", "attn.kv_norm", "attn.k_pe", "attn.q_pe", "attn.topk", "dcp.partial_o", "dcp.partial_lse",
         "dcp.merged_o", "dcp.merged_lse", "attn.out", "moe.experts", "moe.weights", "residual"]
SET_VALUED = ("attn.topk", "moe.experts")


def traced_step(params, caches, batch: StepBatch, *, config: GlmDsaConfig, parallel: ParallelConfig | None = None,
                impl: str | None = None, options: StepOptions | None = None):
    """`glm_dsa.step` with an active tracer: (logits, updated caches, every layer's intermediates by name). The
    tracer only adds gathers of values the step computes anyway, with one difference: under DCP all query rows
    attend in one round (their partials are recorded whole), so the logits are `step`'s bit for bit when the
    rows fit in one `StepOptions.dcp_row_chunk`."""
    options = resolve_options(impl, options)
    par = resolve_parallel(parallel, config)
    graphdef = model_graphdef(config, fp8_paths(params))

    def body(params, caches, batch):
        records: dict = {}
        ctx = StepContext(config, block_size=caches["mla"][0].shape[1], parallel=par, options=options,
                          tracer=Tracer(records))
        logits, caches = nnx.merge(graphdef, params)(caches, batch, ctx)
        return logits, caches, records

    # every record is gathered to full width inside, so all of them leave replicated; compiled as one program (run
    # eagerly, the step dispatches its ops one by one over the mesh). The kernels' rules decide as in `step` (in
    # batch-invariant mode: for the step's kind, named by its padded rows)
    with registry.batch_invariant(options.batch_invariant, rows=batch.token_ids.shape[0],
                                  prompt_rows=options.invariant_prompt_rows,
                                  decode_rows=options.invariant_decode_rows):
        return jax.jit(lambda p, c, b: run_sharded(body, p, c, b, par, lambda cspecs: (P(), cspecs, P()), config))(
            params, caches, batch)


def trace(params, token_ids, *, config: GlmDsaConfig, parallel: ParallelConfig | None = None, impl: str | None = None,
          options: StepOptions | None = None, block_size: int = 16,
          kv_cache_dtype: str = "auto") -> dict[str, jax.Array]:
    """Run one sequence (int [T]) through the model and return every layer's intermediates by name."""
    par = resolve_parallel(parallel, config)
    caches, batch = prefill_inputs(params, jnp.asarray(token_ids, jnp.int32).reshape(1, -1), config=config,
                                   parallel=par, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    return traced_step(params, caches, batch, config=config, parallel=par, impl=impl, options=options)[2]


def select_layers(taps: dict, layers) -> dict:
    if layers is None:
        return taps
    keep = {int(x) for x in layers}
    return {k: v for k, v in taps.items() if int(k.split(".")[1]) in keep}


def sort_key(name: str):
    m = re.match(r"layers\.(\d+)\.(.+)$", name)
    if not m:
        return (1 << 30, 0, name)
    sub = m.group(2)
    return (int(m.group(1)), ORDER.index(sub) if sub in ORDER else len(ORDER), sub)


def save_trace(taps: dict, path, metadata: dict | None = None) -> None:
    """Write a trace as safetensors (float32 / int32 numpy), names sorted in model order."""
    from safetensors.numpy import save_file
    arrays = {}
    for k in sorted(taps, key=sort_key):
        a = np.asarray(taps[k])
        arrays[k] = np.ascontiguousarray(a.astype(np.int32 if np.issubdtype(a.dtype, np.integer) else np.float32))
    save_file(arrays, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})


def load_trace(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(path))


@dataclasses.dataclass
class DiffRow:
    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    jaccard: float | None  # set-valued tensors: the mean per-row overlap
    ok: bool


def _jaccard_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = []
    for ra, rb in zip(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)):
        sa, sb = set(ra[ra >= 0].tolist()), set(rb[rb >= 0].tolist())
        out.append(1.0 if not sa and not sb else len(sa & sb) / len(sa | sb))
    return np.asarray(out)


def diff_traces(a: dict, b: dict, *, rtol: float = 1e-3, atol: float = 1e-4) -> tuple[list[DiffRow], str | None]:
    """Compare two traces name by name: numeric tensors by max abs/rel error (ok if |a-b| <= atol + rtol|b|
    everywhere), set-valued ones (top-k positions, chosen experts) by per-row Jaccard overlap (ok if all 1).
    Returns the rows in model order and the name of the first tensor that is not ok (None if all agree)."""
    rows = []
    for name in sorted(set(a) & set(b), key=sort_key):
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if x.shape != y.shape and not name.endswith(SET_VALUED):
            rows.append(DiffRow(name, x.shape, float("inf"), float("inf"), None, False))
            continue
        if name.endswith(SET_VALUED):
            j = _jaccard_rows(x, y)
            rows.append(DiffRow(name, x.shape, float("nan"), float("nan"), float(j.mean()), bool((j == 1).all())))
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf: handled as `same_inf` below
            err = np.abs(x64 - y64)
        finite = np.isfinite(x64) & np.isfinite(y64)
        same_inf = (x64 == y64)  # matching infinities (an empty partial's -inf lse) agree
        bad = ~(same_inf | (finite & (err <= atol + rtol * np.abs(y64))))
        e = np.where(same_inf, 0.0, err)
        rel = e / np.maximum(np.abs(y64), 1e-30)
        rows.append(DiffRow(name, x.shape, float(np.nanmax(e)) if e.size else 0.0,
                            float(np.nanmax(np.where(same_inf, 0.0, rel))) if e.size else 0.0, None, not bad.any()))
    first = next((r.name for r in rows if not r.ok), None)
    return rows, first


def format_diff(rows: list[DiffRow], first: str | None, only_a=(), only_b=()) -> str:
    lines = [f"{'tensor':<32} {'shape':<20} {'max abs':>10} {'max rel':>10} {'jaccard':>8}  ok"]
    for r in rows:
        j = "" if r.jaccard is None else f"{r.jaccard:.4f}"
        lines.append(f"{r.name:<32} {str(tuple(r.shape)):<20} {r.max_abs:>10.3g} {r.max_rel:>10.3g} {j:>8}  "
                     f"{'yes' if r.ok else 'NO'}")
    for side, names in (("A", only_a), ("B", only_b)):
        if names:
            lines.append(f"only in {side}: {', '.join(sorted(names, key=sort_key))}")
    lines.append(f"first divergence: {first}" if first else "no divergence: every common tensor within tolerance")
    return "\n".join(lines)
