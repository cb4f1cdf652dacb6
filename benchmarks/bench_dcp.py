"""Decode context parallelism on several devices: identity with DCP = 1, then the cost of each DCP variant.

For a reduced-depth model with random weights (the `bench` preset by default):
  1. identity: greedy tokens of DCP = N (every QREP x comm-backend variant) against DCP = 1 at the same TP, over
     `identity_steps` new tokens (float32 by default: a bf16 model with random weights has near-tied logits,
     and the merge by LSE rounds differently from one softmax, which is not what this checks), and the
     teacher-forced logits of the first prompt (relative L2 distance, top-1 agreement, the median row's distance
     and the rows past 1e-3): the size and spread of the difference, which tell rounding (bf16: ~1e-2, top-1
     agreement near 1; float32: a median near 1e-6) from a broken merge;
  2. timing: `Engine.generate` of `batch` prompts of `input_len` tokens, `output_len` new tokens, per variant:
     prefill seconds, decode ms/step, total; parameter, cache and peak bytes on the first device.
Every variant draws the same weights (`init_params` with one seed; QREP only changes their sharding).

The command line (issue: multi-gpu; figures in BENCHMARKS.md):

    PYTHONPATH=. python3 benchmarks/bench_dcp.py --tp 4 --dcp 4 --out dcp.json            # on nvidia-h200-x4
    PYTHONPATH=. python3 benchmarks/bench_dcp.py --tp 2 --dcp 2 --no-timing --identity-dtype bfloat16  # x2
    PYTHONPATH=. python3 benchmarks/bench_dcp.py --preset tiny --tp 4 --dcp 4 --input-len 64 --cpu   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import numpy as np

from benchmarks.harness import apply_platform_flags, command_line, median_seconds, peak_bytes, record, write_json
from glm_dsa import configs
from glm_dsa.serving.engine import Engine
from glm_dsa.model.random_init import init_params
from sharding import ParallelConfig
from sharding.parallel import QREP_ENV

VARIANTS = ("qrep:a2a", "qrep:ag_rs", "noqrep:a2a", "noqrep:ag_rs")


@dataclasses.dataclass
class DcpBenchConfig:
    """What `run_dcp_bench` runs (the command line's flags)."""

    preset: str = "bench"
    num_layers: int | None = None
    tp: int = 4
    dcp: int = 4
    variants: tuple[str, ...] = VARIANTS
    identity_variants: tuple[str, ...] | None = None  # None: the same as `variants`
    identity_prompt_len: int = 512
    identity_batch: int = 4
    identity_steps: int = 128
    identity_dtype: str = "float32"
    identity_trace: bool = True  # also compare the forced prompt's MoE expert choices layer by layer
    input_len: int = 32768
    output_len: int = 128
    batch: int = 8
    dtype: str = "bfloat16"
    impl: str | None = None
    max_num_batched_tokens: int = 8192
    timing: bool = True
    seed: int = 0


def parse_variant(v: str) -> tuple[bool, str]:
    """'qrep:a2a' -> (True, 'a2a'); 'noqrep:ag_rs' -> (False, 'ag_rs')."""
    q, _, backend = v.partition(":")
    if q not in ("qrep", "noqrep") or backend not in ("a2a", "ag_rs"):
        raise ValueError(f"DCP variant {v!r}: want qrep|noqrep:a2a|ag_rs")
    return q == "qrep", backend


def bytes_on(tree, device) -> int:
    """Bytes of the shards of `tree`'s arrays that live on `device`."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
               if s.device == device)


def _config(bc: DcpBenchConfig):
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.replace(num_hidden_layers=bc.num_layers)
    return cfg


def _parallel(bc: DcpBenchConfig, variant: str | None) -> ParallelConfig:  # None: DCP = 1
    if variant is None:
        return ParallelConfig(tensor_parallel_size=bc.tp, decode_context_parallel_size=1)
    qrep, backend = parse_variant(variant)
    return ParallelConfig(tensor_parallel_size=bc.tp, decode_context_parallel_size=bc.dcp, dcp_q_replicate=qrep,
                          dcp_comm_backend=backend)


def run_dcp_bench(bc: DcpBenchConfig, log=print) -> dict:
    """Run the identity check and the timings; returns a JSON-able dict (and logs one line per result)."""
    if os.environ.get(QREP_ENV, "").strip():
        raise ValueError(f"unset {QREP_ENV}: it would override the QREP setting of every variant")
    id_variants = bc.variants if bc.identity_variants is None else bc.identity_variants
    for v in tuple(bc.variants) + tuple(id_variants):
        parse_variant(v)
    cfg = _config(bc)
    rng = np.random.default_rng(bc.seed)
    dev0 = jax.devices()[0]
    res: dict = {"config": dataclasses.asdict(bc), "device": getattr(dev0, "device_kind", str(dev0)),
                 "devices": bc.tp, "identity": {}, "timing": {}}

    def engine(variant, dtype, max_len, batch):
        parallel = _parallel(bc, variant)
        params = init_params(cfg, seed=bc.seed, dtype=dtype, parallel=parallel)
        return Engine(cfg, params, parallel=parallel, dtype=dtype, max_model_len=max_len, max_num_seqs=batch,
                      max_num_batched_tokens=bc.max_num_batched_tokens, impl=bc.impl)

    if bc.identity_steps:
        prompts = [rng.integers(0, cfg.vocab_size, bc.identity_prompt_len).tolist() for _ in range(bc.identity_batch)]
        max_len = bc.identity_prompt_len + bc.identity_steps
        want = want_logits = None
        forced = np.asarray(prompts[:1])
        for variant in (None,) + tuple(id_variants):
            eng = engine(variant, bc.identity_dtype, max_len, bc.identity_batch)
            got = eng.generate(prompts, bc.identity_steps, stop_token_ids=[])
            logits = eng.logits(forced)[0]  # teacher-forced: how far apart the two are before any divergence
            experts = ({k: v for k, v in eng.trace(forced[0]).items() if k.endswith("moe.experts")}
                       if bc.identity_trace else {})
            del eng
            if variant is None:
                want, want_logits, want_experts = got, logits, experts
                continue
            same = [int(np.sum(np.asarray(a) == np.asarray(b))) for a, b in zip(got, want)]
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, want)]
            diff = logits - want_logits
            per_row = np.linalg.norm(diff, axis=-1) / np.linalg.norm(want_logits, axis=-1)
            row = {"identical": got == want, "tokens_equal": sum(same), "tokens": sum(map(len, want)),
                   "first_difference": first,
                   "forced_logits_rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(want_logits)),
                   "forced_top1_agreement": float(np.mean(logits.argmax(-1) == want_logits.argmax(-1))),
                   # a few far rows over a rounding-level median: discrete flips (an expert chosen at a near-tie
                   # of the router), not a merge that is off everywhere
                   "forced_row_rel_median": float(np.median(per_row)),
                   "forced_rows_over_1e-3": np.flatnonzero(per_row > 1e-3).tolist()}
            if experts:  # rows (positions) whose chosen experts differ, per MoE layer
                row["forced_rows_rerouted"] = {k.split(".")[1]: np.flatnonzero(
                    np.any(experts[k] != want_experts[k], axis=-1)).tolist() for k in sorted(experts)}
            res["identity"][variant] = row
            log(f"identity DCP={bc.dcp} {variant} vs DCP=1 (TP={bc.tp}, {bc.identity_dtype}): {json.dumps(row)}")
    if bc.timing:
        prompts = [rng.integers(0, cfg.vocab_size, bc.input_len).tolist() for _ in range(bc.batch)]
        for variant in (None,) + tuple(bc.variants):
            name = variant or "dcp1"
            eng = engine(variant, bc.dtype, bc.input_len + bc.output_len, bc.batch)
            eng.warmup(bc.batch, bc.input_len, bc.output_len)
            total = median_seconds(functools.partial(eng.generate, prompts, bc.output_len, stop_token_ids=[]),
                                   warmup=0, reps=1)
            t = eng.last_timings
            row = {"total_s": total, "prefill_s": t["prefill_s"],
                   "decode_ms_per_step": 1e3 * t["decode_s"] / max(t["decode_steps"], 1),
                   "param_bytes_per_device": bytes_on(eng.params, dev0),
                   "cache_bytes_per_device": bytes_on(eng.caches, dev0),
                   "peak_bytes": peak_bytes(dev0)}
            res["timing"][name] = row
            log(f"timing {name} (TP={bc.tp}, DCP={1 if variant is None else bc.dcp}): {json.dumps(row)}")
            del eng
    return res


def to_record(res: dict, command: str | None = None) -> dict:
    """The results of `run_dcp_bench` as a harness record: one row per identity variant and per timed variant,
    the nested results beside them."""
    rows = [{"check": "identity", "variant": v, **r} for v, r in res["identity"].items()]
    rows += [{"check": "timing", "variant": v, **r} for v, r in res["timing"].items()]
    return record(rows, command=command, device=res["device"], **{k: v for k, v in res.items() if k != "device"})


def main(argv=None) -> int:
    """The command line: 0 when every DCP variant's greedy tokens equal DCP = 1's, else 1."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--variants", default="qrep:a2a,qrep:ag_rs,noqrep:a2a,noqrep:ag_rs")
    ap.add_argument("--identity-variants", default=None, help="variants of the identity check (default: --variants)")
    ap.add_argument("--identity-steps", type=int, default=128)
    ap.add_argument("--identity-prompt-len", type=int, default=512)
    ap.add_argument("--identity-batch", type=int, default=4)
    ap.add_argument("--identity-dtype", default="float32")
    ap.add_argument("--no-identity-trace", action="store_true",
                    help="skip the layer-by-layer comparison of the forced prompt's MoE expert choices")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impl", default=None)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="8 simulated CPU devices (smoke runs)")
    ap.add_argument("--xla-autotune", type=int, default=None,
                    help="XLA's GPU autotune level (0 skips GEMM autotuning, which shortens the compile of each "
                         "identity engine; DCP = 1 and DCP = N run under the same level)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    apply_platform_flags(args.cpu, args.xla_autotune)  # jax is imported, but no backend started yet
    bc = DcpBenchConfig(preset=args.preset, num_layers=args.num_layers, tp=args.tp, dcp=args.dcp,
                        variants=tuple(args.variants.split(",")),
                        identity_variants=tuple(args.identity_variants.split(",")) if args.identity_variants else None,
                        identity_steps=args.identity_steps,
                        identity_prompt_len=args.identity_prompt_len, identity_batch=args.identity_batch,
                        identity_dtype=args.identity_dtype, identity_trace=not args.no_identity_trace,
                        input_len=args.input_len, output_len=args.output_len,
                        batch=args.batch, dtype=args.dtype, impl=args.impl, timing=not args.no_timing)
    res = run_dcp_bench(bc)
    if args.out:
        write_json(args.out, to_record(res, command_line(argv, script=__file__)))
    return 0 if all(r["identical"] for r in res["identity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
