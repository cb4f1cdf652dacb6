"""End-to-end benchmark: prefill and decode of a reduced-depth GLM-5.2 with random weights, per op impl.

Reports prefill tokens/s and MFU, decode ms/step at several batch sizes (caches filled with random rows, so
no long prefill is needed to reach a context length), a per-stage breakdown of one decode step (each stage
timed alone at the step's shapes, times the number of layers that run it), the attention bytes roofline
and peak device memory. Every impl runs in the same process on the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels import fused_norm_rope, indexer, sparse_mla

from .config import GlmDsaConfig
from .engine import Engine
from .init import init_params
from .model import StepBatch
from .step import step

PEAK_BF16_FLOPS = 989e12
PEAK_HBM_BYTES = 4.8e12


def timeit(fn, *args, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of `fn(*args)` (blocked until ready) after warm-up calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes(device) -> int | None:
    """The device allocator's peak bytes in use so far (None where the backend does not say: CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


def flops_per_token(cfg: GlmDsaConfig, context: int) -> float:
    """Matmul FLOPs of one token through the model at a context length (sparse attention over top-k)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    k = min(cfg.index_topk, context)
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        attn = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim + d * cfg.mla_row_dim
        attn += h * cfg.qk_nope_head_dim * cfg.kv_lora_rank + h * cfg.kv_lora_rank * cfg.v_head_dim
        attn += h * cfg.v_head_dim * d
        attn += h * k * (cfg.mla_row_dim + cfg.kv_lora_rank)  # scores + weighted values
        if cfg.is_full(i):
            attn += cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * (cfg.index_head_dim + cfg.index_n_heads)
            attn += cfg.index_n_heads * cfg.index_head_dim * context  # indexer scores over the context
        if cfg.is_moe(i):
            mlp = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
            mlp += d * cfg.n_routed_experts
        else:
            mlp = 3 * d * cfg.intermediate_size
        total += attn + mlp
    return 2.0 * (total + d * cfg.vocab_size / max(context, 1))  # lm_head only for the last row of a prompt


def decode_attention_bytes(cfg: GlmDsaConfig, batch: int, context: int, cache_itemsize: int) -> int:
    """Bytes a decode step's attention must read: top-k MLA rows per layer, the indexer keys on full layers."""
    k = min(cfg.index_topk, context)
    mla = cfg.num_hidden_layers * k * cfg.mla_row_dim * cache_itemsize
    idx = len(cfg.full_layers) * context * cfg.index_head_dim * cache_itemsize
    return batch * (mla + idx)


def _random_caches(eng: Engine, key):
    def fill(c, k):
        return jax.random.normal(k, c.shape, jnp.float32).astype(c.dtype)
    leaves, tree = jax.tree.flatten(eng.caches)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [jax.jit(fill, donate_argnums=0)(c, k) for c, k in zip(leaves, keys)])


def _decode_batch(b: int, context: int, block_size: int, rng) -> StepBatch:
    pages = -(-context // block_size)
    tables = (1 + np.arange(b * pages, dtype=np.int32)).reshape(b, pages)
    pos = np.full(b, context - 1, np.int32)
    slots = tables[np.arange(b), pos // block_size] * block_size + pos % block_size
    ids = rng.integers(0, 1000, b).astype(np.int32)
    return StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, np.arange(b, dtype=np.int32), tables,
                                                np.arange(b, dtype=np.int32))))


def device_time(body, carry, *consts, reps: int = 10, iters: int = 5) -> float:
    """Device seconds of one `body(carry, *consts) -> carry`, from executables that loop it in a fori_loop:
    (T(1 + reps) - T(1)) / reps, so the dispatch and argument handling of an executable cancel out."""
    def looped(n):
        return jax.jit(lambda c, *k: jax.lax.fori_loop(0, n, lambda i, c: body(c, *k), c))
    t_lo = timeit(looped(1), carry, *consts, reps=iters)
    t_hi = timeit(looped(1 + reps), carry, *consts, reps=iters)
    return max(t_hi - t_lo, 0.0) / reps


def _nudge(x, y):
    """x plus a tiny multiple of y: a data dependency between loop iterations that XLA cannot remove."""
    return x + (jnp.sum(y.astype(jnp.float32)) * 1e-9).astype(x.dtype)


