"""Which kernel runs for a model's shapes: the kernels registry's decisions for one step of each shape class
(decode rows of B requests, a prefill chunk), taken while tracing `glm_dsa.step` for a platform given as an input
(`kernels.registry.deciding_for`), so a CPU prints the table of a GPU. `python -m glm_dsa info --kernels`; with
`batch_invariant` (`--batch-invariant`) the table of batch-invariant mode's serving step shapes instead (a
prompt step of `INVARIANT_PROMPT_ROWS` rows, a decode step at each bucket of `kernels.registry.decode_buckets`, 8 to
`INVARIANT_STEP_ROWS` rows, each with the block table of `requests` requests: the decode buckets list the same
choices)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels import registry

#: decode batch sizes and prefill chunk lengths the table shows by default
DECODE_ROWS = (1, 32, 128)
PREFILL_ROWS = (2048,)


def trimmed(config):
    """`config` with the fewest layers that still hold each kind (dense, MoE, indexer-owning and indexer-sharing):
    every layer of a kind makes the same decisions, so the table traces one of each."""
    kinds = list(zip(config.indexer_types, config.mlp_layer_types))
    n = max(kinds.index(kind) for kind in set(kinds)) + 1  # the shortest prefix holding every kind
    return dataclasses.replace(config, num_hidden_layers=n, indexer_types=config.indexer_types[:n],
                               mlp_layer_types=config.mlp_layer_types[:n])


def abstract_step_inputs(config, parallel, *, rows: int, requests: int, context: int, block_size: int,
                         kv_cache_dtype: str, dtype, quantization):
    """ShapeDtypeStructs of (params, caches, batch) for one step of `rows` rows of `requests` requests."""
    from glm_dsa.model.random_init import init_params
    from glm_dsa.model.layers import StepBatch
    from glm_dsa.model.paged_cache import cache_dtype, cache_shapes, max_addressable_pages

    params = jax.eval_shape(functools.partial(init_params, config, dtype=dtype, parallel=parallel,
                                              quantization=quantization))
    pages = -(-context // block_size)
    num_pages = pages * requests + 1
    if registry.decide("cache_offsets", impl="auto") == "int32":  # as the engine caps them
        num_pages = min(num_pages, max_addressable_pages(config, block_size, kv_cache_dtype) or num_pages)
    num_pages *= parallel.dcp
    shapes = cache_shapes(config, num_pages, block_size, kv_cache_dtype)
    cdt = cache_dtype(kv_cache_dtype, dtype)
    caches = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, cdt), shapes,
                          is_leaf=lambda s: isinstance(s, tuple) and bool(s) and isinstance(s[0], int))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    batch = StepBatch(token_ids=i32((rows,)), positions=i32((rows,)), slot_mapping=i32((rows,)),
                      token_req=i32((rows,)), block_tables=i32((requests, pages)), logits_indices=i32((requests,)))
    return params, caches, batch


def step_decisions(config, *, parallel=None, rows: int, requests: int, context: int = 32768, block_size: int = 64,
                   kv_cache_dtype: str = "auto", dtype="bfloat16", quantization=None, platform: str = "gpu",
                   trim: bool = True, batch_invariant: bool = False, prompt_rows: int | None = None,
                   decode_rows: int | None = None) -> list:
    """The `kernels.registry.Decision`s of one `glm_dsa.step` (impl "auto") over `rows` rows of `requests`
    requests with `context` tokens of room each, decided for `platform`; traced only (`jax.eval_shape`), nothing
    runs. `trim`: trace one layer of each kind (`trimmed`) instead of the whole model. `batch_invariant`: the
    step in batch-invariant mode, a prompt step from `prompt_rows` rows (`StepOptions.invariant_prompt_rows`), a
    decode step's kind of at most `decode_rows` rows (`StepOptions.invariant_decode_rows`)."""
    from glm_dsa.model.options import StepOptions
    from glm_dsa.model.step import resolve_parallel, step

    cfg = trimmed(config) if trim else config
    parallel = resolve_parallel(parallel, cfg)
    if jax.device_count() < parallel.tp:
        raise ValueError(f"the dispatch table of -tp {parallel.tp} traces the step on {parallel.tp} devices; jax sees "
                         f"{jax.device_count()} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{parallel.tp} JAX_PLATFORMS=cpu)")
    with registry.deciding_for(platform):  # the cache sized as the engine sizes it there
        args = abstract_step_inputs(cfg, parallel, rows=rows, requests=requests, context=context,
                                    block_size=block_size, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                                    quantization=quantization)
    options = StepOptions(impl="auto", batch_invariant=batch_invariant,
                          invariant_prompt_rows=prompt_rows if batch_invariant else None,
                          invariant_decode_rows=decode_rows if batch_invariant else None)
    with registry.deciding_for(platform), registry.record() as log:
        jax.eval_shape(functools.partial(step, config=cfg, parallel=parallel, options=options), *args)
    return log


