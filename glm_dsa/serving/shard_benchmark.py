"""`python -m glm_dsa bench --shard-of TP[,DCP]`: one device's share of a layout timed on one device, per stage.

The model is `glm_dsa.model.shard`'s: the per-shard modules the mesh runs, on one device's parameter and cache
shapes, every collective a local stand-in (`sharding.StandInCollectives`, DCP rank 0: the largest token share).
A decode step is split into the stages its layers run:

| stage | what | layers that run it |
|---|---|---|
| attention_full | RMSNorm, q/kv projections, norm/RoPE/cache write, indexer top-k, sparse MLA, o_proj | full layers |
| attention_shared | the same without the indexer (IndexShare: the previous full layer's top-k) | shared layers |
| mlp_dense | RMSNorm and the dense SwiGLU MLP | the first dense layers |
| moe | RMSNorm, router, routed experts, shared expert | the MoE layers |
| head | final norm, LM head (the vocab shard) | once per step |

Each stage is timed alone at the step's shapes on the first layer of its kind (`looped_ms`: an executable looping
it n times, (T(n_hi) - T(n_lo)) / (n_hi - n_lo): the fixed dispatch cost cancels). The attention stages write this
step's rows into the layer's caches as the step does, so the loop carries the caches and the executable takes them
donated (`stage_loop`): the write is in place, as in the step. Held as loop constants instead, every iteration would
copy the whole layer cache to give the write (the GPU kernel aliases its cache input to its output) a buffer of its
own, a copy the step never makes and one that grows with the cache. The step's compute is the sum
over the full model's layers of its stages: the depth need not be allocated or compiled (`--num-layers` sets the
depth built; the layer counts are the preset's). The whole shard step of the built depth is timed too, as a check
of that sum. Each stage's FLOPs and bytes are XLA's count (`cost_analysis`) of its xla-form program (the kernels'
oracle forms: a Pallas kernel is a custom call XLA does not count), and the collectives each stage issues are the
ones its `Collectives` recorded while tracing: kind, mesh axes, group size, bytes (the same calls the mesh's step
makes on one device: tests/model/test_shard.py). Timing the collectives needs the devices; their modelled cost is
benchmarks/collective_model.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from glm_dsa.model.config import GlmDsaConfig
from glm_dsa.model.layers import StepBatch, StepContext
from glm_dsa.model.options import StepOptions
from glm_dsa.model.paged_cache import allocate_caches, cache_dtype, owner_slots, pages_needed
from glm_dsa.model.shard import init_shard_params, shard_context, shard_model, shard_step
from kernels.common.norms import rms_norm
from sharding import TP_AXES, ParallelConfig, path_str
from sharding.dcp import local_length

STAGES = ("attention_full", "attention_shared", "mlp_dense", "moe", "head")


def stage_layers(cfg: GlmDsaConfig) -> dict[str, list[int]]:
    """The layers (indices) that run each stage; the head runs once (listed as [-1])."""
    n = cfg.num_hidden_layers
    return {"attention_full": [i for i in range(n) if cfg.is_full(i)],
            "attention_shared": [i for i in range(n) if not cfg.is_full(i)],
            "mlp_dense": [i for i in range(n) if not cfg.is_moe(i)],
            "moe": [i for i in range(n) if cfg.is_moe(i)], "head": [-1]}


def representative_depth(cfg: GlmDsaConfig) -> int:
    """The fewest layers of `cfg`'s schedule that hold one layer of every stage it has."""
    first = [ls[0] for name, ls in stage_layers(cfg).items() if ls and name != "head"]
    return max(first) + 1


def step_batch(b: int, rows_per_req: int, context: int, block_size: int, vocab_size: int, rng, dcp: int = 1,
               interleave: int = 1) -> StepBatch:
    """b requests at context `context`, each with `rows_per_req` consecutive rows ending at position
    context - 2 + rows_per_req (1 row: a decode step; k + 1 rows: a verify step of k drafts), pages 1.. in order,
    the slot on each position's owning DCP rank; token ids drawn from the vocabulary."""
    last = context - 1 + rows_per_req - 1
    pages = pages_needed(last + 1, block_size, dcp, interleave)
    tables = (1 + np.arange(b * pages, dtype=np.int32)).reshape(b, pages)
    req = np.repeat(np.arange(b, dtype=np.int32), rows_per_req)
    pos = (context - 1 + np.tile(np.arange(rows_per_req), b)).astype(np.int32)
    slots = owner_slots(tables, req, pos, block_size, dcp, interleave)
    ids = rng.integers(0, vocab_size, b * rows_per_req).astype(np.int32)
    return StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, req, tables,
                                                np.arange(b * rows_per_req, dtype=np.int32))))


