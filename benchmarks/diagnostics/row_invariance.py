"""Which ops give a decode row the same bits whatever the step's row count (BENCHMARKS.md, batch-invariant mode's
cost).

Batch-invariant mode pads a decode step to the power-of-two bucket of its rows (8 to
`kernels.registry.INVARIANT_STEP_ROWS`), which needs every op to give a row the same bits at each bucket (padding
every decode step to 256 rows instead cost 1.34x the default mode's step at B = 32 on an H100). This diagnostic
asks which ops do: one target decode row (its token, position and context pages fixed) is computed in steps of T
rows for each T of --rows (each a decode step of a kind of at most 256 rows: its XLA products at 256), the other
rows other requests' decode rows, from the same random weights and caches. Per T it reports whether the target's
logits are bitwise those of the first T, and per layer the first intermediate of `glm_dsa.debug.trace` (model
order) whose target row differs:

    PYTHONPATH=. python3 benchmarks/diagnostics/row_invariance.py --preset bench --quantization fp8 \\
        --rows 8,32,128,256 --out rows.json

--batch-invariant (default) takes the mode's decode-step choices (fixed per-row forms and launch configs); --default
the default mode's. The tracer adds outputs to the program, which can change XLA's fusions: the traced
intermediates say where rows part in the traced program, the untraced logits are the verdict for the real step.
Rows: {"T", "logits_equal", "logits_max_abs_diff", "first_difference": {layer: name}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

TARGET_TOKEN = 1  # the target row's token id (any fixed id)


def target_batch(t: int, context: int, block_size: int, vocab_size: int, seed: int):
    """A decode step of `t` requests at `context` (`serving.benchmark.decode_batch`: request i holds pages
    i P + 1 .. (i + 1) P), request 0 the target: token TARGET_TOKEN, so its row is the same step input for every t."""
    import jax.numpy as jnp

    from glm_dsa.serving.benchmark import decode_batch
    batch = decode_batch(t, context, block_size, vocab_size, np.random.default_rng(seed))
    ids = np.asarray(batch.token_ids).copy()
    ids[0] = TARGET_TOKEN
    return dataclasses.replace(batch, token_ids=jnp.asarray(ids))


def _row(name: str, a):
    """The target's row of a traced tensor (token-major; DCP partials [N, T, ...]), set-valued ones sorted."""
    from glm_dsa.debug.trace import SET_VALUED
    a = np.asarray(a)
    r = a[:, 0] if name.split(".", 2)[-1].startswith("dcp.partial") else a[0]
    return np.sort(r) if name.endswith(SET_VALUED) else r


def compare(rows: list[int], *, cfg, params, caches, block_size: int, context: int, options, seed: int = 0,
            log=print) -> list[dict]:
    """Per T of `rows`: the target's logits against the first T's (bitwise, and the largest |difference|) and, per
    layer, the first traced intermediate whose target row differs (`first_difference`; empty when none does).
    `caches` are read, never updated (the steps do not donate them)."""
    import jax

    from glm_dsa.debug.trace import sort_key, traced_step
    from glm_dsa.model.step import step
    run = jax.jit(lambda p, c, b: step(p, c, b, config=cfg, options=options)[0])
    out, ref = [], None
    for t in rows:
        batch = target_batch(t, context, block_size, cfg.vocab_size, seed)
        logits = np.asarray(run(params, caches, batch))[0]
        taps = {k: _row(k, v) for k, v in traced_step(params, caches, batch, config=cfg, options=options)[2].items()}
        if ref is None:
            ref = (t, logits, taps)
        first: dict[str, str] = {}
        for name in sorted(taps, key=sort_key):
            layer = name.split(".")[1]
            if layer not in first and taps[name].tobytes() != ref[2][name].tobytes():
                first[layer] = name.split(".", 2)[-1]
        diff = float(np.max(np.abs(logits.astype(np.float64) - ref[1])))
        row = {"T": t, "logits_equal": logits.tobytes() == ref[1].tobytes(), "logits_max_abs_diff": diff,
               "first_difference": first}
        log(f"T={t} against T={ref[0]}: logits {'equal' if row['logits_equal'] else f'differ (max {diff:.3g})'}; "
            f"first difference per layer: {first or 'none'}")
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--quantization", default="none", choices=["fp8", "none"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="8,32,128,256", help="the step row counts T, the first the reference")
    ap.add_argument("--context", type=int, default=4096, help="every request's context (the target's too)")
    ap.add_argument("--block-size", type=int, default=64)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--batch-invariant", dest="invariant", action="store_true", default=True,
                      help="the mode's decode-step choices (default)")
    mode.add_argument("--default", dest="invariant", action="store_false", help="the default mode's choices")
    ap.add_argument("--impl", default=None, help="kernels' impl (default: the platform's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (smoke runs)")
    ap.add_argument("--out", default=None, help="write the record (benchmarks.harness) here")
    args = ap.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",") if x]
    if not rows or min(rows) < 1:
        ap.error(f"--rows: row counts >= 1, got {args.rows!r}")
    from benchmarks.harness import apply_platform_flags, command_line, record, write_json
    apply_platform_flags(args.cpu, None)
    import jax

    from glm_dsa import configs
    from glm_dsa.model.options import StepOptions
    from glm_dsa.model.paged_cache import allocate_caches, cache_dtype, pages_needed
    from glm_dsa.model.random_init import init_params
    from glm_dsa.serving.benchmark import random_caches
    cfg = configs.get(args.preset)
    if args.num_layers:
        cfg = cfg.with_depth(args.num_layers)
    params = init_params(cfg, seed=args.seed, dtype=args.dtype,
                         quantization="fp8" if args.quantization == "fp8" else None)
    pages = 1 + max(rows) * pages_needed(args.context, args.block_size, 1)
    caches = allocate_caches(cfg, pages, args.block_size, cache_dtype(args.kv_cache_dtype, jax.numpy.dtype(args.dtype)),
                             kv_cache_dtype=args.kv_cache_dtype)
    caches = random_caches(cfg, caches, jax.random.key(args.seed + 1))
    options = StepOptions(impl=args.impl, batch_invariant=args.invariant)
    out = compare(rows, cfg=cfg, params=params, caches=caches, block_size=args.block_size, context=args.context,
                  options=options)
    if args.out:
        write_json(args.out, record(out, command=command_line(argv, script=__file__), preset=args.preset,
                                    batch_invariant=args.invariant, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype, context=args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
