"""Decode figures at 32K context (Triton and xla, B=32) and the engine-level Triton-vs-xla agreement next to
the bf16-vs-fp32 yardstick.

    PYTHONPATH=. python3 benchmarks/gpu_decode_diag.py OUTDIR
"""

import argparse
import os
import tempfile

import numpy as np

import glm_dsa
from benchmarks.bench_engine import BenchConfig, run_bench
from benchmarks.harness import command_line, record, write_json
from checkpoints.random import write_random_checkpoint


def main(argv=None):
    """Write OUTDIR/engine_agreement.json (a harness record: relative logit distances, one row per KV cache
    format), then run the decode benchmark once per impl."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUTDIR", help="folder for engine_agreement.json")
    args = ap.parse_args(argv)
    cfg = glm_dsa.configs.heads
    d = tempfile.mkdtemp()
    write_random_checkpoint(cfg, d, dtype="bfloat16", progress=False)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 200))
    res = {}
    ref32 = glm_dsa.load(d, dtype="float32", max_model_len=512, progress=False, impl="xla").logits(ids)

    def rel(x, y):
        return float(np.linalg.norm(x - y) / np.linalg.norm(y))
    for kv in ("bfloat16", "fp8_ds_mla"):
        a = glm_dsa.load(d, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=512, progress=False).logits(ids)
        b = glm_dsa.load(d, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=512, progress=False,
                         impl="xla").logits(ids)
        res[kv] = {"triton_vs_xla": rel(a, b), "xla_bf16_vs_fp32": rel(b, ref32), "triton_vs_fp32": rel(a, ref32),
                   "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).mean())}
        print(kv, res[kv], flush=True)
    write_json(os.path.join(args.out, "engine_agreement.json"),
               record([{"kv_cache": kv, **r} for kv, r in res.items()], command=command_line(argv, script=__file__)))
    for impl in ("triton", "xla"):
        run_bench(BenchConfig(preset="bench", impls=(impl,), end_to_end=False, decode_batches=(32,),
                              decode_context=32768))


if __name__ == "__main__":
    main()
