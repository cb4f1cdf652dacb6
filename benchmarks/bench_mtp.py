"""MTP speculative decoding (docs/math.md §12): the cost of a draft + verify step against a plain decode step, and
tokens/s at batch 1, with random weights (a preset plus a random nextn layer) and caches filled with random rows.

1. Step cost at each batch B and draft count k, every row a distinct random token (as `bench_engine`'s decode
   rows: a MoE step reads the weights of the experts its rows route to, so identical rows would read 8 experts
   whatever B is):
   - plain: one decode step of B rows (sampling included), as the plain serving loop runs it (consecutive
     calls blocked once at the end: the loop overlaps a step's dispatch with the previous one's execution);
   - verify: the same plain step over the speculative step's B x (k + 1) rows [x, d_1 .. d_k] (the target's
     share of a speculative step: more rows route to more experts in every MoE layer);
   - draft + verify: the speculative step (verify, acceptance, the nextn layer over every row, k - 1 chained
     draft rows), timed the same way (device cost), and as a synchronous turn (each call blocked and its results
     read back: a speculative turn waits for its accepted counts before planning the next). draft = spec - verify.
2. Tokens/s at B = 1: a plain generate, and a speculative generate fed oracle drafts (the plain run's own greedy
   continuation: every draft accepted, the upper bound k + 1 tokens per step); and tokens/s projected for mean
   accepted lengths 1.6 / 2.5 / 3.5 (L tokens per turn: L / turn time; only L <= k + 1 is possible).

One engine serves every k (the nextn layer's state is swapped per k), so the plain shapes compile once.

    python -m glm_dsa bench --num-speculative-tokens 1,3,5 [--preset bench --decode-batches 1,8,32 ...]
    PYTHONPATH=. python3 benchmarks/bench_mtp.py --help
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import command_line, median_seconds, record, write_json
from glm_dsa.serving import host_buffer
from glm_dsa.serving.engine import Engine
from glm_dsa.model.random_init import init_params
from glm_dsa.model.mtp import init_mtp_params
from glm_dsa.model.paged_cache import pages_needed
from glm_dsa.serving.spec_decoder import SpecDecoder
from sharding import ParallelConfig

PROJECTED_LENGTHS = (1.6, 2.5, 3.5)
#: pipelined timing (the plain loop's way, and the device cost of a step): samples of consecutive calls
PIPELINED = dict(warmup=2, reps=5, calls_per_rep=4)


def _fill_random(tree, key):
    """Every cache filled with random rows (a context without a prefill)."""
    leaves, td = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    fill = [jax.jit(lambda c, k: jax.random.normal(k, c.shape, jnp.float32).astype(c.dtype), donate_argnums=0,
                    out_shardings=c.sharding)(c, k) for c, k in zip(leaves, keys)]
    return jax.tree.unflatten(td, fill)


def _tables(eng: Engine, b: int, pp: int) -> None:
    """Requests 0..b-1 hold pages 1 + i pp .. in the engine's device block table."""
    t = np.zeros(np.asarray(eng.runner.tables).shape, np.int32)
    t[:b, :pp] = (1 + np.arange(b * pp, dtype=np.int32)).reshape(b, pp)
    eng.runner.tables = jax.device_put(t, eng.runner.tables.sharding)


def _bucket16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def plain_rows(token, pos, req) -> np.ndarray:
    """int32 [4, T] rows of a plain step (`runner.serve_step`): the given tokens, positions and requests, src -1
    (every token from the host: src >= 0 would read the previous step's id instead, the same for every row);
    padding rows to the bucket: token 0, position -1 (write nothing), request 0, src -1."""
    n = len(token)
    rows = np.zeros((4, _bucket16(n)), np.int32)
    rows[1:, n:] = -1
    rows[2, n:] = 0
    rows[0, :n], rows[1, :n], rows[2, :n], rows[3, :n] = token, pos, req, -1
    return rows


