"""How fast GLM-5.2 FP8 would run on one 8-GPU node, from one device's share measured on one GPU (the suite's
`projection` area; `python benchmarks/bench_projection.py --out FILE`).

For each DCP size (TP = 8) and concurrency c, one device's share (`glm_dsa.serving.shard_benchmark`: the mesh's
per-shard step on one device, every collective a local stand-in) is timed per stage at c decode rows of an
8K-in / 1K-out request (context 8192 + 512: the middle of the output), and the collectives the step records are
costed by benchmarks/collective_model.py (inputs and sources: benchmarks/inputs/collective_model.json):

- decode step ms = compute ms (the stages, summed over GLM-5.2's 78 layers and the head) + collective ms (the
  modelled collectives, not overlapped with compute);
- output tok/s per GPU without MTP = c / step s / 8;
- with MTP (3 drafts, mean accepted length 2.99 per verify row group): a speculative step = a verify step (the
  target over 4 rows per request: 4c rows) + the drafts (the nextn layer, a full-attention MoE layer plus the head,
  over the 4c verify rows, then 2 chained passes over c rows); tok/s per GPU = 2.99 c / spec step s / 8;
- TTFT for one 8K prompt = one prefill step of 8192 rows (compute + collectives).

A check at every concurrency: the whole step of the layers built, timed as one program, beside the sum of the same
layers' stages timed alone (a stage timed alone pays a fixed cost per call that the whole step does not, so where
the two differ the stage sums over-count).

The node's own figures need 8 GPUs; these are a projection, and every row names its sources: the shard run (the
record's command) and the model's inputs. SGLang's published rows (8 x H200, GLM-5.2-FP8, TP = 8) stand beside them.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

#: the layout and workload of issue 43's question (8 x H200, TP = 8)
TP = 8
INPUT_LEN, OUTPUT_LEN = 8192, 1024
MTP_DRAFTS, MTP_ACCEPTANCE = 3, 2.99
ACCEPTANCE_SOURCE = "mean accepted length 2.99 at 3 drafts: InferenceX's GLM-5.2 golden curve, as issue 43 gives it"
SGLANG = [
    {"system": "SGLang (published)", "concurrency": 1, "dcp": 1, "mtp": True, "tok_s_per_gpu": 173.05 / 8,
     "tok_s_node": 173.05, "tpot_ms": 5.127, "ttft_ms": 670.0,
     "sources": ["https://github.com/sgl-project/sglang/pull/31554 (8 x H200, GLM-5.2-FP8, TP 8, random 8192 in / "
                 "1024 out, max_concurrency 1, low-latency EAGLE config: output_throughput 173.05, mean TPOT 5.13 ms, "
                 "mean TTFT 670 ms)"]},
    {"system": "SGLang (published)", "concurrency": 256, "dcp": 1, "mtp": True, "tok_s_per_gpu": 2132.21 / 8,
     "tok_s_node": 2132.21, "tpot_ms": 30.04,
     "sources": ["https://github.com/sgl-project/sglang/pull/31554 (max_concurrency 256: output_throughput 2132.21, "
                 "mean TPOT 30.0 ms)"]},
] + [
    {"system": "SGLang (published)", "concurrency": c, "dcp": 1, "mtp": None, "tok_s_per_gpu": v,
     "sources": ["https://github.com/sgl-project/sglang/pull/28437 (per GPU, as issue 43 quotes it; not re-read here)"]}
    for c, v in ((1, 26.0), (16, 98.0), (64, 219.0), (256, 236.0))
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="glm52")
    p.add_argument("--dcp", default="1,8", help="comma-separated DCP sizes (TP = --tp)")
    p.add_argument("--tp", type=int, default=TP)
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--input-len", type=int, default=INPUT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impl", default=None, help="kernels' impl (default: the platform's)")
    p.add_argument("--num-layers", type=int, default=None, help="the model's depth (default: the preset's)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-prefill", action="store_true", help="skip the TTFT prefill step")
    p.add_argument("--out", default=None, help="write the record (benchmarks.harness) here")
    return p.parse_args(argv)


def _collective_ms(m: dict, inputs, stages=None) -> float:
    from benchmarks.collective_model import collective_us
    return 1e-3 * sum(c["layers"] * collective_us(c["kind"], c["group"], c["in_bytes"], c["out_bytes"], inputs)
                      for c in m["collectives"] if stages is None or c["stage"] in stages)


#: stages whose cost depends on the row count only (not on the DCP size, the context or the rows' requests)
ROW_ONLY = ("mlp_dense", "moe", "head")
#: what the nextn (MTP) layer runs per pass: one full-attention MoE decoder layer and the head
DRAFT_STAGES = ("attention_full", "moe", "head")


def _draft(m: dict, inputs) -> tuple[float, float]:
    """(compute ms, collective ms) of one nextn-layer pass at `m`'s rows: one layer of each DRAFT_STAGES stage."""
    compute = sum(m["stages_ms"][s] for s in DRAFT_STAGES)
    coll = _collective_ms({"collectives": [dict(c, layers=1) for c in m["collectives"]]}, inputs, DRAFT_STAGES)
    return compute, coll


