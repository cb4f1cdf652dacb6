"""End-to-end benchmark: prefill and decode of a reduced-depth GLM-5.2 with random weights, per op impl.

Reports prefill tokens/s and MFU, decode ms/step at several batch sizes (caches filled with random rows, so
no long prefill is needed to reach a context length), a per-stage breakdown of one decode step (each stage
timed alone at the step's shapes, times the number of layers that run it), the attention bytes roofline
and peak device memory. Every impl runs in the same process on the same weights. Token ids are drawn from
the model's vocabulary. The step's collectives are not timed apart: the breakdown (each op alone on one
device, at the shapes of one TP shard) lists them as not measured rather than as a number; `-tp` / `-dcp` run
the end-to-end and decode steps on that mesh, and the distributed flags (`--coordinator-address HOST:PORT
--num-processes N --process-id I`, one process per host) run them across processes: process 0 reports (peak
memory is that of its first device), and the per-stage breakdown is skipped there (it is one device's, the same
as a one-process run's). Every process makes the same sequence of device calls: nothing device-side is run by
one process alone, and no loop count depends on a clock.

    python -m glm_dsa bench --help        # the command line
    PYTHONPATH=. python3 benchmarks/bench_engine.py --help      # the same flags
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (command_line, device_peaks, device_time, median_seconds, nudge, peak_bytes, record,
                                write_json)
from glm_dsa.config import GlmDsaConfig
from glm_dsa.engine import Engine
from glm_dsa.init import init_params
from glm_dsa.model import StepBatch
from glm_dsa.paged_cache import KV_CACHE_DTYPES
from glm_dsa.step import step
from kernels import fused_norm_rope, indexer, sparse_mla
from kernels.common.fp8_formats import quantize_index_rows, quantize_mla_rows

#: stages of a decode step that `stage_times` does not time, and why (reported so, never as a number)
NOT_MEASURED = {"collectives": "not measured (the step's all-gathers and psums are not timed apart)"}


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
            attn += (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
                     + d * (cfg.index_head_dim + cfg.index_n_heads))
            attn += cfg.index_n_heads * cfg.index_head_dim * context  # indexer scores over the context
        if cfg.is_moe(i):
            mlp = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
            mlp += d * cfg.n_routed_experts
        else:
            mlp = 3 * d * cfg.intermediate_size
        total += attn + mlp
    return 2.0 * (total + d * cfg.vocab_size / max(context, 1))  # lm_head only for the last row of a prompt


def decode_attention_bytes(cfg: GlmDsaConfig, batch: int, context: int, cache_itemsize: int, *,
                           mla_row_bytes: int | None = None, index_row_bytes: int | None = None) -> int:
    """Bytes a decode step's attention must read: top-k MLA rows per layer, the indexer keys on full layers. Rows
    are `cache_itemsize` bytes per element unless their byte widths are given (fp8_ds_mla caches: 656 and 132)."""
    k = min(cfg.index_topk, context)
    mla = cfg.num_hidden_layers * k * (mla_row_bytes or cfg.mla_row_dim * cache_itemsize)
    idx = len(cfg.full_layers) * context * (index_row_bytes or cfg.index_head_dim * cache_itemsize)
    return batch * (mla + idx)


def _random_caches(eng: Engine, key):
    """Every cache of `eng` filled with random rows: normal values in a float cache; in an fp8_ds_mla (uint8) cache,
    valid quantised rows of normal values (finite scales: random bytes would give NaN attention, NaN hidden
    states and a degenerate routing that reads a few experts), 65536 distinct rows repeated."""
    cfg = eng.config

    def fill(c, k, kind):
        if c.dtype != jnp.uint8:
            return jax.random.normal(k, c.shape, jnp.float32).astype(c.dtype)
        total = math.prod(c.shape[:-1])  # [pages, block, row bytes]
        n, (k1, k2) = min(total, 65536), jax.random.split(k)
        if kind == "mla":
            rows = quantize_mla_rows(jax.random.normal(k1, (n, cfg.kv_lora_rank)),
                                     jax.random.normal(k2, (n, cfg.qk_rope_head_dim)))
        else:
            rows = quantize_index_rows(jax.random.normal(k1, (n, cfg.index_head_dim)))
        return jnp.tile(rows, (-(-total // n), 1))[:total].reshape(c.shape)
    out = {}
    for i, (kind, layers) in enumerate(eng.caches.items()):
        keys = jax.random.split(jax.random.fold_in(key, i), len(layers))
        out[kind] = type(layers)(
            jax.jit(functools.partial(fill, kind=kind), donate_argnums=0, out_shardings=c.sharding)(c, k)
            for c, k in zip(layers, keys))
    return out


def decode_batch(b: int, context: int, block_size: int, vocab_size: int, rng, dcp: int = 1) -> StepBatch:
    """One decode row per sequence at position `context - 1` (pages 1.. in order; under DCP = `dcp` each rank's
    share of the context, the slot on the owning rank), token ids drawn uniformly from the model's vocabulary
    [0, vocab_size)."""
    from glm_dsa.paged_cache import owner_slots, pages_needed
    pages = pages_needed(context, block_size, dcp)
    tables = (1 + np.arange(b * pages, dtype=np.int32)).reshape(b, pages)
    pos = np.full(b, context - 1, np.int32)
    slots = owner_slots(tables, np.arange(b), pos, block_size, dcp)
    ids = rng.integers(0, vocab_size, b).astype(np.int32)
    return StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, np.arange(b, dtype=np.int32), tables,
                                                np.arange(b, dtype=np.int32))))


def stage_times(eng: Engine, batch: StepBatch) -> dict[str, float]:
    """Seconds per decode step spent in each stage: each op's device time (`device_time`) at the step's shapes,
    times the number of layers that run it. The collectives are not among them (`NOT_MEASURED`)."""
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
    # as the model calls it: the entries as a set (the select kernel skips their sort)
    topk = functools.partial(indexer.indexer_topk, block_size=eng.block_size, topk=cfg.index_topk, ordered=False,
                             impl=impl)
    q_i, w_i = rnd(b, cfg.index_n_heads, cfg.index_head_dim), rnd(b, cfg.index_n_heads, d=jnp.float32)
    idx_args = (w_i, idx_cache, batch.token_req, kv_lens, batch.block_tables)
    top = jax.jit(topk)(q_i, *idx_args)
    out["indexer"] = n_full * device_time(lambda q, *a: nudge(q, topk(q, *a)), q_i, *idx_args)
    from glm_dsa.paged_cache import positions_to_slots
    slots = positions_to_slots(top, batch.token_req, batch.block_tables, eng.block_size)
    attend = functools.partial(sparse_mla.sparse_mla, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                               impl=impl)
    q = rnd(b, h_local, cfg.mla_row_dim)
    out["sparse_mla"] = cfg.num_hidden_layers * device_time(lambda q, c, s: nudge(q, attend(q, c, s)[1]), q, mla,
                                                            slots)
    norm = functools.partial(fused_norm_rope.fused_norm_rope_cache, rope_theta=cfg.rope, impl=impl)
    args = (rnd(b, cfg.q_lora_rank), rnd(b, cfg.mla_row_dim), batch.positions, batch.slot_mapping,
            rnd(cfg.q_lora_rank), rnd(cfg.kv_lora_rank))
    out["norms_rope_cache"] = cfg.num_hidden_layers * device_time(lambda c, *a: norm(*a, c)[1], jnp.zeros_like(mla),
                                                                  *args)
    moe_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)), None)
    if moe_layer is not None:
        from flax import nnx
        from jax.sharding import PartitionSpec as P

        from glm_dsa.options import StepOptions
        from glm_dsa.placement import partition_specs
        from glm_dsa.step import fp8_paths, model_graphdef
        gd = model_graphdef(cfg, fp8_paths(eng.params))

        def moe_step(x, params):  # weights as arguments: a closure would bake them in as constants
            y = jax.shard_map(lambda p, x: nnx.merge(gd, p).layers[moe_layer].moe(x, cfg, StepOptions(impl=impl)),
                              mesh=eng.mesh,
                              in_specs=(partition_specs(params, cfg, eng.parallel), P()),
                              out_specs=P(), check_vma=False)(params, x)
            return nudge(x, y)
        out["moe"] = n_moe * device_time(moe_step, rnd(b, cfg.hidden_size), eng.params)
    return out


def decode_engine(cfg: GlmDsaConfig, params, parallel, dtype: str, impl: str, b: int, context: int,
                  kv_cache_dtype: str = "auto") -> Engine:
    """An engine of `b` sequences whose caches hold random rows, for `decode_ms_per_step` at `context`."""
    eng = Engine(cfg, params, parallel=parallel, dtype=dtype, max_model_len=context + 1, max_num_seqs=b, impl=impl,
                 block_size=64, kv_cache_dtype=kv_cache_dtype)
    eng.caches = _random_caches(eng, jax.random.key(b))
    return eng


def decode_ms_per_step(eng: Engine, batch: StepBatch, steps: int = 10) -> float:
    """Milliseconds per decode step of `batch` (`decode_batch`) on `eng`: 2 warm-up steps (the compile), then
    one sample of `steps` consecutive steps blocked at the end, as a decode loop runs them. A fixed number of
    calls, so every process of a multi-process run makes the same ones."""
    run = jax.jit(functools.partial(step, config=eng.config, parallel=eng.parallel, impl=eng.impl),
                  donate_argnums=(1,))

    def decode_step():  # the caches are donated: each step feeds the next one's
        logits, eng.caches = run(eng.params, eng.caches, batch)
        return logits
    return 1e3 * median_seconds(decode_step, warmup=2, reps=1, calls_per_rep=steps)


@dataclasses.dataclass
class BenchConfig:
    """What `run_bench` runs (the `python -m glm_dsa bench` flags)."""

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
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    quantization: str | None = None  # "fp8": the same random model with its linear weights quantised on device
    kv_cache_dtype: str = "auto"  # paged_cache.KV_CACHE_DTYPES ("fp8_ds_mla": 656-byte MLA rows)


def run_bench(bc: BenchConfig, log=print) -> dict:
    """Run the benchmark; returns a JSON-able dict and logs a table."""
    from glm_dsa import configs
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.replace(num_hidden_layers=bc.num_layers, indexer_types=cfg.indexer_types[: bc.num_layers]
                          if len(cfg.indexer_types) >= bc.num_layers else ())
    from sharding import ParallelConfig, mesh_for
    parallel = ParallelConfig(tensor_parallel_size=bc.tensor_parallel_size,
                              decode_context_parallel_size=bc.decode_context_parallel_size)
    from glm_dsa.distributed import check_mesh_spans_processes
    check_mesh_spans_processes(mesh_for(parallel))  # before minutes of init and compiles, in every process
    params = init_params(cfg, seed=bc.seed, dtype=bc.dtype, parallel=parallel, quantization=bc.quantization)
    stages = bc.stages and jax.process_count() == 1  # one device's op times: a one-process run gives them
    ctx = bc.decode_context or bc.input_len
    rng = np.random.default_rng(bc.seed)
    device = jax.local_devices()[0]  # across processes jax.devices()[0] is process 0's: elsewhere unaddressable
    peaks = device_peaks(device)
    results = {"config": dataclasses.asdict(bc), "device": getattr(device, "device_kind", str(device)),
               "roofline": dataclasses.asdict(peaks), "layers": cfg.num_hidden_layers, "impls": {}}
    for impl in bc.impls:
        r: dict = {}
        if bc.end_to_end:
            eng = Engine(cfg, params, parallel=parallel, dtype=bc.dtype, max_model_len=bc.input_len + bc.output_len,
                         max_num_seqs=bc.batch, max_num_batched_tokens=bc.max_num_batched_tokens, impl=impl,
                         kv_cache_dtype=bc.kv_cache_dtype)
            prompts = [rng.integers(0, cfg.vocab_size, bc.input_len).tolist() for _ in range(bc.batch)]
            eng.warmup(bc.batch, bc.input_len, bc.output_len)
            total = median_seconds(functools.partial(eng.generate, prompts, bc.output_len, stop_token_ids=[]),
                                   warmup=0, reps=1)
            prefill = eng.last_timings["prefill_s"]  # to the first token of every prompt
            tokens = bc.batch * bc.input_len
            flops = sum(flops_per_token(cfg, c) for c in range(1, bc.input_len + 1)) * bc.batch
            r["prefill_s"] = prefill
            r["prefill_tokens_per_s"] = tokens / prefill
            r["prefill_mfu"] = flops / prefill / peaks.bf16_flops_per_s
            r["end_to_end_s"] = total
            r["decode_ms_per_step_e2e"] = 1e3 * eng.last_timings["decode_s"] / max(eng.last_timings["decode_steps"], 1)
            r["peak_bytes"] = peak_bytes(device)
            log(f"[{impl}] end-to-end: {json.dumps(r)}")
            del eng
        r["decode"] = {}
        for b in bc.decode_batches:
            try:
                row = _decode_row(cfg, params, parallel, bc, impl, b, ctx, rng, stages, peaks, device)
            except jax.errors.JaxRuntimeError as e:
                # a batch whose caches do not fit (full-width layers at B = 128) is a result, not the end of the run;
                # across processes every process must stop the same way, so there it is raised
                if "RESOURCE_EXHAUSTED" not in str(e) or jax.process_count() > 1:
                    raise
                row = {"error": "out of memory: " + str(e).splitlines()[0][:300]}
            r["decode"][b] = row
            log(f"[{impl}] decode B={b}: {json.dumps(row)}")
        results["impls"][impl] = r
    log(format_results(results))
    return results


def _decode_row(cfg, params, parallel, bc, impl, b, ctx, rng, stages, peaks, device) -> dict:
    """One decode batch's figures: ms per step, the attention bytes and their roofline, the stages, peak memory."""
    eng = decode_engine(cfg, params, parallel, bc.dtype, impl, b, ctx, bc.kv_cache_dtype)
    try:
        batch = decode_batch(b, ctx, eng.block_size, cfg.vocab_size, rng, dcp=eng.parallel.dcp)
        ms = decode_ms_per_step(eng, batch)
        rows = [c[0].shape[-1] * jnp.dtype(c[0].dtype).itemsize for c in (eng.caches["mla"], eng.caches["indexer"])]
        attn_bytes = decode_attention_bytes(cfg, b, ctx, 0, mla_row_bytes=rows[0], index_row_bytes=rows[1])
        row = {"ms_per_step": ms, "attention_bytes": attn_bytes,
               "attention_roofline_ms": 1e3 * attn_bytes / peaks.hbm_bytes_per_s}
        if stages:
            row["stages_ms"] = {k: 1e3 * v for k, v in stage_times(eng, batch).items()}
            row["stages_not_measured"] = dict(NOT_MEASURED)
        row["peak_bytes"] = peak_bytes(device)
        return row
    finally:
        del eng  # before the next B's caches


