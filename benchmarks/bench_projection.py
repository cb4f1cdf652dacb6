"""How fast GLM-5.2 FP8 would run on one 8-GPU node, from one device's share measured on one GPU (the suite's
`projection` area; `python benchmarks/bench_projection.py --out FILE`).

For each DCP size (TP = 8) and concurrency c, one device's share (`glm_dsa.serving.shard_benchmark`: the mesh's
per-shard step on one device, every collective a local stand-in) is timed per stage at c decode rows of an
8K-in / 1K-out request (context 8192 + 512: the middle of the output), and the collectives the step records are
costed by benchmarks/collective_model.py (inputs and sources: benchmarks/inputs/collective_model.json):

- decode step ms = compute ms (the stages, scaled to the whole step as below, summed over GLM-5.2's 78 layers and
  the head) + collective ms (the modelled collectives, not overlapped with compute);
- output tok/s per GPU without MTP = c / step s / 8;
- with MTP (3 drafts, mean accepted length 2.99 per verify row group): a speculative step = a verify step (the
  target over 4 rows per request: 4c rows) + the drafts (the nextn layer, a full-attention MoE layer plus the head,
  over the 4c verify rows, then 2 chained passes over c rows); tok/s per GPU = 2.99 c / spec step s / 8;
- TTFT for one 8K prompt = one prefill step of 8192 rows (compute + collectives).

At every concurrency the whole step of the layers built is timed as one program beside the sum of the same layers'
stages timed alone. A stage timed alone pays a fixed cost per call that the whole step does not, so the stage sum
over-counts (BENCHMARKS.md says by how much); the projection scales every stage of a step by (whole step) / (stage
sum) of the built layers before summing them over the model's depth (`scale_source`, `scaled`), so the compute
agrees with the whole step measured while the split by stage (the largest cost) stays. One factor serves every
stage: where the built layers' mix of stages differs from the full depth's, the factor is exact for the built mix
only. A step with no whole-step figure of its own (the verify step, which is never timed whole; every concurrency
but the first in older runs) takes the factor of the plain step at the same DCP size with the nearest row count,
where that is within `SCALE_REACH` times its rows, and is left unscaled (an upper bound) where none is; each row
says which (`scaled_by`, `notes`) and keeps the unscaled stage sum (`stage_sum_ms`) and the whole-step figures it
used (`whole_step`). The prefill step (TTFT) is unscaled.

The rows are a pure function of the record's `runs` (`project`): `--reproject FILE --out FILE` recomputes them from
a record's measurements without a GPU (the record's date, commit, device and command stay: they are the
measurement's; `reprojected` says when, at which commit and by which command the rows were recomputed).

The node's own figures need 8 GPUs; these are a projection, and every row names its sources: the shard run (the
record's command) and the model's inputs. SGLang's published rows (8 x H200, GLM-5.2-FP8, TP = 8) stand beside them.
"""

from __future__ import annotations

import argparse
import functools
import math
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
    p.add_argument("--scale-reach", type=float, default=SCALE_REACH,
                   help="a step without a whole-step figure of its own borrows the factor of a whole step within "
                        "this many times its rows (0: never borrow)")
    p.add_argument("--reproject", default=None, metavar="FILE",
                   help="measure nothing: recompute the rows of the record FILE from its runs (no GPU needed); "
                        "--preset / --num-layers give the layer counts where the record has none")
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
#: how far (in rows, either way) a step may borrow another step's whole-step factor: 4, the verify step's rows per
#: request, so that the verify step at c borrows the plain step's at c or 4c. Further off, the fixed cost per call
#: is a different share of the stages (it does not grow with the rows), and the step stays unscaled instead.
SCALE_REACH = 4.0


def whole_step_factor(m: dict) -> float | None:
    """(whole step of the built layers) / (the sum of the same layers' stages, each timed alone) of a measurement, or
    None where it has no whole-step figure."""
    if m.get("built_step_ms") is None or not m.get("built_stages_sum_ms"):
        return None
    return m["built_step_ms"] / m["built_stages_sum_ms"]