def spec_inputs(b: int, k: int, ctx: int, pp: int, nr: int, s: int, vocab: int, rng) -> tuple:
    """The host arrays of a greedy speculative step (`speculative.spec_serve_step`, less the block-table ones) for
    b requests at context ctx, each verifying k drafts (distinct random tokens): (rows, vrows, gmeta, su, sf)."""
    n = b * (k + 1)
    rows = np.zeros((4, _bucket16(n)), np.int32)
    rows[1, n:] = -1
    rows[3] = -1
    rows[0, :n] = rng.integers(0, vocab, n)
    rows[1, :n] = ctx - 1 + np.tile(np.arange(k + 1), b)
    rows[2, :n] = np.repeat(np.arange(b), k + 1)
    vrows = np.full((nr, k + 1), -1, np.int32)
    vrows[:b] = np.arange(n).reshape(b, k + 1)
    gmeta = np.zeros((3, nr), np.int32)
    gmeta[:, :b] = np.stack([np.full(b, k), np.arange(b), np.full(b, pp)])
    gmeta[1, b:] = s
    su = np.zeros((4, nr), np.uint32)
    sf = np.zeros((2, nr), np.float32)
    sf[1] = 1.0
    return rows, vrows, gmeta, su, sf


def step_times(eng: Engine, b: int, ctx: int, k: int, rng) -> dict:
    """Milliseconds of the plain step over the speculative step's rows ("verify_ms"), of the speculative step
    pipelined ("spec_ms") and as a synchronous turn ("turn_ms"), at batch b, context ctx, k drafts, greedy."""
    s, vocab, nr, width = eng.max_num_seqs, eng.config.vocab_size, eng.runner.n_out, eng.pages_per_seq
    pp = pages_needed(ctx + 2 * k + 2, eng.block_size, eng.parallel.dcp, eng.parallel.interleave)
    _tables(eng, b, pp)
    plan_rows = np.full(nr, s, np.int32)
    plan_rows[:b] = np.arange(b)
    resets = np.zeros(s + 1, np.int32)
    rows, vrows, gmeta, su, sf = spec_inputs(b, k, ctx, pp, nr, s, vocab, rng)
    n = b * (k + 1)
    upd = np.full((3, rows.shape[1]), s + 1, np.int32)
    arrays = (rows, plan_rows, upd, resets, vrows, gmeta, su, sf)
    spec = eng.spec

    def speculative():
        return spec.launch(arrays, width=width, greedy=True)

    # the target alone over the same rows: each request samples its last row
    vsu = np.zeros((5, nr), np.uint32)
    vsu[0, :b] = vrows[:b, k]
    verify = _plain_call(eng, plain_rows(rows[0, :n], rows[1, :n], rows[2, :n]), plan_rows, resets, vsu)
    return {"verify_ms": 1e3 * median_seconds(verify, **PIPELINED),
            "spec_ms": 1e3 * median_seconds(speculative, **PIPELINED),
            "turn_ms": 1e3 * median_seconds(lambda: np.asarray(speculative()), warmup=1, reps=10)}


def _plain_call(eng: Engine, rows, plan_rows, resets, su):
    """A call of the engine's compiled plain step (`runner.serve_step`, greedy) on these inputs."""
    nr = len(plan_rows)
    sf = np.zeros((2, nr), np.float32)
    sf[1] = 1.0
    upd = np.full((3, rows.shape[1]), eng.max_num_seqs + 1, np.int32)
    prev = jax.device_put(np.zeros(nr, np.int32), eng.runner.tables.sharding)

    def call():
        packed, layout = host_buffer.pack(rows, plan_rows, upd, resets, su, sf)
        run = eng.runner
        out, run.caches, run.tables = run.serve_step(run.params, run.caches, run.tables, packed, prev,
                                                     width=eng.pages_per_seq, greedy=True, layout=layout)
        return out
    return call