def prefill_batch(length: int, block_size: int, vocab_size: int, rng, dcp: int = 1, interleave: int = 1
                  ) -> StepBatch:
    """One prompt of `length` tokens in one step (the logits of its last row)."""
    pages = pages_needed(length, block_size, dcp, interleave)
    tables = (1 + np.arange(pages, dtype=np.int32))[None]
    pos = np.arange(length, dtype=np.int32)
    req = np.zeros(length, np.int32)
    slots = owner_slots(tables, req, pos, block_size, dcp, interleave)
    ids = rng.integers(0, vocab_size, length).astype(np.int32)
    return StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, req, tables, np.array([length - 1], np.int32))))


def stage_body(stage: str, cfg: GlmDsaConfig, ctx: StepContext, *, with_caches: bool = False):
    """The per-shard body of `stage` on the first layer of its kind: f(params, caches, x, topk, batch) -> [T, D]
    (summed over TP by `ctx.comm`). `topk`: the previous full layer's local top-k (shared attention only).
    `with_caches`: f returns (output, caches) with the attention stages' cache writes in the caches (the timer's
    form, `stage_loop`); other stages return the caches they were given."""
    layer = stage_layers(cfg)["moe" if stage == "router" else stage][0]

    def body(params, caches, x, topk, batch):
        model = shard_model(params, cfg)  # the local shards' modules (inside shard_map on the mesh too)
        if stage == "head":
            h = rms_norm(x[batch.logits_indices], model.final_norm[...], cfg.rms_norm_eps)
            logits = jnp.einsum("td,dv->tv", h, model.lm_head[...], preferred_element_type=jnp.float32)
            return ctx.comm.all_gather(logits, TP_AXES, axis=1, tiled=True), caches
        mod = model.layers[layer]
        if stage.startswith("attention"):
            j = cfg.full_layers.index(layer) if cfg.is_full(layer) else None
            idx = None if j is None else caches["indexer"][j]
            out, mla, idx, _ = mod.attn(rms_norm(x, mod.input_norm[...], cfg.rms_norm_eps), caches["mla"][layer],
                                        idx, None if j is not None else topk, batch, ctx)
            mla_all = list(caches["mla"])
            mla_all[layer] = mla.reshape(caches["mla"][layer].shape)
            index_all = list(caches["indexer"])
            if j is not None:
                index_all[j] = idx.reshape(caches["indexer"][j].shape)
            return out, {**caches, "mla": tuple(mla_all), "indexer": tuple(index_all)}
        h = rms_norm(x, mod.post_norm[...], cfg.rms_norm_eps)
        valid = batch.positions >= 0  # padding rows route to no expert, as in the step (DecoderLayer)
        if stage == "router":  # the MoE's replicated part: every device routes every row (moe_width_check)
            return mod.moe.route(h, cfg, valid)[1], caches
        out = (mod.moe(h, cfg, ctx.options, comm=ctx.comm, valid=valid) if stage == "moe"
               else mod.mlp(h, ctx.options, ctx.comm))
        return out, caches

    if with_caches:
        return body
    return lambda params, caches, x, topk, batch: body(params, caches, x, topk, batch)[0]


def local_topk(cfg: GlmDsaConfig, rows: int, context: int, parallel: ParallelConfig) -> jax.Array:
    """A shared layer's input top-k [rows, K] of this rank: its first local positions (K = index_topk, at most the
    rank's tokens; padded with -1)."""
    n_local = int(local_length(context, 0, parallel.dcp, parallel.interleave))
    k = np.arange(cfg.index_topk)
    return jnp.asarray(np.tile(np.where(k < n_local, k, -1), (rows, 1)).astype(np.int32))