def scale_source(m: dict, checked: dict[int, dict], *, concurrency: int, reach: float = SCALE_REACH) -> dict:
    """How the stages of measurement `m` (taken at `concurrency` requests) are scaled: its own whole-step factor
    where it has one; else that of the measurement of `checked` ({concurrency: plain measurement with a whole-step
    figure}, same DCP size) nearest in rows, within `reach` times `m`'s rows (ties: the fewer rows); else 1 (the
    stages as timed, an upper bound). {"factor", "how": "own" | "nearest" | "none", "rows", "concurrency", and the
    whole-step figures used: "built_layers", "built_step_ms", "built_stages_sum_ms"}."""
    rows = m["rows"]
    if whole_step_factor(m) is not None:
        src, c_src, how = m, concurrency, "own"
    else:
        near = sorted((abs(math.log(w["rows"] / rows)), w["rows"], c) for c, w in checked.items()
                      if whole_step_factor(w) is not None and reach >= 1 and
                      max(w["rows"] / rows, rows / w["rows"]) <= reach)
        if not near:
            return {"factor": 1.0, "how": "none", "rows": rows, "concurrency": concurrency}
        c_src = near[0][2]
        src, how = checked[c_src], "nearest"
    return {"factor": whole_step_factor(src), "how": how, "rows": src["rows"], "concurrency": c_src,
            "built_layers": src["built_layers"], "built_step_ms": src["built_step_ms"],
            "built_stages_sum_ms": src["built_stages_sum_ms"]}


def scaled(m: dict, factor: float) -> dict:
    """`m` with every stage's ms and the full-depth compute ms multiplied by `factor` (the same factor for every stage:
    the split by stage is kept)."""
    return {**m, "stages_ms": {s: ms * factor for s, ms in m["stages_ms"].items()},
            "compute_ms": m["compute_ms"] * factor}


def scale_label(src: dict) -> str:
    """A scale source in a few words: "own (c=1)", "c=1 (nearest)" or "none"."""
    if src["how"] == "none":
        return "none"
    return f"own (c={src['concurrency']})" if src["how"] == "own" else f"c={src['concurrency']} (nearest)"


def scale_note(what: str, m: dict, src: dict, reach: float) -> str:
    """One line on how the compute of `what` (a step of measurement `m`) was derived from its stages."""
    if src["how"] == "none":
        return (f"{what} compute: the stages as timed alone, unscaled (an upper bound): no whole step of the built "
                f"layers measured at this DCP size within {reach:g}x its {m['rows']} rows")
    whose = ("its own" if src["how"] == "own" else
             f"borrowed from the plain step at c = {src['concurrency']} ({src['rows']} rows; this step, "
             f"{m['rows']} rows, has no whole-step figure of its own)")
    return (f"{what} compute: each stage x {src['factor']:.4f} = the whole step of the {src['built_layers']} built "
            f"layers ({src['built_step_ms']:.4f} ms) / the sum of their stages timed alone "
            f"({src['built_stages_sum_ms']:.4f} ms), {whose}")


def _draft(m: dict, inputs) -> tuple[float, float]:
    """(compute ms, collective ms) of one nextn-layer pass at `m`'s rows: one layer of each DRAFT_STAGES stage."""
    compute = sum(m["stages_ms"][s] for s in DRAFT_STAGES)
    coll = _collective_ms({"collectives": [dict(c, layers=1) for c in m["collectives"]]}, inputs, DRAFT_STAGES)
    return compute, coll


def largest(m: dict, layers: dict[str, int], inputs) -> str:
    """The largest cost of a step: a stage summed over its `layers` (counts per stage), or the collectives of one
    kind."""
    from benchmarks.collective_model import collective_us
    costs = {f"{s} compute": ms * layers[s] for s, ms in m["stages_ms"].items()}
    for c in m["collectives"]:
        key = f"{c['kind']} over {'x'.join(c['axes'])}"
        costs[key] = costs.get(key, 0.0) + 1e-3 * c["layers"] * collective_us(c["kind"], c["group"], c["in_bytes"],
                                                                              c["out_bytes"], inputs)
    name = max(costs, key=costs.get)
    return f"{name} ({costs[name]:.3f} ms of the step)"


