"""Several processes against one: the same model, prompts and TP layout run (a) in one process over all its GPUs and
(b) as N processes of one GPU each under JAX's multi-controller runtime (how several hosts run it), compared token
for token, with the decode time per step of each.

    PYTHONPATH=. python3 benchmarks/bench_multihost.py --preset heads --tp 2 --out multihost.json
    PYTHONPATH=. python3 benchmarks/bench_multihost.py --cpu --preset tiny --tp 2 --input-len 16 --output-len 4

Each child process draws the same random weights (`glm_dsa.init_params`, one seed) on the mesh, warms up, then
times `Engine.generate` of `--batch` prompts of `--input-len` tokens and `--output-len` new tokens (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(args) -> None:
    """One process of a run: `args.process_id` of `args.num_processes` (0 of 1: the single-process run)."""
    if args.num_processes > 1:
        from glm_dsa import distributed
        distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id, init_timeout_s=300)
    import numpy as np

    import glm_dsa
    from glm_dsa import ParallelConfig, configs, distributed

    cfg = configs.get(args.preset)
    if args.num_layers:
        cfg = cfg.with_depth(args.num_layers)
    par = ParallelConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=args.dcp)
    params = glm_dsa.init_params(cfg, seed=0, dtype=args.dtype, parallel=par)
    eng = glm_dsa.Engine(cfg, params, parallel=par, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
                         max_num_seqs=args.batch)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.input_len)).tolist()
    eng.generate(prompts, max_new_tokens=2, stop_token_ids=[])  # compile prefill and decode shapes
    tokens = eng.generate(prompts, max_new_tokens=args.output_len, stop_token_ids=[])
    t = eng.last_timings
    if distributed.is_primary():
        with open(args.child_out, "w") as f:
            json.dump({"tokens": tokens, "prefill_s": t["prefill_s"], "decode_s": t["decode_s"],
                       "decode_steps": t["decode_steps"],
                       "decode_ms_per_step": 1e3 * t["decode_s"] / max(t["decode_steps"], 1),
                       "devices": [str(d) for d in eng.mesh.devices.flat]}, f)


def _run(args, n: int, out: str) -> dict:
    """Launch the run of `n` processes (1: one process over every device) and return process 0's results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(n):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([_ROOT, env.get("PYTHONPATH", "")])
        if args.cpu:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.tp // n}"
        elif n > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i)  # one GPU per process, as one GPU per host would be
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--num-processes", str(n), "--process-id", str(i),
               "--port", str(port), "--child-out", out] + args.passthrough
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"the {n}-process run failed: exit codes {codes}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    """Run (a) one process over `--tp` devices and (b) `--tp` processes of one device; compare and time them."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="heads")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="CPU devices (a smoke run)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    keep = ["--preset", args.preset, "--tp", str(args.tp), "--dcp", str(args.dcp), "--dtype", args.dtype,
            "--batch", str(args.batch), "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    args.passthrough = keep + (["--num-layers", str(args.num_layers)] if args.num_layers else [])
    from benchmarks.harness import command_line, record, write_json
    with tempfile.TemporaryDirectory() as tmp:
        one = _run(args, 1, os.path.join(tmp, "one.json"))
        many = _run(args, args.tp, os.path.join(tmp, "many.json"))
    same = one["tokens"] == many["tokens"]
    rows = [dict(run=f"1 process x {args.tp} devices", **{k: one[k] for k in one if k != "tokens"}),
            dict(run=f"{args.tp} processes x 1 device", **{k: many[k] for k in many if k != "tokens"})]
    for r in rows:
        print(f"{r['run']:>26}: decode {r['decode_ms_per_step']:.3f} ms/step ({r['decode_steps']} steps), "
              f"prefill {r['prefill_s']:.3f} s")
    n_tok = sum(len(t) for t in one["tokens"])
    print(f"tokens identical: {same} ({n_tok} tokens)")
    if args.out:
        write_json(args.out, record(rows, command=command_line(argv, __file__), tokens_identical=same,
                                    tokens=n_tok))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
