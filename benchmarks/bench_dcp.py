"""DCP on several GPUs (issue: multi-gpu): identity of DCP = N with DCP = 1, then QREP x comm-backend timings at
the seeds' shape, with parameter and cache bytes per device. See `glm_dsa.dcp_bench`.

    PYTHONPATH=. python3 benchmarks/bench_dcp.py --tp 4 --dcp 4 --out dcp.json            # on nvidia-h200-x4
    PYTHONPATH=. python3 benchmarks/bench_dcp.py --tp 2 --dcp 2 --no-timing --identity-dtype bfloat16  # x2
    PYTHONPATH=. python3 benchmarks/bench_dcp.py --preset tiny --tp 4 --dcp 4 --input-len 64 --cpu   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
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
    if args.xla_autotune is not None:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_gpu_autotune_level={args.xla_autotune}"
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    from glm_dsa.dcp_bench import DcpBenchConfig, run_dcp_bench
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
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(r["identical"] for r in res["identity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
