"""Diagnose the FP8 indexer scores on the GPU against a float64 numpy oracle built from the same bytes:
the Triton kernel, the xla form (jitted), and the e4m3 queries quantised inside jit vs eagerly.

    PYTHONPATH=. python3 benchmarks/diag_indexer_fp8.py
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kernels import fp8_formats, indexer
from kernels.indexer import triton as indexer_triton


def main(argv=None):
    """Print each form's largest relative distance from the float64 scores (no timing; runs on CPU too, the
    Triton kernel then in interpret mode)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    rng = np.random.default_rng(0)
    T, H, DI, PAGE, PAGES = 8, 32, 128, 64, 128
    lens = rng.integers(1, 8192, size=T).astype(np.int32)
    lens[0], lens[1] = 8192, 1000
    n_pages = T * PAGES + 3
    kc = rng.normal(size=(n_pages * PAGE, DI)).astype(np.float32)
    cache = fp8_formats.quantize_index_rows(jnp.asarray(kc))
    bt = rng.permutation(n_pages)[: T * PAGES].reshape(T, PAGES).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(T, H, DI)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, H)), jnp.float32)
    req = jnp.arange(T, dtype=jnp.int32)

    q8_eager, w2_eager = indexer.prepare_queries(q, w, cache)
    q8_jit, _ = jax.jit(indexer.prepare_queries)(q, w, cache)
    b_e = np.asarray(jax.lax.bitcast_convert_type(q8_eager, jnp.uint8))
    b_j = np.asarray(jax.lax.bitcast_convert_type(q8_jit, jnp.uint8))
    print("q8 jit == eager:", np.array_equal(b_e, b_j), "differing bytes:", int((b_e != b_j).sum()))

    # float64 oracles from the bytes: the e4m3 queries, and what a kernel fed unquantised queries would score
    # (XLA folding f32 -> e4m3 -> bf16 into f32 -> bf16)
    cb = np.asarray(cache)
    keys = cb[:, :DI].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s_k = cb[:, DI:].copy().view(np.float32)[:, 0].astype(np.float64)
    wf = np.asarray(w2_eager, np.float64)
    S = PAGES * PAGE
    slots_of = np.asarray(indexer.request_slots(jnp.asarray(bt), PAGE))  # [T, S]

    def scores64(qf):
        out = np.full((T, S), -np.inf)
        for t in range(T):
            slots = slots_of[t, : lens[t]]
            out[t, : lens[t]] = (wf[t] @ np.maximum(qf[t] @ keys[slots].T, 0)) * s_k[slots]
        return out

    s_q = np.asarray(w2_eager / w)
    want = scores64(b_e.view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    want_unq = scores64((np.asarray(q, np.float32) / s_q[..., None]).astype(ml_dtypes.bfloat16).astype(np.float64))
    print("q8 eager vs ml_dtypes RNE of the same f32:", np.array_equal(b_e, np.clip(
        np.asarray(q, np.float32) / s_q[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)))

    def rel(got, want=want):
        got = np.asarray(got, np.float64)[:, :S]
        fin = np.isfinite(want)
        if not np.array_equal(np.isfinite(got), fin):
            raise ValueError("the scores are finite at other positions than the float64 oracle's (kv_lens)")
        return float(np.max(np.abs(got[fin] - want[fin]) / np.maximum(np.abs(want[fin]), 1.0)))

    on_gpu = jax.default_backend() == "gpu"
    args = (q8_eager, w2_eager, cache, req, jnp.asarray(lens), jnp.asarray(bt))
    tri = jax.jit(functools.partial(indexer_triton.indexer_scores_triton, block_size=PAGE,
                                    interpret=not on_gpu))(*args)
    print("triton scores vs float64: max rel", rel(tri), "| vs unquantised queries:", rel(tri, want_unq))
    tri_e2e = jax.jit(functools.partial(indexer.indexer_topk, block_size=PAGE, topk=2048, return_scores=True,
                                        impl="triton" if on_gpu else "triton_interpret"))(
        q, w, cache, req, jnp.asarray(lens), jnp.asarray(bt))[1]
    top = np.sort(want, axis=1)[:, ::-1][:, :2048]
    with np.errstate(invalid="ignore"):  # -inf - -inf past each row's length
        err = np.nanmax(np.abs(np.asarray(tri_e2e, np.float64) - top) / np.maximum(np.abs(top), 1.0))
    print("triton top-k scores (quantised inside the same jit) vs float64 top-2048:", float(err))
    xla = jax.jit(functools.partial(indexer.indexer_scores_xla, block_size=PAGE))(*args)
    print("xla scores (jit) vs float64: max rel", rel(xla))
    with jax.default_matmul_precision("highest"):
        xla_h = jax.jit(functools.partial(indexer.indexer_scores_xla, block_size=PAGE))(*args)
    print("xla scores (jit, highest) vs float64: max rel", rel(xla_h))


if __name__ == "__main__":
    main()