def plain_step_ms(eng: Engine, b: int, ctx: int, rng) -> float:
    """Milliseconds of one plain decode step of b rows (distinct random tokens at position ctx - 1), pipelined."""
    s, nr = eng.max_num_seqs, eng.runner.n_out
    _tables(eng, b, pages_needed(ctx + 1, eng.block_size, eng.parallel.dcp, eng.parallel.interleave))
    plan_rows = np.full(nr, s, np.int32)
    plan_rows[:b] = np.arange(b)
    su = np.zeros((5, nr), np.uint32)
    su[0, :b] = np.arange(b)
    rows = plain_rows(rng.integers(0, eng.config.vocab_size, b), np.full(b, ctx - 1), np.arange(b))
    return 1e3 * median_seconds(_plain_call(eng, rows, plan_rows, np.zeros(s + 1, np.int32), su), **PIPELINED)


def use_drafts(eng: Engine, mtp_params, k: int) -> None:
    """Make `eng` draft k tokens per step (a fresh nextn-layer state; its caches filled with random rows)."""
    if eng.spec is None or eng.spec.k != k:
        eng.spec = None  # the previous state's caches go first
        eng.spec = SpecDecoder(eng, mtp_params, k)
        eng.spec.caches = _fill_random(eng.spec.caches, jax.random.key(2))
    eng.num_speculative_tokens = eng.scheduler.lookahead = k


