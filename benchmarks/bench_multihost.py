"""Several processes against one: the same model, prompts and TP layout run (a) in one process over all its GPUs and
(b) as N processes of one GPU each under JAX's multi-controller runtime (how several hosts run it), compared token
for token, with the decode time per step of each.

    PYTHONPATH=. python3 benchmarks/bench_multihost.py --preset heads --num-layers 2 --tp 2 --out multihost.json
    PYTHONPATH=. python3 benchmarks/bench_multihost.py --cpu --preset tiny --tp 2 --input-len 16 --output-len 4

Each child process draws the same random weights (`glm_dsa.init_params`, one seed) on the mesh, compiles what the
generate needs (`Engine.warmup`), then times `Engine.generate` of `--batch` prompts of `--input-len` tokens and
`--output-len` new tokens (greedy): its decode ms/step includes the host's share of each step. Then, for each of
`--decode-batches` (none by default: each batch size compiles one more step), the decode step alone as
`python -m glm_dsa bench` times it (caches of random rows at `--decode-context`, 10 steps back to back).

What a run compiles, per process: one small program per parameter (`init_params`), the prefill and decode steps
of the generate, and one decode step per `--decode-batches` entry; the two runs (1 process, then N) compile all
of it each. Every phase prints a line with the wall time and the seconds since the process started (stderr), so
a slow run shows where its time went.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_T0 = time.perf_counter()


def _say(who: str, message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:6.1f}s] {who}: {message}", file=sys.stderr,
          flush=True)


def _child(args) -> None:
    """One process of a run: `args.process_id` of `args.num_processes` (0 of 1: the single-process run)."""
    n, me = args.num_processes, args.process_id
    who = f"1 process x {args.tp} devices" if n == 1 else f"process {me} of {n}"
    if n > 1:
        from glm_dsa import distributed
        distributed.initialize(f"127.0.0.1:{args.port}", n, me, init_timeout_s=300, heartbeat_timeout_s=30)
    import jax
    import numpy as np

    import glm_dsa
    from benchmarks.bench_engine import decode_batch, decode_engine, decode_ms_per_step
    from glm_dsa import ParallelConfig, configs, distributed

    _say(who, f"joined: {jax.device_count()} devices, {jax.local_device_count()} here "
              f"({jax.local_devices()[0].device_kind})")
    cfg = configs.get(args.preset)
    if args.num_layers:
        cfg = cfg.with_depth(args.num_layers)
    par = ParallelConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=args.dcp)
    t = time.perf_counter()
    params = glm_dsa.init_params(cfg, seed=0, dtype=args.dtype, parallel=par)
    jax.block_until_ready(params)
    _say(who, f"init_params: {len(jax.tree.leaves(params))} parameters of {cfg.num_hidden_layers} layers in "
              f"{time.perf_counter() - t:.1f} s (one compile each)")
    eng = glm_dsa.Engine(cfg, params, parallel=par, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
                         max_num_seqs=args.batch, impl=args.impl)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.input_len)).tolist()
    t = time.perf_counter()
    eng.warmup(args.batch, args.input_len, args.output_len)  # every prefill and decode shape the generate uses
    _say(who, f"warmup (compiles of the generate's steps): {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    tokens = eng.generate(prompts, max_new_tokens=args.output_len, stop_token_ids=[])
    tm = eng.last_timings
    e2e_ms = 1e3 * tm["decode_s"] / max(tm["decode_steps"], 1)
    _say(who, f"generate: {time.perf_counter() - t:.2f} s, prefill {tm['prefill_s']:.3f} s, decode {e2e_ms:.3f} "
              f"ms/step ({tm['decode_steps']} steps)")
    result = {"tokens": tokens, "prefill_s": tm["prefill_s"], "decode_s": tm["decode_s"],
              "decode_steps": tm["decode_steps"], "decode_ms_per_step": e2e_ms,
              "devices": [str(d) for d in eng.mesh.devices.flat], "decode_step_ms": {}}
    impl, ctx = eng.impl, args.decode_context or args.input_len
    del eng  # its caches, before the decode runs' own
    for b in args.decode_batches:
        t = time.perf_counter()
        deng = decode_engine(cfg, params, par, args.dtype, impl, b, ctx)
        batch = decode_batch(b, ctx, deng.block_size, cfg.vocab_size, rng, dcp=deng.parallel.dcp)
        ms = decode_ms_per_step(deng, batch)
        result["decode_step_ms"][b] = ms
        _say(who, f"decode step B={b} at context {ctx}: {ms:.3f} ms/step ({time.perf_counter() - t:.1f} s with "
                  "its compile)")
        del deng
    if distributed.is_primary():
        with open(args.child_out, "w") as f:
            json.dump(result, f)
    _say(who, "done")


def _run(args, n: int, out: str) -> dict:
    """Launch the run of `n` processes (1: one process over every device) and return process 0's results. A
    process that fails or outlives `--timeout` ends the run: the others are killed, not left waiting."""
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
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(f"the {n}-process run failed: process {failed[0]} exited "
                                   f"{procs[failed[0]].returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {n}-process run did not finish within --timeout {args.timeout:g} s")
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"the {n}-process run failed: exit codes {codes}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
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
    ap.add_argument("--impl", default=None, help="op implementation (default: triton on GPUs, xla elsewhere)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--decode-batches", default="", help="comma-separated batch sizes of the decode step timed "
                    "alone, as `python -m glm_dsa bench` does (each compiles one more step; default: none)")
    ap.add_argument("--decode-context", type=int, default=None, help="their context length (default: --input-len)")
    ap.add_argument("--cpu", action="store_true", help="CPU devices (a smoke run)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each of the two runs may take")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    if args.child:
        try:
            _child(args)
        except (Exception, KeyboardInterrupt):
            if args.num_processes > 1:  # not through JAX's shutdown barrier: the peers wait in a collective
                import traceback
                traceback.print_exc()
                from glm_dsa.distributed import exit_now
                exit_now(1)
            raise
        return 0
    keep = ["--preset", args.preset, "--tp", str(args.tp), "--dcp", str(args.dcp), "--dtype", args.dtype,
            "--batch", str(args.batch), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--decode-batches", ",".join(map(str, args.decode_batches))]
    args.passthrough = keep + sum([[f"--{k.replace('_', '-')}", str(v)] for k, v in
                                   [("num_layers", args.num_layers), ("impl", args.impl),
                                    ("decode_context", args.decode_context)] if v], [])
    from benchmarks.harness import command_line, record, write_json
    with tempfile.TemporaryDirectory() as tmp:
        _say("bench_multihost", f"run 1: 1 process x {args.tp} devices")
        one = _run(args, 1, os.path.join(tmp, "one.json"))
        _say("bench_multihost", f"run 2: {args.tp} processes x 1 device")
        many = _run(args, args.tp, os.path.join(tmp, "many.json"))
    same = one["tokens"] == many["tokens"]
    rows = [dict(run=f"1 process x {args.tp} devices", **{k: one[k] for k in one if k != "tokens"}),
            dict(run=f"{args.tp} processes x 1 device", **{k: many[k] for k in many if k != "tokens"})]
    for r in rows:
        steps = ", ".join(f"B={b} {ms:.3f}" for b, ms in r["decode_step_ms"].items())
        print(f"{r['run']:>26}: generate decode {r['decode_ms_per_step']:.3f} ms/step ({r['decode_steps']} steps), "
              f"prefill {r['prefill_s']:.3f} s" + (f"; decode step alone (ms): {steps}" if steps else ""))
    n_tok = sum(len(t) for t in one["tokens"])
    print(f"tokens identical: {same} ({n_tok} tokens)")
    _say("bench_multihost", "done")
    if args.out:
        write_json(args.out, record(rows, command=command_line(argv, __file__), tokens_identical=same,
                                    tokens=n_tok))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