def largest(m: dict, cfg, inputs) -> str:
    """The largest cost of a step: a stage summed over its layers, or the collectives of one kind."""
    from glm_dsa.serving.shard_benchmark import stage_layers
    layers = stage_layers(cfg)
    costs = {f"{s} compute": ms * len(layers[s]) for s, ms in m["stages_ms"].items()}
    for c in m["collectives"]:
        key = f"{c['kind']} over {'x'.join(c['axes'])}"
        from benchmarks.collective_model import collective_us
        costs[key] = costs.get(key, 0.0) + 1e-3 * c["layers"] * collective_us(c["kind"], c["group"], c["in_bytes"],
                                                                              c["out_bytes"], inputs)
    name = max(costs, key=costs.get)
    return f"{name} ({costs[name]:.3f} ms of the step)"


def run(args, log=print, partial=None) -> tuple[list[dict], dict]:
    """The projection rows and the record's extra keys (the shard runs' per-batch figures, the MoE width check);
    `partial(rows, extra)` is called after each DCP size (a run stopped by a timeout keeps what it measured)."""
    import jax

    from benchmarks.collective_model import load_inputs, sources
    from glm_dsa.model import presets
    from glm_dsa.model.shard import shard_parallel
    from glm_dsa.serving import shard_benchmark as sbm
    cfg = presets.get(args.preset)
    if args.num_layers:
        cfg = cfg.with_depth(args.num_layers)
    inputs = load_inputs()
    model_sources = sources(inputs)
    conc = [int(x) for x in args.concurrency.split(",") if x]
    context = args.input_len + args.output_len // 2
    rng = np.random.default_rng(0)
    rows, runs = [], {}
    by_rows: dict[int, dict] = {}  # MLP, MoE and head ms by row count: the same for every DCP size and request split

    def measure(sb, batch, ctx_len, **kw):
        n = int(batch.token_ids.shape[0])
        m = sbm.measure(sb, batch, ctx_len, known=by_rows.get(n), **kw)
        by_rows[n] = {s: m["stages_ms"][s] for s in ROW_ONLY if s in m["stages_ms"]}
        return m
    check = sbm.moe_width_check(cfg.with_depth(min(8, cfg.num_hidden_layers)),
                                shard_parallel(str(args.tp), cfg), 16, quantization=args.quantization,
                                kv_cache_dtype=args.kv_cache_dtype)
    log(f"MoE width check ({check['rows']} rows, {cfg.num_hidden_layers if cfg.num_hidden_layers < 8 else 8} "
        f"layers): full-width weights / share's = {check['split_weight_bytes']:.4f}; FLOPs less the router: full / "
        f"share = {check['split_flops']}; XLA bytes less the router: full / share = {check['split_bytes']} "
        f"(TP = {check['tp']}; full {check['full']}, share {check['shard']})")
    extra = {"runs": runs, "moe_width_check": check, "model_inputs": model_sources,
             "mtp": {"drafts": MTP_DRAFTS, "acceptance": MTP_ACCEPTANCE, "source": ACCEPTANCE_SOURCE},
             "workload": {"input_len": args.input_len, "output_len": args.output_len, "decode_context": context,
                          "tp": args.tp}}
    for dcp in [int(x) for x in args.dcp.split(",") if x]:
        par = shard_parallel(f"{args.tp},{dcp}", cfg)
        sb = sbm.build(cfg, par, depth=sbm.representative_depth(cfg), max_requests=max(conc),
                       max_len=max(context + MTP_DRAFTS + 1, args.input_len), dtype=args.dtype,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, impl=args.impl)
        run_d = runs.setdefault(str(dcp), {"q_replicate": par.q_replicate, "comm_backend": par.dcp_comm_backend})
        ttft = None
        if not args.no_prefill:
            pb = sbm.prefill_batch(args.input_len, sb.block_size, cfg.vocab_size, rng, dcp, par.interleave)
            pm = measure(sb, pb, args.input_len, whole_step=False, iters=2)
            ttft = pm["compute_ms"] + _collective_ms(pm, inputs)
            run_d["prefill"] = pm
            log(f"DCP={dcp}: TTFT of one {args.input_len}-token prompt {ttft:.1f} ms (compute {pm['compute_ms']:.1f})")
        for c in conc:
            plain = measure(sb, sbm.step_batch(c, 1, context, sb.block_size, cfg.vocab_size, rng, dcp,
                                                   par.interleave), context, whole_step=True,
                                iters=args.iters)
            verify = measure(sb, sbm.step_batch(c, MTP_DRAFTS + 1, context, sb.block_size, cfg.vocab_size, rng,
                                                    dcp, par.interleave), context, whole_step=False,
                                 iters=args.iters)
            run_d[str(c)] = {"plain": plain, "verify": verify}
            shard_src = (f"shard run: one {jax.devices()[0].device_kind} ran the first device's share of TP={args.tp} "
                         f"DCP={dcp}, this record's command")
            coll = _collective_ms(plain, inputs)
            step = plain["compute_ms"] + coll
            base = {"system": "glm-dsa (projected)", "concurrency": c, "dcp": dcp, "ttft_ms": ttft,
                    "q_replicate": par.q_replicate}
            rows.append({**base, "mtp": False, "step_ms": step, "compute_ms": plain["compute_ms"],
                         "collective_ms": coll, "tok_s_per_gpu": c / (step * 1e-3) / args.tp,
                         "largest_cost": largest(plain, cfg, inputs), "sources": [shard_src] + model_sources})
            d1_c, d1_k = _draft(verify, inputs)  # the nextn layer over the 4c verify rows
            dn_c, dn_k = _draft(plain, inputs)  # each chained draft over c rows
            compute = verify["compute_ms"] + d1_c + (MTP_DRAFTS - 1) * dn_c
            coll_s = _collective_ms(verify, inputs) + d1_k + (MTP_DRAFTS - 1) * dn_k
            spec = compute + coll_s
            rows.append({**base, "mtp": True, "step_ms": spec, "compute_ms": compute, "collective_ms": coll_s,
                         "tok_s_per_gpu": MTP_ACCEPTANCE * c / (spec * 1e-3) / args.tp,
                         "largest_cost": largest(verify, cfg, inputs),
                         "sources": [shard_src, ACCEPTANCE_SOURCE] + model_sources})
            log(f"DCP={dcp} c={c}: decode step {step:.3f} ms (compute {plain['compute_ms']:.3f} + collectives "
                f"{coll:.3f}), {rows[-2]['tok_s_per_gpu']:.1f} tok/s/GPU; MTP step {spec:.3f} ms, "
                f"{rows[-1]['tok_s_per_gpu']:.1f} tok/s/GPU; largest: {rows[-2]['largest_cost']}")
            if "built_step_ms" in plain:
                log(f"  check: built {plain['built_layers']} layers: whole step {plain['built_step_ms']:.3f} ms, "
                    f"sum of its stages {plain['built_stages_sum_ms']:.3f} ms "
                    f"({plain['built_stages_sum_ms'] / plain['built_step_ms']:.2f}x)")
        del sb
        jax.clear_caches()
        if partial is not None:
            partial(rows + SGLANG, extra)
    return rows + SGLANG, extra


def main(argv=None) -> int:
    """Run the projection and write its record to --out."""
    from benchmarks.harness import record, write_json
    args = parse_args(argv)
    write = (lambda rows, extra: write_json(args.out, record(rows, **extra))) if args.out else None
    run(args, partial=write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