def layer_counts(cfg) -> dict[str, int]:
    """How many layers run each stage in a step of `cfg` (the head: 1)."""
    from glm_dsa.serving.shard_benchmark import stage_layers
    return {s: len(ls) for s, ls in stage_layers(cfg).items()}


def _concurrencies(run_d: dict) -> list[int]:
    """The concurrencies a DCP size's run measured, in the order measured (its keys that are numbers)."""
    return [int(k) for k in run_d if k.isdigit()]


def project(runs: dict, *, layers: dict[str, int], tp: int, inputs, model_sources: list[str], device: str,
            drafts: int = MTP_DRAFTS, acceptance: float = MTP_ACCEPTANCE, reach: float = SCALE_REACH) -> list[dict]:
    """The projected rows of a record's `runs` ({dcp: {"q_replicate", "prefill"?, c: {"plain", "verify"}}}, as `run`
    writes them): per DCP size and concurrency, the decode step without and with MTP. A pure function of the
    measurements, the layer counts per stage and the collective model's inputs (no device)."""
    rows = []
    for dcp_key, run_d in runs.items():
        dcp = int(dcp_key)
        pm = run_d.get("prefill")
        ttft = None if pm is None else pm["compute_ms"] + _collective_ms(pm, inputs)
        plains = {c: run_d[str(c)]["plain"] for c in _concurrencies(run_d)}
        shard_src = f"shard run: one {device} ran the first device's share of TP={tp} DCP={dcp}, this record's command"
        for c, raw in plains.items():
            raw_v = run_d[str(c)]["verify"]
            src_p = scale_source(raw, plains, concurrency=c, reach=reach)
            src_v = scale_source(raw_v, plains, concurrency=c, reach=reach)
            plain, verify = scaled(raw, src_p["factor"]), scaled(raw_v, src_v["factor"])
            base = {"system": "glm-dsa (projected)", "concurrency": c, "dcp": dcp, "ttft_ms": ttft,
                    "q_replicate": run_d.get("q_replicate")}
            coll = _collective_ms(plain, inputs)
            step = plain["compute_ms"] + coll
            rows.append({**base, "mtp": False, "step_ms": step, "compute_ms": plain["compute_ms"],
                         "collective_ms": coll, "tok_s_per_gpu": c / (step * 1e-3) / tp,
                         "stage_sum_ms": raw["compute_ms"], "compute_scale": src_p["factor"],
                         "scaled_by": scale_label(src_p), "whole_step": src_p,
                         "largest_cost": largest(plain, layers, inputs),
                         "notes": [scale_note("decode step", raw, src_p, reach)],
                         "sources": [shard_src] + model_sources})
            d1_c, d1_k = _draft(verify, inputs)  # the nextn layer over the 4c verify rows
            dn_c, dn_k = _draft(plain, inputs)  # each chained draft over c rows
            compute = verify["compute_ms"] + d1_c + (drafts - 1) * dn_c
            stage_sum = raw_v["compute_ms"] + _draft(raw_v, inputs)[0] + (drafts - 1) * _draft(raw, inputs)[0]
            coll_s = _collective_ms(verify, inputs) + d1_k + (drafts - 1) * dn_k
            spec = compute + coll_s
            rows.append({**base, "mtp": True, "step_ms": spec, "compute_ms": compute, "collective_ms": coll_s,
                         "tok_s_per_gpu": acceptance * c / (spec * 1e-3) / tp,
                         "stage_sum_ms": stage_sum, "compute_scale": compute / stage_sum,
                         "scaled_by": f"verify {scale_label(src_v)}; drafts {scale_label(src_p)}",
                         "whole_step": {"verify": src_v, "draft": src_p},
                         "largest_cost": largest(verify, layers, inputs),
                         "notes": [scale_note("verify step and first draft", raw_v, src_v, reach),
                                   scale_note(f"{drafts - 1} chained drafts", raw, src_p, reach)],
                         "sources": [shard_src, ACCEPTANCE_SOURCE] + model_sources})
    return rows