@dataclasses.dataclass
class ShardBench:
    """One device's share built on this device: config (the built depth), the layout, parameters, caches."""

    cfg: GlmDsaConfig
    full_cfg: GlmDsaConfig
    parallel: ParallelConfig
    params: dict
    caches: dict
    block_size: int
    options: StepOptions

    def ctx(self, options: StepOptions | None = None) -> StepContext:
        return shard_context(self.cfg, self.parallel, self.block_size, options or self.options)


def build(full_cfg: GlmDsaConfig, parallel: ParallelConfig, *, depth: int, max_requests: int, max_len: int,
          dtype: str = "bfloat16", quantization=None, kv_cache_dtype: str = "auto", block_size: int = 64,
          seed: int = 0, impl: str | None = None) -> ShardBench:
    """The share of `full_cfg` cut to `depth` layers, with caches of `max_requests` sequences of `max_len` tokens
    (this rank's pages) filled with random rows."""
    from glm_dsa.serving.benchmark import random_caches
    cfg = full_cfg.with_depth(depth) if depth != full_cfg.num_hidden_layers else full_cfg
    params = init_shard_params(cfg, parallel, seed=seed, dtype=dtype, quantization=quantization)
    pages = max_requests * pages_needed(max_len, block_size, parallel.dcp, parallel.interleave) + 1
    dt = jnp.dtype(dtype)
    caches = allocate_caches(cfg, pages, block_size, cache_dtype(kv_cache_dtype, dt), kv_cache_dtype=kv_cache_dtype)
    caches = random_caches(cfg, caches, jax.random.key(seed + 1))
    return ShardBench(cfg, full_cfg, parallel, params, caches, block_size, StepOptions(impl=impl))


def _stage_args(sb: ShardBench, batch: StepBatch, context: int):
    rows = batch.token_ids.shape[0]
    dt = sb.params["embed"].dtype
    x = jax.random.normal(jax.random.key(3), (rows, sb.cfg.hidden_size), jnp.float32).astype(dt)
    return x, local_topk(sb.cfg, rows, context, sb.parallel)


def stage_loop(stage: str, sb: ShardBench, ctx: StepContext | None = None):
    """The executable `stage_times` times for `stage`: run(n, (x, caches), params, topk, batch) -> (x, caches) loops
    the stage n times (n traced: one compile for every n), each iteration's input the last one's output nudged by
    it (`nudge`: a dependency XLA cannot remove). The caches are carried and donated, so the attention stages'
    cache writes update them in place as the step's donated caches are, not a copy of the layer cache per
    iteration."""
    from glm_dsa.serving.benchmark import nudge
    f = stage_body(stage, sb.cfg, ctx or sb.ctx(), with_caches=True)

    def body(carry, params, topk, batch):
        x, caches = carry
        out, caches = f(params, caches, x, topk, batch)
        return nudge(x, out), caches
    return jax.jit(lambda n, carry, *k: jax.lax.fori_loop(0, n, lambda i, c: body(c, *k), carry), donate_argnums=(1,))


def looped_ms(run, carry, *consts, n_hi: int = 9, n_lo: int = 1, iters: int = 5) -> tuple[float, object]:
    """(milliseconds of one loop iteration of `run(n, carry, *consts) -> carry`, the carry after the runs): timed at
    n_hi and n_lo iterations, (T(n_hi) - T(n_lo)) / (n_hi - n_lo) (the fixed dispatch cost cancels; one compile).
    `run` may take the carry donated: each call gets the last one's output, and the caller's `carry` is consumed
    (use the one returned)."""
    from glm_dsa.serving.benchmark import median_seconds
    state = [carry]

    def call(n):
        def once():
            state[0] = run(n, state[0], *consts)
            return state[0]
        return once
    t_hi = median_seconds(call(jnp.int32(n_hi)), warmup=2, reps=iters)
    t_lo = median_seconds(call(jnp.int32(n_lo)), warmup=1, reps=iters)
    return 1e3 * max(t_hi - t_lo, 1e-9) / (n_hi - n_lo), state[0]