def plain_tokens_per_s(eng: Engine, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """(tokens/s, the tokens) of a plain greedy generate of one request (after a compiling run)."""
    spec, eng.spec = eng.spec, None
    lookahead, eng.scheduler.lookahead = eng.scheduler.lookahead, 0
    try:
        eng.generate([prompt], max_new_tokens=2, stop_token_ids=[])  # compile
        ref = eng.generate([prompt], max_new_tokens=new, stop_token_ids=[])[0]
    finally:
        eng.spec, eng.scheduler.lookahead = spec, lookahead
    return new / (eng.last_timings["decode_s"] + eng.last_timings["prefill_s"]), ref


def oracle_tokens_per_s(eng: Engine, prompt: list[int], ref: list[int]) -> tuple[float, dict]:
    """(tokens/s, timings with the acceptance summary) of a speculative greedy generate of one request fed oracle
    drafts (`ref`, the plain continuation: every draft accepted); the tokens must equal `ref`."""
    spec, new = eng.spec, len(ref)
    spec.oracle = lambda r: ref[len(r.output): len(r.output) + spec.k]
    try:
        eng.generate([prompt], max_new_tokens=new, stop_token_ids=[])  # compile every shape the run takes
        got = eng.generate([prompt], max_new_tokens=new, stop_token_ids=[])[0]
    finally:
        spec.oracle = None
    if got != ref:
        raise RuntimeError("oracle-draft speculative decoding changed the greedy tokens")
    t = eng.last_timings
    return new / (t["decode_s"] + t["prefill_s"]), t


def projections(turn_s: float, plain_s: float, k: int) -> dict:
    """Tokens/s at B = 1 for each mean accepted length L of PROJECTED_LENGTHS (L / turn seconds) and its speed-up
    over plain decode; None where L > k + 1 (more than k drafts plus one cannot be accepted)."""
    out = {}
    for length in PROJECTED_LENGTHS:
        ok = length <= k + 1
        out[f"projected_tok_s_L{length}"] = length / turn_s if ok else None
        out[f"projected_speedup_L{length}"] = length * plain_s / turn_s if ok else None
    return out


def run(args, log=print) -> dict:
    from glm_dsa import configs
    cfg = configs.get(args.preset)
    if args.num_layers:
        cfg = cfg.with_depth(args.num_layers)
    par = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                         decode_context_parallel_size=args.decode_context_parallel_size)
    ks = [int(x) for x in str(args.num_speculative_tokens).split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    ctx = args.decode_context or 2048
    rng = np.random.default_rng(args.seed)
    params = init_params(cfg, seed=args.seed, dtype=args.dtype, parallel=par,
                         quantization=getattr(args, "quantization", None))  # the target model; MTP stays as drawn
    mtp = init_mtp_params(cfg, seed=args.seed + 1, dtype=args.dtype, parallel=par)
    impl = args.impls.split(",")[0] if args.impls else None
    res = {"preset": args.preset, "context": ctx, "impl": impl}
    length = max(ctx, args.input_len) + 2 * max(ks) + 2 + args.output_len
    eng = Engine(cfg, params, parallel=par, dtype=args.dtype, max_model_len=length, max_num_seqs=max(batches),
                 impl=impl, num_speculative_tokens=max(ks), mtp_params=mtp,
                 num_pages=max(batches) * pages_needed(length, 16, par.dcp) + 1)
    eng.caches = _fill_random(eng.caches, jax.random.key(1))
    plain = {b: plain_step_ms(eng, b, ctx, rng) for b in batches}
    for b in batches:
        log(f"B={b:3d}: plain decode step {plain[b]:8.3f} ms")
    e2e = 1 in batches and not args.no_end_to_end
    if e2e:
        prompt = rng.integers(2, cfg.vocab_size, args.input_len).tolist()
        plain_tps, ref = plain_tokens_per_s(eng, prompt, args.output_len)
        log(f"B=1: generate {args.output_len} tokens: plain {plain_tps:.1f} tok/s")
    rows = []
    for k in ks:
        use_drafts(eng, mtp, k)
        for b in batches:
            row = {"B": b, "k": k, "plain_ms": plain[b], **step_times(eng, b, ctx, k, rng)}
            row["draft_ms"] = row["spec_ms"] - row["verify_ms"]
            row["ratio"] = row["spec_ms"] / plain[b]
            row["turn_ratio"] = row["turn_ms"] / plain[b]  # the mean accepted length a turn must reach to pay off
            line = (f"B={b:3d} k={k}: plain {plain[b]:8.3f} ms | verify {row['verify_ms']:8.3f} + draft "
                    f"{row['draft_ms']:7.3f} = draft+verify {row['spec_ms']:8.3f} ms ({row['ratio']:.2f}x plain) | "
                    f"synchronous turn {row['turn_ms']:8.3f} ms ({row['turn_ratio']:.2f}x)")
            if b == 1:
                row.update(projections(1e-3 * row["turn_ms"], 1e-3 * plain[b], k))
                line += "\n      projected at B=1: " + ", ".join(
                    f"L={x}: " + (f"{row[f'projected_tok_s_L{x}']:.1f} tok/s ({row[f'projected_speedup_L{x}']:.2f}x)"
                                  if row[f"projected_tok_s_L{x}"] is not None else "n/a (> k + 1)")
                    for x in PROJECTED_LENGTHS) + f"; plain {1e3 / plain[b]:.1f} tok/s"
            if b == 1 and e2e:
                oracle_tps, t = oracle_tokens_per_s(eng, prompt, ref)
                row.update(plain_tok_s=plain_tps, oracle_tok_s=oracle_tps,
                           oracle_mean_accepted_length=t["spec_mean_accepted_length"])
                line += (f"\n      generate {args.output_len} tokens: plain {plain_tps:.1f} tok/s, oracle drafts "
                         f"{oracle_tps:.1f} tok/s (mean accepted length {t['spec_mean_accepted_length']:.2f})")
            log(line)
            rows.append(row)
    res["rows"] = rows
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags (`python -m glm_dsa bench --num-speculative-tokens ...` takes the bench flags it shares)."""
    from glm_dsa.model.presets import PRESETS
    p.add_argument("--num-speculative-tokens", default="1,3,5", help="comma-separated draft counts k")
    p.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--decode-batches", default="1,8,32")
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=64, help="prompt of the B=1 tokens/s runs")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated by the B=1 tokens/s runs")
    p.add_argument("--impls", default="", help="op implementation (the first one; default: the platform's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-end-to-end", action="store_true", help="skip the B=1 tokens/s runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    res = run(args)
    if args.json_out:
        write_json(args.json_out, record(res.pop("rows"), command=command, **res))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv), command=command_line(argv, script=__file__))


if __name__ == "__main__":
    sys.exit(main())