def _log_rows(rows: list[dict], runs: dict, log) -> None:
    """One line per (DCP, concurrency): the decode step without and with MTP, the largest cost and the check."""
    for plain, spec in zip(rows[::2], rows[1::2]):
        log(f"DCP={plain['dcp']} c={plain['concurrency']}: decode step {plain['step_ms']:.3f} ms (compute "
            f"{plain['compute_ms']:.3f} = stages {plain['stage_sum_ms']:.3f} x {plain['compute_scale']:.3f} "
            f"[{plain['scaled_by']}] + collectives {plain['collective_ms']:.3f}), {plain['tok_s_per_gpu']:.1f} "
            f"tok/s/GPU; MTP step {spec['step_ms']:.3f} ms, {spec['tok_s_per_gpu']:.1f} tok/s/GPU "
            f"[{spec['scaled_by']}]; largest: {plain['largest_cost']}")
        m = runs[str(plain["dcp"])][str(plain["concurrency"])]["plain"]
        if whole_step_factor(m) is not None:
            log(f"  check: built {m['built_layers']} layers: whole step {m['built_step_ms']:.3f} ms, sum of its "
                f"stages {m['built_stages_sum_ms']:.3f} ms ({1 / whole_step_factor(m):.2f}x)")


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
    layers = layer_counts(cfg)
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
        f"layers): full-width weights / share's = {check['split_weight_bytes']:.4f}; products' FLOPs less the router: "
        f"full / share = {check['split_matmul_flops']}; XLA's FLOPs less the router: full / "
        f"share = {check['split_flops']}; XLA bytes less the router: full / share = {check['split_bytes']} "
        f"(TP = {check['tp']}; full {check['full']}, share {check['shard']})")
    extra = {"runs": runs, "moe_width_check": check, "model_inputs": model_sources,
             "mtp": {"drafts": MTP_DRAFTS, "acceptance": MTP_ACCEPTANCE, "source": ACCEPTANCE_SOURCE},
             "workload": {"input_len": args.input_len, "output_len": args.output_len, "decode_context": context,
                          "tp": args.tp, "stage_layers": layers},
             "scale_reach": args.scale_reach}
    project_runs = functools.partial(project, layers=layers, tp=args.tp, inputs=inputs, model_sources=model_sources,
                                     device=jax.devices()[0].device_kind, reach=args.scale_reach)
    for dcp in [int(x) for x in args.dcp.split(",") if x]:
        par = shard_parallel(f"{args.tp},{dcp}", cfg)
        sb = sbm.build(cfg, par, depth=sbm.representative_depth(cfg), max_requests=max(conc),
                       max_len=max(context + MTP_DRAFTS + 1, args.input_len), dtype=args.dtype,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, impl=args.impl)
        run_d = runs.setdefault(str(dcp), {"q_replicate": par.q_replicate, "comm_backend": par.dcp_comm_backend})
        if not args.no_prefill:
            pb = sbm.prefill_batch(args.input_len, sb.block_size, cfg.vocab_size, rng, dcp, par.interleave)
            pm = measure(sb, pb, args.input_len, whole_step=False, iters=2)
            run_d["prefill"] = pm
            log(f"DCP={dcp}: TTFT of one {args.input_len}-token prompt "
                f"{pm['compute_ms'] + _collective_ms(pm, inputs):.1f} ms (compute {pm['compute_ms']:.1f})")
        for c in conc:
            plain = measure(sb, sbm.step_batch(c, 1, context, sb.block_size, cfg.vocab_size, rng, dcp,
                                               par.interleave), context, whole_step=True, iters=args.iters)
            verify = measure(sb, sbm.step_batch(c, MTP_DRAFTS + 1, context, sb.block_size, cfg.vocab_size, rng,
                                                dcp, par.interleave), context, whole_step=False, iters=args.iters)
            run_d[str(c)] = {"plain": plain, "verify": verify}
        rows = project_runs(runs)
        _log_rows([r for r in rows if r["dcp"] == dcp], runs, log)
        del sb
        jax.clear_caches()
        if partial is not None:
            partial(rows + SGLANG, extra)
    return rows + SGLANG, extra


