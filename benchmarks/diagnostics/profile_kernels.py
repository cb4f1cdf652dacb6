"""Run each Pallas kernel once at its benchmark shape, for Nsight Compute to profile (no timing here).

    ncu --clock-control none --kernel-name regex:'sparse_mla|mosaic|indexer|moe|topk|sort' --launch-count 12 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python3 benchmarks/diagnostics/profile_kernels.py

`--ops mla --mla-impls mosaic` runs only the Mosaic GPU sparse MLA kernel (its launch is named
`anonymous_mosaic_gpu_kernel`); `--ops indexer --indexer-impls mosaic` only the Mosaic GPU indexer scores kernel
(and the select kernels after it).

Shapes: sparse MLA B = 128 (bf16 and fp8_ds_mla caches, GLM-5 dims), the indexer (FP8 cache) at B = 32 with a
32K context, and the routed experts at B = 32 (GLM-5.2 widths).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_indexer, bench_sparse_mla
from kernels import indexer, moe, sparse_mla


def main(argv=None):
    """Run each kernel once (the profiler, not this script, measures)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="mla,indexer,moe", help="comma-separated subset of mla,indexer,moe")
    ap.add_argument("--mla-impls", default="triton,mosaic", help="sparse MLA impls to run (each cache format)")
    ap.add_argument("--indexer-impls", default="triton,mosaic", help="indexer impls to run (FP8 cache)")
    args = ap.parse_args(argv)
    ops = set(args.ops.split(","))
    for fp8 in (False, True) if "mla" in ops else ():
        cache, q, idx = bench_sparse_mla.make_case(128, fp8, 1)
        for impl in args.mla_impls.split(","):
            f = jax.jit(functools.partial(sparse_mla.sparse_mla, scale=0.07, kv_lora_rank=512, impl=impl))
            jax.block_until_ready(f(q[0], cache, idx[0]))
        del cache
    if "indexer" in ops:
        _indexer(args.indexer_impls.split(","))
    if "moe" in ops:
        _moe()


def _indexer(impls):
    """The indexer (FP8 cache) at B = 32, 32K context: scores and top-k, as the model calls it (a set)."""
    cache, bt, q, w, req, lens = bench_indexer.make_case(32, True, 1)
    for impl in impls:
        f = jax.jit(functools.partial(indexer.indexer_topk, block_size=bench_indexer.PAGE, topk=2048, impl=impl,
                                      ordered=False))
        jax.block_until_ready(f(q[0], w[0], cache, req[0], lens[0], bt))
    del cache


def _moe():
    """The routed experts at B = 32, GLM-5.2 widths (6144 hidden, 2048 expert width, 256 experts, top-8)."""
    d, i, e, t = 6144, 2048, 256, 32
    key = jax.random.key(0)
    w = [(jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
         for k, s in zip(jax.random.split(key, 3), ((e, d, i), (e, d, i), (e, i, d)))]
    rng = np.random.default_rng(0)
    experts = jnp.asarray(np.stack([rng.choice(e, 8, replace=False) for _ in range(t)]), jnp.int32)
    x = jax.random.normal(key, (t, d), jnp.bfloat16)
    f = jax.jit(functools.partial(moe.routed_experts, impl="triton"))
    jax.block_until_ready(f(x, experts, jnp.ones((t, 8), jnp.float32), *w))


if __name__ == "__main__":
    main()
