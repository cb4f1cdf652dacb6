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
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from sharding import ParallelConfig
from sharding.parallel import QREP_ENV

from .bench import peak_bytes
from .engine import Engine
from .init import init_params

VARIANTS = ("qrep:a2a", "qrep:ag_rs", "noqrep:a2a", "noqrep:ag_rs")


@dataclasses.dataclass
class DcpBenchConfig:
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
    from . import configs
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.replace(num_hidden_layers=bc.num_layers)
    return cfg


def _parallel(bc: DcpBenchConfig, variant: str | None) -> ParallelConfig:
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
            t0 = time.perf_counter()
            eng.generate(prompts, bc.output_len, stop_token_ids=[])
            total = time.perf_counter() - t0
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