def _check_layers(runs: dict, layers: dict[str, int]) -> None:
    """Raise unless `layers` reproduce every recorded full-depth compute (the sum of stages x layers): the layer
    counts must be the measurement's model's."""
    for dcp, run_d in runs.items():
        for c in _concurrencies(run_d):
            for kind, m in run_d[str(c)].items():
                want = sum(ms * layers[s] for s, ms in m["stages_ms"].items())
                if not math.isclose(want, m["compute_ms"], rel_tol=1e-9):
                    raise ValueError(f"--reproject: the layer counts {layers} give {want} ms for DCP={dcp} c={c} "
                                     f"{kind}, the record {m['compute_ms']} ms: pass the run's --preset/--num-layers")


def reproject(rec: dict, *, layers: dict[str, int] | None = None, reach: float = SCALE_REACH, inputs=None,
              command: str | None = None, commit: str | None = None) -> dict:
    """`rec` (a projection record) with its rows recomputed from its `runs` by `project`: the same head (date,
    commit, device, jax, command: the measurement's), SGLang's rows after ours, and `reprojected` saying when, at
    which commit, by which command and under which rule. `layers`: counts per stage where the record has none."""
    import datetime

    from benchmarks.collective_model import load_inputs, sources
    inputs = inputs or load_inputs()
    layers = rec.get("workload", {}).get("stage_layers") or layers
    if layers is None:
        raise ValueError("--reproject: the record names no layer counts (workload.stage_layers): give them")
    _check_layers(rec["runs"], layers)
    model_sources = sources(inputs)
    mtp = rec.get("mtp", {})
    rows = project(rec["runs"], layers=layers, tp=rec["workload"]["tp"], inputs=inputs, model_sources=model_sources,
                   device=rec["device"], drafts=mtp.get("drafts", MTP_DRAFTS),
                   acceptance=mtp.get("acceptance", MTP_ACCEPTANCE), reach=reach)
    note = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "command": command,
            "note": ("rows recomputed from this record's runs (no new measurement): each step's stages scaled by its "
                     "whole step / stage sum (see each row's notes); date, commit, device and command are the "
                     "measurement's")}
    if rec.get("model_inputs") not in (None, model_sources):
        note["model_inputs_changed"] = "the collective model's inputs differ from the record's: model_inputs now"
    theirs = [r for r in rec["rows"] if not r["system"].startswith("glm-dsa")]
    workload = {**rec["workload"], "stage_layers": layers}  # the counts the rows used (checked above)
    return {**rec, "rows": rows + theirs, "workload": workload, "model_inputs": model_sources, "scale_reach": reach,
            "reprojected": note}


def main(argv=None) -> int:
    """Run the projection and write its record to --out, or (--reproject) recompute a record's rows."""
    from benchmarks.harness import command_line, git_commit, record, write_json
    args = parse_args(argv)
    if args.reproject:
        import json

        from glm_dsa.model import presets
        with open(args.reproject) as f:
            rec = json.load(f)
        cfg = presets.get(args.preset)
        cfg = cfg.with_depth(args.num_layers) if args.num_layers else cfg
        out = reproject(rec, layers=layer_counts(cfg), reach=args.scale_reach,
                        command=command_line(argv, script=__file__), commit=git_commit())
        rows = [r for r in out["rows"] if r["system"].startswith("glm-dsa")]
        _log_rows(rows, rec["runs"], print)
        if args.out:
            write_json(args.out, out)
        return 0
    write = (lambda rows, extra: write_json(args.out, record(rows, **extra))) if args.out else None
    run(args, partial=write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
