"""MTP speculative decoding (docs/math.md §12): the cost of a draft + verify step against a plain decode step, and
tokens/s at batch 1, with random weights (a preset plus a random nextn layer) and caches filled with random rows.

1. Step cost at each batch B and draft count k: one plain decode step (B rows, sampling included) and one
   speculative step (B x (k + 1) verify rows, acceptance, the nextn layer over those rows and k - 1 chained draft
   rows), each the median of timed calls with the caches donated from call to call.
2. Tokens/s at B = 1: a plain generate, and a speculative generate fed oracle drafts (the plain run's own greedy
   continuation: every draft accepted, the upper bound k + 1 tokens per step); and, from the measured B = 1 step
   times, tokens/s projected for mean accepted lengths 1.6 / 2.5 / 3.5 (L tokens per speculative step).

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
from glm_dsa.engine import Engine, pack_step_inputs
from glm_dsa.init import init_params
from glm_dsa.mtp import init_mtp_params
from glm_dsa.paged_cache import pages_needed
from sharding import ParallelConfig

PROJECTED_LENGTHS = (1.6, 2.5, 3.5)


def _fill_random(tree, key):
    """Every cache filled with random rows (a context without a prefill)."""
    leaves, td = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    fill = [jax.jit(lambda c, k: jax.random.normal(k, c.shape, jnp.float32).astype(c.dtype), donate_argnums=0,
                    out_shardings=c.sharding)(c, k) for c, k in zip(leaves, keys)]
    return jax.tree.unflatten(td, fill)


def _tables(eng: Engine, b: int, pp: int) -> None:
    """Requests 0..b-1 hold pages 1 + i pp .. in the engine's device block table."""
    t = np.zeros(np.asarray(eng._tables).shape, np.int32)
    t[:b, :pp] = (1 + np.arange(b * pp, dtype=np.int32)).reshape(b, pp)
    eng._tables = jax.device_put(t, eng._tables.sharding)


def step_times(eng: Engine, b: int, ctx: int, k: int, rng) -> tuple[float, float]:
    """(plain decode step seconds, speculative step seconds) at batch b, context ctx, k drafts, greedy."""
    s, vocab = eng.max_num_seqs, eng.config.vocab_size
    pp = pages_needed(ctx + 2 * k + 2, eng.block_size, eng.parallel.dcp, eng.parallel.interleave)
    _tables(eng, b, pp)
    nr = eng._n_out
    plan_rows = np.full(nr, s, np.int32)
    plan_rows[:b] = np.arange(b)
    resets = np.zeros(s + 1, np.int32)
    width = eng.pages_per_seq

    # plain: one row per request at position ctx - 1, sampled greedily
    t = max(16, 1 << (b - 1).bit_length())
    rows = np.zeros((4, t), np.int32)
    rows[1:, b:] = -1
    rows[2, b:] = 0
    rows[0, :b], rows[1, :b], rows[2, :b] = rng.integers(0, vocab, b), ctx - 1, np.arange(b)
    upd = np.full((3, t), s + 1, np.int32)
    su = np.zeros((5, nr), np.uint32)
    su[0, :b] = np.arange(b)
    sf = np.zeros((2, nr), np.float32)
    sf[1] = 1.0
    prev = jax.device_put(np.zeros(nr, np.int32), eng._tables.sharding)

    def plain():
        buffers, sizes = pack_step_inputs(rows, plan_rows, upd, resets, su, sf)
        out, eng.caches, eng._tables = eng._serve_step(eng.params, eng.caches, eng._tables, *buffers, prev,
                                                       width=width, greedy=True, sizes=sizes)
        return out

    # speculative: rows [x, d_1 .. d_k] per request at positions ctx - 1 .., every draft verified
    n = b * (k + 1)
    t = max(16, 1 << (n - 1).bit_length())
    srows = np.zeros((4, t), np.int32)
    srows[1, n:] = -1
    srows[3] = -1
    srows[0, :n] = rng.integers(0, vocab, n)
    srows[1, :n] = ctx - 1 + np.tile(np.arange(k + 1), b)
    srows[2, :n] = np.repeat(np.arange(b), k + 1)
    supd = np.full((3, t), s + 1, np.int32)
    vrows = np.full((nr, k + 1), -1, np.int32)
    vrows[:b] = np.arange(n).reshape(b, k + 1)
    gmeta = np.zeros((3, nr), np.int32)
    gmeta[:, :b] = np.stack([np.full(b, k), np.arange(b), np.full(b, pp)])
    gmeta[1, b:] = s
    gsu = np.zeros((4, nr), np.uint32)
    gsf = np.zeros((2, nr), np.float32)
    gsf[1] = 1.0
    spec = eng.spec

    def speculative():
        out, eng.caches, spec.caches, eng._tables, spec.draft_probs = spec._step(
            eng.params, spec.mtp_params, eng.caches, spec.caches, eng._tables, spec.draft_probs, srows, plan_rows,
            supd, resets, vrows, gmeta, gsu, gsf, width=width, greedy=True)
        return out

    return median_seconds(plain, warmup=2, reps=10), median_seconds(speculative, warmup=2, reps=10)