def format_results(res: dict) -> str:
    """The results of `run_bench` as a table, one line per impl and decode batch."""
    lines = [f"device {res['device']}, {res['layers']} layers, config {json.dumps(res['config'])}; MFU and "
             f"rooflines of {res['roofline']['name']}"]
    for impl, r in res["impls"].items():
        if "prefill_s" in r:
            lines.append(f"[{impl}] prefill {r['prefill_s']:.3f} s, {r['prefill_tokens_per_s']:.0f} tok/s, "
                         f"MFU {100 * r['prefill_mfu']:.1f}%; end-to-end {r['end_to_end_s']:.2f} s, "
                         f"decode {r['decode_ms_per_step_e2e']:.2f} ms/step")
        for b, row in r["decode"].items():
            if "error" in row:
                lines.append(f"[{impl}] decode B={b}: {row['error']}")
                continue
            st = ", ".join([f"{k} {v:.3f}" for k, v in row.get("stages_ms", {}).items()]
                           + [f"{k} {why}" for k, why in row.get("stages_not_measured", {}).items()])
            lines.append(f"[{impl}] decode B={b}: {row['ms_per_step']:.3f} ms/step; attention bytes roofline "
                         f"{row['attention_roofline_ms']:.3f} ms; stages (ms): {st}; peak {row['peak_bytes']}")
    return "\n".join(lines)