def stage_times(eng: Engine, batch: StepBatch) -> dict[str, float]:
    """Seconds per decode step spent in each stage: each op's device time (`device_time`) at the step's shapes,
    times the number of layers that run it."""
    cfg, impl, b = eng.config, eng.impl, batch.token_ids.shape[0]
    key = jax.random.key(1)
    dt = eng.dtype
    rnd = lambda *s, d=dt: jax.random.normal(key, s, jnp.float32).astype(d)  # noqa: E731
    mla = eng.caches["mla"][0].reshape(-1, eng.caches["mla"][0].shape[-1])
    idx_cache = eng.caches["indexer"][0].reshape(-1, eng.caches["indexer"][0].shape[-1])
    h_local = cfg.num_attention_heads // eng.parallel.tp
    kv_lens = batch.positions + 1
    n_full, n_moe = len(cfg.full_layers), sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    out = {}
    topk = functools.partial(indexer.indexer_topk, block_size=eng.block_size, topk=cfg.index_topk, impl=impl)
    q_i, w_i = rnd(b, cfg.index_n_heads, cfg.index_head_dim), rnd(b, cfg.index_n_heads, d=jnp.float32)
    idx_args = (w_i, idx_cache, batch.token_req, kv_lens, batch.block_tables)
    top = jax.jit(topk)(q_i, *idx_args)
    out["indexer"] = n_full * device_time(lambda q, *a: _nudge(q, topk(q, *a)), q_i, *idx_args)
    from .paged_cache import positions_to_slots
    slots = positions_to_slots(top, batch.token_req, batch.block_tables, eng.block_size)
    attend = functools.partial(sparse_mla.sparse_mla, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                               impl=impl)
    q = rnd(b, h_local, cfg.mla_row_dim)
    out["sparse_mla"] = cfg.num_hidden_layers * device_time(lambda q, c, s: _nudge(q, attend(q, c, s)[1]), q, mla,
                                                            slots)
    norm = functools.partial(fused_norm_rope.fused_norm_rope_cache, rope_theta=cfg.rope_theta, impl=impl)
    args = (rnd(b, cfg.q_lora_rank), rnd(b, cfg.mla_row_dim), batch.positions, batch.slot_mapping,
            rnd(cfg.q_lora_rank), rnd(cfg.kv_lora_rank))
    out["norms_rope_cache"] = cfg.num_hidden_layers * device_time(lambda c, *a: norm(*a, c)[1], jnp.zeros_like(mla),
                                                                  *args)
    moe_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)), None)
    if moe_layer is not None:
        from flax import nnx
        from jax.sharding import PartitionSpec as P

        from .step import model_graphdef, param_partition_specs
        gd = model_graphdef(cfg)

        def moe_step(x, params):  # weights as arguments: a closure would bake them in as constants
            y = jax.shard_map(lambda p, x: nnx.merge(gd, p).layers[moe_layer].moe(x, cfg, impl=impl), mesh=eng.mesh,
                              in_specs=(param_partition_specs(params, eng.parallel.q_replicate), P()),
                              out_specs=P(), check_vma=False)(params, x)
            return _nudge(x, y)
        out["moe"] = n_moe * device_time(moe_step, rnd(b, cfg.hidden_size), eng.params)
    out["collectives"] = 0.0 if eng.parallel.tp == 1 else float("nan")  # one device: none
    return out


@dataclasses.dataclass
class BenchConfig:
    preset: str = "bench"
    num_layers: int | None = None
    input_len: int = 32768
    output_len: int = 128
    batch: int = 8
    decode_batches: tuple[int, ...] = (1, 32, 128)
    decode_context: int | None = None  # default: input_len
    impls: tuple[str, ...] = ("xla",)
    dtype: str = "bfloat16"
    max_num_batched_tokens: int = 8192
    end_to_end: bool = True
    stages: bool = True
    seed: int = 0