def oracle_tokens_per_s(eng: Engine, prompt_len: int, new: int, rng) -> tuple[float, float, dict]:
    """(plain tokens/s, oracle-draft speculative tokens/s, its acceptance summary) of one greedy request."""
    prompt = [rng.integers(2, eng.config.vocab_size, prompt_len).tolist()]
    spec, eng.spec = eng.spec, None  # the plain loop first: the same engine, same caches, no drafts
    eng.scheduler.lookahead = 0
    eng.generate(prompt, max_new_tokens=2, stop_token_ids=[])  # compile
    ref = eng.generate(prompt, max_new_tokens=new, stop_token_ids=[])[0]
    plain = new / (eng.last_timings["decode_s"] + eng.last_timings["prefill_s"])
    eng.spec, eng.scheduler.lookahead = spec, spec.k
    spec.oracle = lambda r: ref[len(r.output): len(r.output) + spec.k]
    eng.generate(prompt, max_new_tokens=new, stop_token_ids=[])  # compile every shape the run takes
    got = eng.generate(prompt, max_new_tokens=new, stop_token_ids=[])[0]
    spec.oracle = None
    if got != ref:
        raise RuntimeError("oracle-draft speculative decoding changed the greedy tokens")
    t = eng.last_timings
    return plain, new / (t["decode_s"] + t["prefill_s"]), t


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
    rows, res = [], {"preset": args.preset, "context": ctx, "impl": impl}
    plain_b1 = {}
    for k in ks:
        length = max(ctx, args.input_len) + 2 * k + 2 + args.output_len
        eng = Engine(cfg, params, parallel=par, dtype=args.dtype, max_model_len=length, max_num_seqs=max(batches),
                     impl=impl, num_speculative_tokens=k, mtp_params=mtp,
                     num_pages=max(batches) * pages_needed(length, 16, par.dcp) + 1)
        eng.caches = _fill_random(eng.caches, jax.random.key(1))
        eng.spec.caches = _fill_random(eng.spec.caches, jax.random.key(2))
        for b in batches:
            plain_s, spec_s = step_times(eng, b, ctx, k, rng)
            row = {"B": b, "k": k, "plain_ms": 1e3 * plain_s, "spec_ms": 1e3 * spec_s, "ratio": spec_s / plain_s,
                   "break_even_length": spec_s / plain_s}
            log(f"B={b:3d} k={k}: plain decode {row['plain_ms']:8.3f} ms, draft+verify {row['spec_ms']:8.3f} ms "
                f"({row['ratio']:.2f}x: pays off above {row['ratio']:.2f} tokens per step)")
            rows.append(row)
            if b == 1:
                plain_b1[k] = (plain_s, spec_s)
                for length in PROJECTED_LENGTHS:
                    if length <= k + 1:
                        row[f"projected_tok_s_L{length}"] = length / spec_s
        if 1 in batches and not args.no_end_to_end:
            eng.caches = _fill_random(eng.caches, jax.random.key(3))  # the step timing's tables are replaced
            plain_tps, oracle_tps, t = oracle_tokens_per_s(eng, args.input_len, args.output_len, rng)
            r = {"B": 1, "k": k, "plain_tok_s": plain_tps, "oracle_tok_s": oracle_tps,
                 "oracle_mean_accepted_length": t["spec_mean_accepted_length"]}
            log(f"B=1 k={k}: generate {args.output_len} tokens: plain {plain_tps:.1f} tok/s, oracle drafts "
                f"{oracle_tps:.1f} tok/s (mean accepted length {t['spec_mean_accepted_length']:.2f})")
            rows.append(r)
        del eng
    for k, (plain_s, spec_s) in plain_b1.items():
        proj = ", ".join(f"L={x}: {x / spec_s:.1f} tok/s ({x * plain_s / spec_s:.2f}x)"
                         for x in PROJECTED_LENGTHS if x <= k + 1)
        log(f"B=1 k={k}: plain {1 / plain_s:.1f} tok/s; projected {proj}")
    res["rows"] = rows
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags (`python -m glm_dsa bench --num-speculative-tokens ...` takes the bench flags it shares)."""
    from glm_dsa.configs import PRESETS
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