def stage_times(sb: ShardBench, batch: StepBatch, context: int, *, stages=STAGES, iters: int = 5) -> dict:
    """Milliseconds of each stage (one layer's) at `batch`'s shapes on this device (see the module doc). The caches
    are carried through the loops donated (`stage_loop`); `sb.caches` is left holding the updated ones."""
    ctx = sb.ctx()
    x, topk = _stage_args(sb, batch, context)
    out = {}
    for stage in stages:
        if not stage_layers(sb.cfg)[stage]:
            continue
        out[stage], (x, sb.caches) = looped_ms(stage_loop(stage, sb, ctx), (x, sb.caches), sb.params, topk, batch,
                                               iters=iters)
    return out


def matmul_flops(jaxpr) -> int:
    """2 x multiply-adds of every product in `jaxpr` (a core Jaxpr; nested jaxprs walked, a scan's body once per
    trip): a dot_general's output elements x its contracted length, and a ragged dot's the same over its rows, each
    row against its own group only. These are the products' own FLOPs, not XLA's count of how it lowers them (the
    CPU lowers a ragged dot to a masked product over every group, with elementwise work around it)."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            dims = (eqn.params["dimension_numbers"] if name == "dot_general"
                    else eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers)
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in dims[0][0])
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's own
                if hasattr(sub, "eqns"):
                    total += trips * matmul_flops(sub)
    return total


def stage_costs(sb_or_cfg, parallel: ParallelConfig, batch: StepBatch, context: int, *, params=None, caches=None,
                dtype="bfloat16", stages=STAGES) -> dict:
    """Per stage: XLA's FLOPs and bytes of its xla-form program on this device's shapes, and the collectives it
    issues ([CollectiveCall]). Abstract: `params` / `caches` may be `jax.ShapeDtypeStruct` trees."""
    cfg = sb_or_cfg.cfg if isinstance(sb_or_cfg, ShardBench) else sb_or_cfg
    params = sb_or_cfg.params if params is None else params
    caches = sb_or_cfg.caches if caches is None else caches
    block = jax.tree.leaves(caches["mla"])[0].shape[1]
    ctx = shard_context(cfg, parallel, block, StepOptions(impl="xla", moe_mode="ragged"))
    rows = batch.token_ids.shape[0]
    x = jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.dtype(dtype))
    topk = jax.ShapeDtypeStruct((rows, cfg.index_topk), jnp.int32)
    # Counted on the CPU client whatever the device: jax's Lowered.cost_analysis asks the client of the program's
    # device, and the GPU's (a PJRT C API plugin) raises NotImplementedError for a program not compiled. The
    # arguments go in abstract (shapes and dtypes only), so nothing ties the program to the GPU; the counts of the
    # xla-form program are the shapes', not the backend's.
    abstract = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                                 if hasattr(a, "shape") and hasattr(a, "dtype") else a)
    args = abstract((params, caches, x, topk, batch))
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        cpu = None  # no CPU client in this process (JAX_PLATFORMS names only the GPU): the counts stay None
    out = {}
    for stage in stages:
        if not stage_layers(cfg)["moe" if stage == "router" else stage]:
            continue
        f = stage_body(stage, cfg, ctx)
        with ctx.comm.record() as log, jax.default_device(cpu):
            traced = jax.jit(f).trace(*args)  # the trace records the collectives; the CPU lowering counts
            ca = None if cpu is None else traced.lower().cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        out[stage] = {"flops": None if ca is None else float(ca.get("flops", 0.0)),
                      "bytes": None if ca is None else float(ca.get("bytes accessed", 0.0)),
                      "matmul_flops": matmul_flops(traced.jaxpr.jaxpr), "collectives": list(log)}
    return out


def step_ms(sb: ShardBench, batch: StepBatch, steps: int = 5) -> float:
    """Milliseconds of the whole shard step of the built depth (caches donated, consecutive steps)."""
    from glm_dsa.serving.benchmark import median_seconds
    run = jax.jit(functools.partial(shard_step, config=sb.cfg, parallel=sb.parallel, options=sb.options),
                  donate_argnums=(1,))

    def one():
        logits, sb.caches = run(sb.params, sb.caches, batch)
        return logits
    return 1e3 * median_seconds(one, warmup=2, reps=1, calls_per_rep=steps)


def projected_compute_ms(stage_ms: dict, cfg: GlmDsaConfig) -> float:
    """A step of `cfg`'s full depth: each stage's time times the number of layers that run it."""
    layers = stage_layers(cfg)
    return sum(ms * len(layers[s]) for s, ms in stage_ms.items())


def collectives_per_step(costs: dict, cfg: GlmDsaConfig) -> list:
    """Every collective of a full-depth step: each stage's calls times the layers that run it, as
    (stage, count, CollectiveCall)."""
    layers = stage_layers(cfg)
    return [(s, len(layers[s]), c) for s, v in costs.items() for c in v["collectives"]]


def call_row(stage: str, layers: int, call) -> dict:
    """A JSON row of one recorded collective of a stage, run by `layers` layers per step."""
    return {"stage": stage, "layers": layers, "kind": call.kind, "axes": list(call.axes), "group": call.group,
            "shape": list(call.shape), "dtype": call.dtype, "in_bytes": call.in_bytes, "out_bytes": call.out_bytes}


def measure(sb: ShardBench, batch: StepBatch, context: int, *, whole_step: bool = True, iters: int = 5,
            known: dict | None = None) -> dict:
    """One batch's figures on the shard: stage ms, the full depth's compute ms (the sum over its layers), each
    stage's FLOPs / bytes, the collectives a full-depth step issues, and (`whole_step`) the built depth's step ms
    beside the sum of its stages. `known`: stage ms already measured at these shapes (stages that depend on the rows
    only, e.g. the MoE of another DCP size's share), not timed again."""
    known = dict(known or {})
    stages = {**known, **stage_times(sb, batch, context, iters=iters,
                                     stages=tuple(s for s in STAGES if s not in known))}
    stages = {s: stages[s] for s in STAGES if s in stages}
    costs = stage_costs(sb, sb.parallel, batch, context, dtype=sb.params["embed"].dtype)
    out = {"rows": int(batch.token_ids.shape[0]), "context": context, "stages_ms": stages,
           "compute_ms": projected_compute_ms(stages, sb.full_cfg),
           "stage_flops": {k: v["flops"] for k, v in costs.items()},
           "stage_bytes": {k: v["bytes"] for k, v in costs.items()},
           "collectives": [call_row(s, n, c) for s, n, c in collectives_per_step(costs, sb.full_cfg)]}
    if whole_step:
        out["built_layers"] = sb.cfg.num_hidden_layers
        out["built_step_ms"] = step_ms(sb, batch)
        out["built_stages_sum_ms"] = projected_compute_ms(stages, sb.cfg)
    return out


def run_from_args(args, command: str | None = None, log=print) -> int:
    """`python -m glm_dsa bench --shard-of TP[,DCP] ...`: the decode batches' stages on one device's share; writes
    --json-out. `--num-layers N`: the model is N layers deep (all built); default: the preset's depth, with the
    fewest layers that hold every stage built."""
    from glm_dsa.model import presets
    from glm_dsa.model.shard import shard_parallel
    from glm_dsa.serving.benchmark import record, write_json
    if args.tensor_parallel_size != 1 or args.decode_context_parallel_size != 1:
        raise ValueError("--shard-of runs one device's share on one device: give the layout there, not with -tp / -dcp")
    cfg = presets.get(args.preset)
    if args.num_layers:
        cfg = cfg.with_depth(args.num_layers)
    parallel = shard_parallel(args.shard_of, cfg)
    depth = args.num_layers or representative_depth(cfg)
    ctx_len = args.decode_context or args.input_len
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    impl = args.impls.split(",")[0] if args.impls else None
    sb = build(cfg, parallel, depth=depth, max_requests=max(batches), max_len=ctx_len + 1, dtype=args.dtype,
               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, impl=impl)
    rng = np.random.default_rng(args.seed)
    rows = []
    for b in batches:
        batch = step_batch(b, 1, ctx_len, sb.block_size, cfg.vocab_size, rng, parallel.dcp, parallel.interleave)
        m = measure(sb, batch, ctx_len, whole_step=not args.no_end_to_end)
        rows.append({"B": b, **m})
        stages = ", ".join(f"{k} {v:.3f}" for k, v in m["stages_ms"].items())
        line = (f"shard of TP={parallel.tp} DCP={parallel.dcp} B={b} ctx={ctx_len}: stages (ms per layer) {stages}; "
                f"{cfg.num_hidden_layers}-layer step compute {m['compute_ms']:.3f} ms")
        if "built_step_ms" in m:
            line += (f"; built {m['built_layers']} layers: step {m['built_step_ms']:.3f} ms, sum of stages "
                     f"{m['built_stages_sum_ms']:.3f} ms")
        log(line)
        kinds = {}
        for c in m["collectives"]:
            key = (c["kind"], tuple(c["axes"]), c["group"])
            calls, nbytes = kinds.get(key, (0, 0))
            kinds[key] = (calls + c["layers"], nbytes + c["layers"] * c["in_bytes"])
        log("  collectives per step: " + "; ".join(f"{k} over {'x'.join(a)} (group {g}): {n} calls, {nb} B in"
                                                for (k, a, g), (n, nb) in kinds.items()))
    if args.json_out:
        write_json(args.json_out, record(rows, command=command, preset=args.preset, tp=parallel.tp, dcp=parallel.dcp,
                                         q_replicate=parallel.q_replicate, comm_backend=parallel.dcp_comm_backend,
                                         layers=cfg.num_hidden_layers, built_layers=depth))
    return 0


def moe_width_check(cfg: GlmDsaConfig, parallel: ParallelConfig, rows: int, *, quantization="fp8",
                    dtype="bfloat16", kv_cache_dtype: str = "fp8_ds_mla", block_size: int = 64) -> dict:
    """The full-width MoE layer's FLOPs and bytes (`cfg` on one device, TP = 1) against TP x one device's share at
    `rows` decode rows, counted abstractly (nothing allocated): XLA's counts of the xla-form program and the bytes
    of the layer's weights (routed and shared experts, FP8 with their scale grids: what a decode step reads). The
    router is replicated (every device routes every row), so it is counted apart: (full - router) / (shard -
    router) is the split factor of the rest, TP where the experts' work splits exactly. `split_matmul_flops` is the
    same ratio of the products' own FLOPs (`matmul_flops`), which split by exactly TP."""
    from glm_dsa.model.shard import shard_parallel
    rng = np.random.default_rng(0)
    counts = ("flops", "bytes", "matmul_flops")  # XLA's two counts, and the products' own FLOPs
    out = {}
    for name, par in (("full", shard_parallel("1", cfg)), ("shard", parallel)):
        params = jax.eval_shape(lambda par=par: init_shard_params(cfg, par, dtype=dtype, quantization=quantization))
        pages = rows + 1
        from glm_dsa.model.paged_cache import cache_shapes
        shapes = cache_shapes(cfg, pages, block_size, kv_cache_dtype)
        cdt = cache_dtype(kv_cache_dtype, jnp.dtype(dtype))
        caches = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, cdt), shapes,
                              is_leaf=lambda s: isinstance(s, tuple) and bool(s) and isinstance(s[0], int))
        batch = step_batch(rows, 1, 2, block_size, cfg.vocab_size, rng, par.dcp, par.interleave)
        costs = stage_costs(cfg, par, batch, 2, params=params, caches=caches, dtype=dtype, stages=("moe", "router"))
        out[name] = {k: {key: v[key] for key in counts} for k, v in costs.items()}
        prefix = f"layers.{stage_layers(cfg)['moe'][0]}.moe."
        nbytes = {path_str(p)[len(prefix):]: math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
                  for p, v in jax.tree_util.tree_leaves_with_path(params) if path_str(p).startswith(prefix)}
        out[name]["weights"] = {"bytes": sum(v for k, v in nbytes.items() if not k.startswith("router"))}
        out[name]["router_weights"] = {"bytes": sum(v for k, v in nbytes.items() if k.startswith("router"))}
    f, s = out["full"], out["shard"]
    for key in counts:
        r = f["router"][key]
        counted = None not in (r, f["moe"][key], s["moe"][key])  # None: the backend has no HLO cost model
        out[f"split_{key}"] = (f["moe"][key] - r) / (s["moe"][key] - r) if counted else None
    out["split_weight_bytes"] = f["weights"]["bytes"] / s["weights"]["bytes"]
    out.update(tp=parallel.tp, rows=rows)
    return out
