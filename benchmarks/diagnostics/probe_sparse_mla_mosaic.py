"""GPU probe of the Mosaic sparse MLA kernel: does each variant lower, is it right, how fast.

Each step is independent and prints `PROBE <name> PASS|FAIL <detail>`; timings beside xla and triton in the same
run. Writes JSON rows to --out. Variants named "diag_*" are timing-only forms (`sparse_mla_forms`).

    PYTHONPATH=. python3 benchmarks/diagnostics/probe_sparse_mla_mosaic.py --out x.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks import harness  # noqa: E402
# the benchmark's shapes and timing case: the probe's rows stand beside its rows (bench_attention)
from benchmarks.bench_sparse_mla import DR, H, K, R, SCALE, bytes_moved, make_case  # noqa: E402
from benchmarks.diagnostics.sparse_mla_forms import form, fp8_only as form_is_fp8_only  # noqa: E402
from kernels import fp8_formats, sparse_mla  # noqa: E402
from kernels.sparse_mla import mosaic  # noqa: E402

VARIANTS = {"cp_async": dict(producer="cp_async"), "cp_async_xla_merge": dict(producer="cp_async", merge="xla"),
            "tma_gmem": dict(producer="tma", slot_source="gmem"),
            "tma_smem": dict(producer="tma", slot_source="smem"),
            "cp_async_r224": dict(producer="cp_async", consumer_registers=224, producer_registers=56),
            "share_p": dict(share_p=True), "no_share_p": dict(share_p=False),
            "pf0": dict(l2_prefetch=0), "pf1": dict(l2_prefetch=1), "pf2": dict(l2_prefetch=2),
            "pf4": dict(l2_prefetch=4),
            # registers moved from consumer 1 (which reads P from shared memory) to the producer, whose fp8 form
            # holds a tile's loads and their conversions in registers (BENCHMARKS.md, sparse MLA)
            "fr168": dict(consumer_registers=216, follower_registers=168, producer_registers=120),
            "fr184": dict(consumer_registers=216, follower_registers=184, producer_registers=104),
            "lr208": dict(consumer_registers=208, follower_registers=168, producer_registers=128),
            "lr200": dict(consumer_registers=200, follower_registers=168, producer_registers=136),
            "cr208": dict(consumer_registers=208, producer_registers=88),
            "diag_no_mask": dict(hooks=form("no_mask")),
            # timing-only forms (sparse_mla_forms): the producer alone (the idle consumers are the plain
            # schedule's), and the fp8 producer's parts
            "diag_gather_only": dict(hooks=form("gather_only"), share_p=False),
            "diag_no_convert": dict(hooks=form("no_convert")), "diag_no_load": dict(hooks=form("no_load")),
            "diag_gather_only_no_convert": dict(hooks=form("gather_only_no_convert"), share_p=False),
            "diag_gather_only_no_load": dict(hooks=form("gather_only_no_load"), share_p=False),
            "diag_compute_only": dict(hooks=form("compute_only")),
            "diag_compute_only_plain": dict(hooks=form("compute_only"), share_p=False),
            # the consumers alone with the bf16 kernel's registers (232 each; the producer's 40 are enough to idle)
            "diag_compute_only_r232": dict(hooks=form("compute_only"), consumer_registers=232,
                                           follower_registers=None, producer_registers=40),
            # where the fp8 producer reads its slot ids (the default: smem, fetched a tile ahead)
            "slots_gmem": dict(slot_source="gmem"), "slots_smem": dict(slot_source="smem"),
            "diag_gather_only_slots_gmem": dict(hooks=form("gather_only"), share_p=False, slot_source="gmem")}


def fp8_only(variant):
    """Whether the variant is a timing-only form of the fp8_ds_mla producer (a bf16 cache refuses it)."""
    return form_is_fp8_only(VARIANTS[variant].get("hooks", form("none")))


def runner(fn, reps):
    @jax.jit
    def run(cache, q, idx):
        return [fn(q[i], cache, idx[i]) for i in range(reps)]
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_mosaic.json")
    ap.add_argument("--batches", default="128,32,1")
    ap.add_argument("--variants", default="cp_async,tma_smem")
    ap.add_argument("--caches", default="bf16,fp8")
    ap.add_argument("--baselines", default="xla,triton")
    ap.add_argument("--splits", choices=("both", "default"), default="both",
                    help="time each variant at n_split 1 and the default's, or at the default's only")
    ap.add_argument("--before", default="",
                    help="a file holding another version of kernels/sparse_mla/mosaic.py (e.g. `git show "
                         "HEAD~1:kernels/sparse_mla/mosaic.py > before.py`): its default config is timed in the "
                         "same run as impl mosaic_before")
    ap.add_argument("--kernel_time", type=int, default=1,
                    help="1: beside each wall-clock time, the op's GPU kernel time from a profiler trace")
    args = ap.parse_args(argv)
    rows = []
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    # correctness at small T with -1 slots and an all-invalid row
    rng = np.random.default_rng(0)
    t_small = 4
    cache_s = jnp.asarray(rng.standard_normal((8192, R + DR)), jnp.bfloat16)
    q_s = jnp.asarray(rng.standard_normal((t_small, H, R + DR)), jnp.bfloat16)
    idx_s = rng.integers(0, 8192, (t_small, 300)).astype(np.int32)
    idx_s[0, 10:50] = -1
    idx_s[1, :] = -1
    idx_s[2, 100:] = -1
    idx_s = jnp.asarray(idx_s)
    caches = args.caches.split(",")
    cache_by_kind = {"bf16": cache_s, "fp8": fp8_formats.quantize_mla_rows(cache_s[:, :R], cache_s[:, R:])}
    ok = []  # (cache kind, variant) pairs that passed the oracle (diagnostics: timing only)
    for kind in caches:
        ref = sparse_mla.sparse_mla(q_s, cache_by_kind[kind], idx_s, scale=SCALE, kv_lora_rank=R, impl="xla")
        for variant in args.variants.split(","):
            if kind == "fp8" and VARIANTS[variant].get("producer") == "tma":
                continue
            if kind == "bf16" and fp8_only(variant):
                continue
            if variant.startswith("diag"):
                ok.append((kind, variant))
                continue
            passed = True
            for n_split in (1, 2):
                name = f"{kind}_{variant}_s{n_split}"
                try:
                    t0 = time.time()
                    o, lse = mosaic.sparse_mla_mosaic(q_s, cache_by_kind[kind], idx_s, scale=SCALE, kv_lora_rank=R,
                                                      n_split=n_split, **VARIANTS[variant])
                    jax.block_until_ready(o)
                    eo = float(jnp.max(jnp.abs(o - ref[0])))
                    fin = jnp.isfinite(ref[1])
                    el = float(jnp.max(jnp.where(fin, jnp.abs(lse - ref[1]), 0.0)))
                    same_inf = bool(jnp.all(jnp.isfinite(lse) == fin))
                    good = eo < 3e-2 and el < (1e-3 if kind == "bf16" else 2e-2) and same_inf
                    print(f"PROBE correct_{name} {'PASS' if good else 'FAIL'} max|do|={eo:.3g} max|dlse|={el:.3g} "
                          f"inf_match={same_inf} compile+run {time.time() - t0:.1f}s", flush=True)
                    rows.append(dict(step=f"correct_{name}", ok=good, err_o=eo, err_lse=el))
                    passed &= good
                except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
                    tb = traceback.format_exc()
                    print(f"PROBE correct_{name} FAIL {type(e).__name__}: {str(e)[:2000]}\n{tb[-3000:]}",
                          flush=True)
                    rows.append(dict(step=f"correct_{name}", ok=False, error=str(e)[:4000]))
                    passed = False
            if passed:
                ok.append((kind, variant))
    for b, cache_kind in [(int(x), c) for c in caches for x in args.batches.split(",")]:
        fp8 = cache_kind == "fp8"
        reps = 12 if b >= 128 else 24
        cache, q, idx = make_case(b, fp8, reps)
        nbytes = bytes_moved(b, fp8)
        impls = {name: functools.partial(sparse_mla.sparse_mla, impl=name)
                 for name in args.baselines.split(",") if name}
        if args.before:
            impls["mosaic_before"] = _module_from(args.before).sparse_mla_mosaic
        for kind, v in ok:
            if kind != cache_kind:
                continue
            for n_split in sorted({mosaic.default_config(b, K).n_split} | ({1} if args.splits == "both" else set())):
                impls[f"mosaic_{v}_s{n_split}"] = functools.partial(mosaic.sparse_mla_mosaic, n_split=n_split,
                                                                    **VARIANTS[v])
        times = {}
        for name, fn in impls.items():
            op = functools.partial(fn, scale=SCALE, kv_lora_rank=R)
            make = functools.lru_cache(None)(functools.partial(runner, op))  # one compile for both timers
            try:
                us = harness.per_op_time(make, (cache, q, idx), reps, 7, lo=2)[0] * 1e6
                times[name] = us
                traced = harness.trace_micros(harness.traced_times_or_none(
                    make, (cache, q, idx), reps, lo=2, log=lambda m: print(f"PROBE {m}", flush=True))
                    if args.kernel_time else None)
                print(f"PROBE time {cache_kind} B={b} {name} {us:.1f} us {nbytes / us / 1e6:.2f} TB/s"
                      + ("" if traced["kernel_us"] is None else
                         f"  kernels {traced['kernel_us']:.1f} us  device {traced['device_us']:.1f} us"), flush=True)
                rows.append(dict(step="time", cache=cache_kind, B=b, impl=name, us=us, tb_s=nbytes / us / 1e6,
                                 **traced))
            except Exception as e:  # noqa: BLE001
                print(f"PROBE time {cache_kind} B={b} {name} FAIL {type(e).__name__}: {str(e)[:1500]}", flush=True)
                rows.append(dict(step="time", B=b, impl=name, error=str(e)[:3000]))
        for row_ in rows:
            if row_.get("step") == "time" and row_.get("B") == b and row_.get("cache") == cache_kind:
                row_["xla_us"] = times.get("xla")
        del cache, q, idx
        save(args.out, rows)  # after every (B, cache): a run cut short by its timeout keeps what it measured
    save(args.out, rows)


def _module_from(path):
    """The module in file `path` (another version of the kernel module, imported beside the current one)."""
    import importlib.util
    # named inside kernels.sparse_mla, so that its relative imports resolve as the current module's do
    spec = importlib.util.spec_from_file_location("kernels.sparse_mla.mosaic_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def save(path, rows):
    with open(path, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), commit=harness.git_commit(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