def shape_classes(decode_rows=DECODE_ROWS, prefill_rows=PREFILL_ROWS) -> list[tuple[str, int, int]]:
    """(label, rows, requests) of each shape class: decode rows (one a request), then single-request prefill
    chunks."""
    return ([(f"decode B={b}", b, b) for b in decode_rows]
            + [(f"prefill T={t}", t, 1) for t in prefill_rows])


#: the block-table rows of batch-invariant mode's steps in the table (the engine's: max_num_seqs' bucket)
INVARIANT_REQUESTS = 32


def invariant_shape_classes(prompt_rows: int | None = None, decode_rows: int | None = None,
                            requests: int = INVARIANT_REQUESTS) -> list[tuple[str, int, int]]:
    """(label, rows, requests) of batch-invariant mode's step shapes: a prompt step of `prompt_rows` (default
    `INVARIANT_PROMPT_ROWS`) rows and a decode step at each of its buckets, 8 up to `decode_rows` (default
    `INVARIANT_STEP_ROWS`; `registry.decode_buckets`), all with a block table of `requests` rows (the mode's steps
    always have max_num_seqs' bucket of them)."""
    p = registry.INVARIANT_PROMPT_ROWS if prompt_rows is None else prompt_rows
    return [(f"invariant prompt T={p}", p, requests)] + [
        (f"invariant decode T={d}", d, requests) for d in registry.decode_buckets(decode_rows)]


def dispatch_table(config, *, decode_rows=DECODE_ROWS, prefill_rows=PREFILL_ROWS, batch_invariant: bool = False,
                   invariant_rows: tuple[int, int] | None = None, **kwargs) -> list[dict]:
    """One row per (shape class, rule, choice): {"shape", "rows", "op", "rule", "choice", "why" (the first line of
    the rule's docstring)}. `kwargs` go to `step_decisions`. `batch_invariant`: the classes of
    `invariant_shape_classes` (`invariant_rows`: (prompt rows, decode rows), default the registry's) in that mode,
    instead of `decode_rows` and `prefill_rows`."""
    rules = {r.name: r for r in registry.rules()}
    table = []
    if batch_invariant:
        prompt, decode = invariant_rows or (None, None)
        classes = invariant_shape_classes(prompt, decode)
        kwargs = dict(kwargs, batch_invariant=True, prompt_rows=classes[0][1], decode_rows=classes[-1][1])
    else:
        classes = shape_classes(decode_rows, prefill_rows)
    for label, rows, requests in classes:
        decided = {(d.rule, d.choice) for d in step_decisions(config, rows=rows, requests=requests, **kwargs)}
        for rule, choice in sorted(decided):
            table.append({"shape": label, "rows": rows, "op": rules[rule].op, "rule": rule, "choice": choice,
                          "why": rules[rule].summary})
    return table


def format_table(table: list[dict]) -> str:
    """The table as aligned text columns."""
    cols = ("shape", "op", "rule", "choice", "why")
    cells = [[str(r[c]) for c in cols] for r in table]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