def run_bench(bc: BenchConfig, log=print) -> dict:
    """Run the benchmark; returns a JSON-able dict and logs a table."""
    from . import configs
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.replace(num_hidden_layers=bc.num_layers, indexer_types=cfg.indexer_types[: bc.num_layers]
                          if len(cfg.indexer_types) >= bc.num_layers else ())
    params = init_params(cfg, seed=bc.seed, dtype=bc.dtype)
    ctx = bc.decode_context or bc.input_len
    rng = np.random.default_rng(bc.seed)
    device = jax.devices()[0]
    results = {"config": dataclasses.asdict(bc), "device": getattr(device, "device_kind", str(device)),
               "layers": cfg.num_hidden_layers, "impls": {}}
    for impl in bc.impls:
        r: dict = {}
        if bc.end_to_end:
            eng = Engine(cfg, params, dtype=bc.dtype, max_model_len=bc.input_len + bc.output_len,
                         max_num_seqs=bc.batch, max_num_batched_tokens=bc.max_num_batched_tokens, impl=impl)
            prompts = [rng.integers(0, cfg.vocab_size, bc.input_len).tolist() for _ in range(bc.batch)]
            eng.warmup(bc.batch, bc.input_len, bc.output_len)
            t0 = time.perf_counter()
            eng.generate(prompts, bc.output_len, stop_token_ids=[])
            total = time.perf_counter() - t0
            prefill = eng.last_timings["prefill_s"]  # to the first token of every prompt
            tokens = bc.batch * bc.input_len
            flops = sum(flops_per_token(cfg, c) for c in range(1, bc.input_len + 1)) * bc.batch
            r["prefill_s"] = prefill
            r["prefill_tokens_per_s"] = tokens / prefill
            r["prefill_mfu"] = flops / prefill / PEAK_BF16_FLOPS
            r["end_to_end_s"] = total
            r["decode_ms_per_step_e2e"] = 1e3 * eng.last_timings["decode_s"] / max(eng.last_timings["decode_steps"], 1)
            r["peak_bytes"] = peak_bytes(device)
            log(f"[{impl}] end-to-end: {json.dumps(r)}")
            del eng
        r["decode"] = {}
        for b in bc.decode_batches:
            eng = Engine(cfg, params, dtype=bc.dtype, max_model_len=ctx + 1, max_num_seqs=b, impl=impl,
                         block_size=64)
            eng.caches = _random_caches(eng, jax.random.key(b))
            batch = _decode_batch(b, ctx, eng.block_size, rng)
            run = jax.jit(functools.partial(step, config=cfg, parallel=eng.parallel, impl=impl), donate_argnums=(1,))
            caches = eng.caches
            for _ in range(2):
                _, caches = run(eng.params, caches, batch)
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            n = 10
            for _ in range(n):
                logits, caches = run(eng.params, caches, batch)
            jax.block_until_ready(logits)
            ms = 1e3 * (time.perf_counter() - t0) / n
            eng.caches = caches
            item = jnp.dtype(eng.caches["mla"][0].dtype).itemsize
            attn_bytes = decode_attention_bytes(cfg, b, ctx, item)
            row = {"ms_per_step": ms, "attention_bytes": attn_bytes,
                   "attention_roofline_ms": 1e3 * attn_bytes / PEAK_HBM_BYTES}
            if bc.stages:
                row["stages_ms"] = {k: 1e3 * v for k, v in stage_times(eng, batch).items()}
            row["peak_bytes"] = peak_bytes(device)
            r["decode"][b] = row
            log(f"[{impl}] decode B={b}: {json.dumps(row)}")
            del eng, caches
        results["impls"][impl] = r
    log(format_results(results))
    return results


def format_results(res: dict) -> str:
    lines = [f"device {res['device']}, {res['layers']} layers, config {json.dumps(res['config'])}"]
    for impl, r in res["impls"].items():
        if "prefill_s" in r:
            lines.append(f"[{impl}] prefill {r['prefill_s']:.3f} s, {r['prefill_tokens_per_s']:.0f} tok/s, "
                         f"MFU {100 * r['prefill_mfu']:.1f}%; end-to-end {r['end_to_end_s']:.2f} s, "
                         f"decode {r['decode_ms_per_step_e2e']:.2f} ms/step")
        for b, row in r["decode"].items():
            st = ", ".join(f"{k} {v:.3f}" for k, v in row.get("stages_ms", {}).items())
            lines.append(f"[{impl}] decode B={b}: {row['ms_per_step']:.3f} ms/step; attention bytes roofline "
                         f"{row['attention_roofline_ms']:.3f} ms; stages (ms): {st}; peak {row['peak_bytes']}")
    return "\n".join(lines)