def to_record(res: dict, command: str | None = None) -> dict:
    """The results of `run_bench` as a harness record (`benchmarks.harness.record`): flat rows (`result_rows`)
    and the nested results beside them."""
    return record(result_rows(res), command=command, device=res["device"],
                  **{k: v for k, v in res.items() if k != "device"})


def result_rows(res: dict) -> list[dict]:
    """The results of `run_bench` as flat JSON rows: one per impl for the end-to-end run, one per impl and
    decode batch."""
    out = []
    for impl, r in res["impls"].items():
        if "prefill_s" in r:
            out.append({"impl": impl, "phase": "end_to_end", **{k: v for k, v in r.items() if k != "decode"}})
        for b, row in r["decode"].items():
            out.append({"impl": impl, "phase": "decode", "B": int(b), "context": res["config"]["decode_context"]
                        or res["config"]["input_len"], **row})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: the `python -m glm_dsa bench` subcommand's and this module's `main`'s."""
    from glm_dsa.configs import PRESETS
    p.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--input-len", type=int, default=32768)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decode-batches", default="1,32,128", help="comma-separated decode batch sizes")
    p.add_argument("--decode-context", type=int, default=None, help="context length of the decode runs")
    p.add_argument("--impls", default="xla", help="comma-separated op implementations, e.g. triton,xla")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, choices=["fp8", "none"],
                   help="fp8: the random model's linear weights quantised on device to FP8 (128x128 block scales) "
                        "and computed from; none / default: all in --dtype")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="paged cache dtype (fp8_ds_mla: 656-byte MLA rows, as vLLM serves GLM-5.x)")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the prefill + generate run")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the results here as a JSON record (benchmarks.harness)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    from glm_dsa.distributed import add_flags
    add_flags(p)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed `add_arguments` flags."""
    return BenchConfig(preset=args.preset, num_layers=args.num_layers, input_len=args.input_len,
                       output_len=args.output_len, batch=args.batch,
                       decode_batches=tuple(int(x) for x in args.decode_batches.split(",") if x),
                       decode_context=args.decode_context, impls=tuple(args.impls.split(",")), dtype=args.dtype,
                       max_num_batched_tokens=args.max_num_batched_tokens, end_to_end=not args.no_end_to_end,
                       stages=not args.no_stages, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                       decode_context_parallel_size=args.decode_context_parallel_size,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the benchmark of parsed `add_arguments` flags and write its record to --json-out; exit code 0."""
    from glm_dsa import distributed
    distributed.initialize_from_flags(args)  # a no-op in one process, or when the CLI has joined already
    res = run_bench(config_from_args(args), log=print if jax.process_index() == 0 else lambda *a, **k: None)
    if args.json_out and jax.process_index() == 0:
        write_json(args.json_out, to_record(res, command=command))
    return 0


def main(argv=None) -> int:
    """The command line (the same as `python -m glm_dsa bench`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    from glm_dsa import distributed
    try:
        return run_from_args(ap.parse_args(argv), command=command_line(argv, script=__file__))
    except (Exception, KeyboardInterrupt):
        if distributed.is_multiprocess():  # not through JAX's shutdown barrier: peers wait in a collective
            import traceback
            traceback.print_exc()
            distributed.exit_now(1)
        raise


if __name__ == "__main__":
    sys.exit(main())
