"""Launch configs of the Mosaic GPU W8A8 grouped GEMM (`kernels/fp8_gemm/mosaic.py`) at GLM-5.2 prefill widths:
which tile, stage count and warpgroup split each of the routed experts' GEMMs runs fastest with, and whether the
gate+up GEMM should keep its fused SwiGLU epilogue or run as one plain GEMM over N = 2I with SwiGLU after it.

The problem: 8192 tokens x top-8 = 65536 (row, expert) pairs over 256 experts, uniform random routing, in the
prefill layout of the experts op (`experts.pair_rows`: pairs sorted by expert, each expert's run on whole tiles of
tile_m rows, the static bound ceil(P / tile_m) + E - 1 tiles); hidden D = 6144, expert width I = 2048. Inputs as
`benchmarks/bench_fp8_gemm_mosaic.py` builds them (`experts_fp8`, `routing`; activations `quantize_rows` of
normal bf16 rows at every row of the layout). Cases (the names in the output and in `--only`):

  up_fused     gate+up with the SwiGLU epilogue: (gate, up) each [G, I, D] -> silu(gate) * up, [M, I]
  up_unfused   gate+up as one plain GEMM with N = 2I: [G, 2I, D] (gate rows then up rows, the scales alike;
               concatenated once, outside the timed call) -> [M, 2I]
  down         [M, I] x [G, D, I] -> [M, D]
  e2e_fused    up_fused, then what the experts do with its output before the down GEMM: quantize_rows(h)
  e2e_unfused  up_unfused, then silu(g) * u and quantize_rows: the fair comparison with e2e_fused

Each config: compile and warm up, then the median of --iters calls by `benchmarks.harness.timeit` (each call
blocked until ready: wall ms) and, on a GPU, the median CUPTI device time of the call's kernels (Mosaic GPU's
profiler: dev ms, all the call's kernels; gemm ms, its longest kernel alone). TF/s = 2 M N K / t over the 65536
real pairs (fused: both operands). Each GEMM's output is checked against the float64 oracle
(`kernels/fp8_gemm/reference.oracle`) on 3 used tiles x 3 column blocks, plus one unused tile (must be zeros).
Configs that `Fp8GemmConfig` rejects are rows too ("invalid"), never timed: the repo's shared-memory count
(`Fp8GemmConfig.smem_bytes`, bf16 output) beside Mosaic GPU's own (`mosaic.lowered_smem_bytes`: the kernel lowered
for CUDA, not run; no device needed), which it is meant to equal.

    PYTHONPATH=. python benchmarks/diagnostics/fp8_gemm_configs.py --budget 480     # then --start N for the rest
    PYTHONPATH=. python benchmarks/diagnostics/fp8_gemm_configs.py --only up_unfused,down --iters 20
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/diagnostics/fp8_gemm_configs.py --smoke --out /tmp/s.json

`--smoke`: 4 experts, D = I = 256, 96 tokens of top-2 (5 tiles of 128, one unused) under the Mosaic interpreter on
any device: it checks the script and the kernel, its figures measure nothing. The record
(`benchmarks.harness.record`) goes to --out, rewritten after every config; with --start N to the same name with
`_fromN` before `.json`. `--from-log LOG` rebuilds the rows from the lines a run printed (for a run whose record
did not come back), without running anything. Exit code 1 when a config gives a wrong result or fails.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import functools
import os
import re
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_fp8_gemm_mosaic import Dims, experts_fp8, routing
from benchmarks.harness import Budget, command_line, git_commit, record, timeit, write_json
from kernels import fp8_gemm
from kernels.fp8_gemm import Fp8GemmConfig, config as cfg_mod, experts as fp8_experts, mosaic
from kernels.fp8_gemm.reference import oracle, silu_mul

CASES = ("up_fused", "up_unfused", "down", "e2e_fused", "e2e_unfused")


def output_path(out: str, start: int) -> str:
    """Where the record goes: `out`, or with --start N > 1 the same name with `_fromN` before `.json`."""
    if start <= 1:
        return out
    return f"{out.removesuffix('.json')}_from{start}.json"


GLM52 = dict(experts=256, topk=8, hidden=6144, width=2048, tokens=8192)
SMOKE = dict(experts=4, topk=2, hidden=256, width=256, tokens=96)  # 5 tiles of 128, 4 used: one unused


# ---------------------------------------------------------------------------------------------------------------
# the configs


def C(**kw) -> dict:
    return kw


#: (case, config kwargs), most informative first. Stage counts the repo rejects are kept in the list: they become
#: "invalid" rows with the repo's and Mosaic's shared-memory figures (no GPU time).
def config_list() -> list[tuple[str, dict]]:
    sw = dict(tile_n=256, swiglu=True)
    tn128, tn256, tm256 = dict(tile_n=128), dict(tile_n=256), dict(tile_m=256, tile_n=128, m_sub=2)
    plan = [
        # the current defaults: the baselines
        ("up_fused", C(**sw, stages=2)),  # PREFILL_SWIGLU
        ("down", C(**tn128, stages=4)),  # PREFILL (expert_configs' down)
        ("up_unfused", C(**tn128, stages=4)),  # PREFILL over N = 2I
        # the narrow fused tile (64 gate + 64 up columns: the plain 128 x 128 tile's registers and shared memory)
        ("up_fused", C(tile_n=128, swiglu=True, stages=4)),  # PREFILL_SWIGLU_NARROW
        # each CTA's tile pipelines chained (the next tile's K blocks loaded while the last tile finishes)
        ("down", C(**tn128, stages=4, chain=True)),
        ("up_fused", C(tile_n=128, swiglu=True, stages=4, chain=True)),
        ("up_fused", C(**sw, stages=2, chain=True)),
        ("up_unfused", C(**tn128, stages=4, chain=True)),
        ("up_fused", C(tile_n=128, swiglu=True, stages=5)),
        ("up_fused", C(tile_n=128, swiglu=True, stages=3)),
        ("up_fused", C(tile_m=256, tile_n=128, m_sub=2, swiglu=True, stages=3)),
        ("e2e_fused", C(tile_n=128, swiglu=True, stages=4)),
        # the bigger tiles: 2 accumulators of 64 x 128 a warpgroup, like the fused kernel
        ("up_unfused", C(**tm256, stages=3)),
        ("up_unfused", C(**tn256, stages=3)),
        ("down", C(**tm256, stages=3)),
        ("down", C(**tn256, stages=3)),
        # end to end up to the down GEMM's input: the fused epilogue against the unfused GEMM + silu*mul
        ("e2e_fused", C(**sw, stages=3)),
        ("e2e_unfused", C(**tn128, stages=4)),
        ("up_fused", C(**sw, stages=3)),
        ("up_fused", C(**sw, stages=4)),  # rejected: shared memory (reported)
        ("up_fused", C(tile_m=128, tile_n=256, swap_ab=True, swiglu=True, stages=3)),
        # stage counts
        ("up_unfused", C(**tn128, stages=5)),
        ("down", C(**tn128, stages=5)),
        ("up_unfused", C(**tn128, stages=3)),
        ("down", C(**tn128, stages=3)),
        ("up_unfused", C(**tn128, stages=6)),  # rejected
        ("up_unfused", C(**tn256, stages=4)),  # rejected
        ("up_unfused", C(**tm256, stages=4)),  # rejected
        ("up_unfused", C(**tm256, stages=2)),
        ("down", C(**tm256, stages=2)),
        ("up_unfused", C(**tn256, stages=2)),
        ("down", C(**tn256, stages=2)),
        # one compute warpgroup (no interleaving of two; room for more stages)
        ("up_fused", C(tile_m=64, compute_wgs=1, **sw, stages=4)),
        ("up_fused", C(tile_m=64, compute_wgs=1, **sw, stages=5)),
        ("up_unfused", C(tile_m=128, tile_n=128, m_sub=2, compute_wgs=1, stages=6)),
        ("down", C(tile_m=128, tile_n=128, m_sub=2, compute_wgs=1, stages=6)),
        ("up_unfused", C(tile_m=64, tile_n=256, compute_wgs=1, stages=5)),
        ("down", C(tile_m=64, tile_n=256, compute_wgs=1, stages=5)),
        ("up_fused", C(tile_m=64, compute_wgs=1, **sw, stages=3)),
        ("up_fused", C(tile_m=128, tile_n=256, swap_ab=True, swiglu=True, stages=2)),
        ("up_unfused", C(tile_m=64, tile_n=128, compute_wgs=1, stages=6)),
        ("down", C(tile_m=64, tile_n=128, compute_wgs=1, stages=6)),
    ]
    return plan


def unchecked(**kw) -> Fp8GemmConfig:
    """An Fp8GemmConfig without __post_init__'s validation (for the shared-memory figures of a rejected one)."""
    c = object.__new__(Fp8GemmConfig)
    for f in dataclasses.fields(Fp8GemmConfig):
        object.__setattr__(c, f.name, kw.get(f.name, f.default))
    return c


def short(c: Fp8GemmConfig) -> str:
    s = f"tm{c.tile_m} tn{c.tile_n} s{c.stages} wgs{c.compute_wgs} msub{c.m_sub}"
    return s + (" swap" if c.swap_ab else "") + (" chain" if c.chain else "")


def mosaic_smem(c: Fp8GemmConfig) -> int | None:
    """Mosaic GPU's exact shared memory of config c (bf16 out; `mosaic.lowered_smem_bytes`: the kernel lowered for
    CUDA at a small shape, no device needed). None when lowering fails otherwise."""
    try:
        return mosaic.lowered_smem_bytes(c, jnp.bfloat16)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# the run


class Sweep:
    def __init__(self, args, dims: dict, argv: list[str] | None = None):
        self.args, self.dims = args, dims
        self.t0 = time.time()
        self.budget = Budget(args.budget) if args.budget else None
        self.on_gpu = jax.default_backend() == "gpu"
        self.impl = "mosaic" if self.on_gpu else "mosaic_interpret"
        self.rows: list[dict] = []
        self.out = output_path(args.out, args.start)
        self.argv = argv
        key = jax.random.key(0)
        self.key = key
        d = Dims(experts=dims["experts"], topk=dims["topk"], hidden=dims["hidden"], width=dims["width"])
        (self.wg, self.wu, self.wd), s = experts_fp8(jax.random.fold_in(key, 1), d, dims["width"])
        self.sg, self.su, self.sd = s["wg_scale"], s["wu_scale"], s["wd_scale"]
        self.experts, _, self.used = routing(jax.random.fold_in(key, 2), dims["tokens"], d)
        self.pairs = dims["tokens"] * dims["topk"]
        self._cat = None
        self._layouts: dict = {}
        self._acts: dict = {}

    # inputs ------------------------------------------------------------------------------------------------
    def cat(self):
        """(w [G, 2I, D], scales [G, 2I/128, D/128]): gate rows then up rows (built once, outside any timing)."""
        if self._cat is None:
            self._cat = (jax.block_until_ready(jnp.concatenate([self.wg, self.wu], axis=1)),
                         jax.block_until_ready(jnp.concatenate([self.sg, self.su], axis=1)))
        return self._cat

    def layout(self, tile_m: int):
        if tile_m not in self._layouts:
            tg = fp8_experts.pair_rows(self.experts, self.dims["experts"], tile_m).tile_group
            self._layouts[tile_m] = jax.block_until_ready(tg)
        return self._layouts[tile_m]

    def acts(self, tile_m: int, k: int):
        """Quantised normal bf16 rows at every row of the tile_m layout (as the repo's benchmark)."""
        if (tile_m, k) not in self._acts:
            m = self.layout(tile_m).shape[0] * tile_m
            x = jax.random.normal(jax.random.fold_in(self.key, 10 + k), (m, k), jnp.bfloat16)
            self._acts[(tile_m, k)] = jax.block_until_ready(fp8_gemm.quantize_rows(x))
        return self._acts[(tile_m, k)]

    def operands(self, case: str, c: Fp8GemmConfig):
        """(a_q, s_a, w, w_scale, tile_group, N of the output, K, flops)."""
        d, i = self.dims["hidden"], self.dims["width"]
        tg = self.layout(c.tile_m)
        if case in ("up_fused", "e2e_fused"):
            a, s = self.acts(c.tile_m, d)
            return a, s, (self.wg, self.wu), (self.sg, self.su), tg, i, d, 2.0 * self.pairs * 2 * i * d
        if case in ("up_unfused", "e2e_unfused"):
            a, s = self.acts(c.tile_m, d)
            w, ws = self.cat()
            return a, s, w, ws, tg, 2 * i, d, 2.0 * self.pairs * 2 * i * d
        if case == "down":
            a, s = self.acts(c.tile_m, i)
            return a, s, self.wd, self.sd, tg, d, i, 2.0 * self.pairs * d * i
        raise ValueError(case)

    # timing ------------------------------------------------------------------------------------------------
    def cupti(self, f, *args) -> tuple[float, float] | None:
        """(median device ms of all the call's kernels, median ms of its longest kernel) by CUPTI, or None."""
        if not self.on_gpu:
            return None
        try:
            from jax.experimental.mosaic.gpu import profiler
            _, per = profiler.measure(f, aggregate=False, iterations=self.args.iters)(*args)
            total = statistics.median(sum(t for _, t in it) for it in per)
            longest = statistics.median(max(t for _, t in it) for it in per)
            return total, longest
        except Exception as e:  # noqa: BLE001
            print(f"    (cupti failed: {type(e).__name__}: {str(e)[:200]})", flush=True)
            return None

    # checking ----------------------------------------------------------------------------------------------
    def check(self, case: str, c: Fp8GemmConfig, out, a, s, w, ws, tg) -> dict:
        tm = c.tile_m
        tgn = np.asarray(tg)
        used = np.nonzero(tgn >= 0)[0]
        unused = np.nonzero(tgn < 0)[0]
        tiles = sorted({int(used[0]), int(used[len(used) // 2]), int(used[-1])})
        nb = out.shape[1] // 128
        cbs = sorted({0, nb // 2, nb - 1})  # up_unfused: nb // 2 is the first up block
        cols = np.concatenate([np.arange(b * 128, (b + 1) * 128) for b in cbs])
        rows = np.concatenate([np.arange(t * tm, (t + 1) * tm) for t in tiles])
        got = np.asarray(out[jnp.asarray(rows)][:, jnp.asarray(cols)].astype(jnp.float32), np.float64)
        refs = []
        for t in tiles:
            g = int(tgn[t])
            r = slice(t * tm, (t + 1) * tm)
            a_t, s_t, rg = a[r], s[r], np.zeros(tm, np.int64)

            def one(wq, wsc):
                return oracle(a_t, s_t, wq[g][jnp.asarray(cols)][None], wsc[g][jnp.asarray(cbs)][None], rg)

            refs.append(silu_mul(one(w[0], ws[0]), one(w[1], ws[1])) if c.swiglu else one(w, ws))
        ref = np.concatenate(refs)
        err = np.abs(got - ref)
        res = dict(max_abs=float(err.max()), ref_max=float(np.abs(ref).max()),
                   rel_max=float(err.max() / max(np.abs(ref).max(), 1e-300)),
                   rel_fro=float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)),
                   checked_tiles=tiles, checked_col_blocks=cbs)
        if len(unused):
            t = int(unused[0])
            res["unused_tile_max"] = float(jnp.max(jnp.abs(out[t * tm:(t + 1) * tm].astype(jnp.float32))))
        # bf16 output: rel_fro ~2e-3, rel_max ~3e-3 when right
        res["ok"] = bool(res["rel_fro"] < 2e-2 and res["rel_max"] < 2e-2 and res.get("unused_tile_max", 0.0) == 0.0)
        return res

    # one config --------------------------------------------------------------------------------------------
    def run_one(self, idx: int, n: int, case: str, kw: dict) -> dict:
        row = dict(case=case, config=dict(kw), status=None)
        tag = f"[{idx:2d}/{n}] {case:11s}"
        try:
            c = Fp8GemmConfig(**kw)
        except ValueError as e:
            c = unchecked(**kw)
            est = c.smem_bytes()
            ms = mosaic_smem(c)
            row.update(status="invalid", error=str(e)[:300], config=dataclasses.asdict(c), smem_repo=est,
                       smem_mosaic=ms, smem_limit=cfg_mod.SMEM_LIMIT,
                       over_repo=est - cfg_mod.SMEM_LIMIT, over_mosaic=None if ms is None else ms - cfg_mod.SMEM_LIMIT)
            print(f"{tag} {short(c):32s} INVALID: repo smem {est} (over by {est - cfg_mod.SMEM_LIMIT}), mosaic "
                  f"{ms} (over by {None if ms is None else ms - cfg_mod.SMEM_LIMIT}); {str(e)[:120]}", flush=True)
            return row
        row["config"] = dataclasses.asdict(c)
        row["smem_repo"] = c.smem_bytes()
        name = f"{tag} {short(c):32s}"
        try:
            a, s, w, ws, tg, n_out, k, flops = self.operands(case, c)
            row.update(M=int(a.shape[0]), N=n_out, K=k, pairs=self.pairs, flops=flops,
                       tiles=int(tg.shape[0]), tiles_used=int(jnp.sum(tg >= 0)))
            gemm = functools.partial(fp8_gemm.grouped_matmul, impl=self.impl, config=c)
            if case == "e2e_fused":
                f = jax.jit(lambda a, s, w, ws, tg: fp8_gemm.quantize_rows(gemm(a, s, w, ws, tg)))
            elif case == "e2e_unfused":
                i = self.dims["width"]

                def f_unfused(a, s, w, ws, tg):
                    gu = gemm(a, s, w, ws, tg).astype(jnp.float32)
                    return fp8_gemm.quantize_rows(silu_mul(gu[:, :i], gu[:, i:]).astype(jnp.bfloat16))
                f = jax.jit(f_unfused)
            else:
                f = jax.jit(gemm)
            t = time.perf_counter()
            out = jax.block_until_ready(f(a, s, w, ws, tg))
            row["compile_s"] = round(time.perf_counter() - t, 2)  # compile and first run
            wall = timeit(f, a, s, w, ws, tg, warmup=self.args.warmup, reps=self.args.iters)
            row.update(wall_ms=wall * 1e3, tflops_wall=flops / wall / 1e12)
            dev = self.cupti(f, a, s, w, ws, tg)
            if dev is not None:
                row.update(dev_ms=dev[0], gemm_ms=dev[1], tflops_dev=flops / (dev[0] * 1e-3) / 1e12,
                           tflops_gemm=flops / (dev[1] * 1e-3) / 1e12)
            if not case.startswith("e2e"):
                row["check"] = self.check(case, c, out, a, s, w, ws, tg)
            del out
            row["status"] = "ok" if row.get("check", {}).get("ok", True) else "wrong"
            chk = row.get("check")
            dev_s = (f" dev {row['dev_ms']:7.3f} gemm {row['gemm_ms']:7.3f} ms {row['tflops_gemm']:6.1f} TF/s"
                     if "dev_ms" in row else "")
            chk_s = (f" err rel_fro {chk['rel_fro']:.1e} rel_max {chk['rel_max']:.1e}"
                     f"{'' if chk['ok'] else ' WRONG'}" if chk else "")
            print(f"{name} wall {row['wall_ms']:7.3f} ms {row['tflops_wall']:6.1f} TF/s{dev_s}{chk_s} "
                  f"(compile and first run {row['compile_s']} s)", flush=True)
        except Exception as e:  # noqa: BLE001  one config that fails to compile or run is a row
            row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:600]}")
            print(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if self.args.verbose:
                traceback.print_exc()
        return row

    def write(self):
        os.makedirs(os.path.dirname(self.out) or ".", exist_ok=True)
        write_json(self.out, record(self.rows, command=command_line(self.argv, script=__file__), dims=self.dims,
                                    impl=self.impl, iters=self.args.iters, elapsed_s=round(time.time() - self.t0, 1),
                                    smem_limit=cfg_mod.SMEM_LIMIT))

    def run(self, plan):
        n = len(plan)
        for idx, (case, kw) in enumerate(plan, 1):
            if idx < self.args.start:
                continue
            if self.budget is not None and self.budget.spent():
                for c2, kw2 in plan[idx - 1:]:
                    self.rows.append(dict(case=c2, config=kw2, status="skipped", error="budget spent"))
                print(f"budget of {self.args.budget:g} s spent after {self.budget.elapsed():.0f} s: skipped "
                      f"{n - idx + 1} config(s); resume with --start {idx}", flush=True)
                break
            self.rows.append(self.run_one(idx, n, case, kw))
            self.write()
        self.write()


def summary(rows: list[dict]):
    print("\nbest per case (by gemm/dev ms where measured, else wall):", flush=True)
    for case in ("up_fused", "up_unfused", "down", "e2e_fused", "e2e_unfused"):
        ok = [r for r in rows if r["case"] == case and r["status"] == "ok"]
        if not ok:
            continue
        key = "dev_ms" if all("dev_ms" in r for r in ok) else "wall_ms"
        best = min(ok, key=lambda r: r[key])
        c = unchecked(**best["config"])
        print(f"  {case:11s} {short(c):32s} {key} {best[key]:.3f} "
              f"({best['flops'] / (best[key] * 1e-3) / 1e12:.1f} TF/s)", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "wrong", "failed", "invalid", "skipped")}
    print("  counts:", counts, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# a record from a printed log

_HEADER = re.compile(r"^device (?P<device>.+?) jax (?P<jax>\S+) dims (?P<dims>\{.*\}) configs (?P<n>\d+)")
_LINE = re.compile(r"^\[\s*(?P<idx>\d+)/\s*(?P<n>\d+)\] (?P<case>\w+)\s+tm(?P<tm>\d+) tn(?P<tn>\d+) s(?P<s>\d+) "
                   r"wgs(?P<wgs>\d+) msub(?P<msub>\d+)(?P<swap> swap)?(?P<chain> chain)?\s+(?P<rest>.*)$")
_TIMED = re.compile(r"^wall\s+(?P<wall_ms>[\d.]+) ms\s+(?P<tflops_wall>[\d.]+) TF/s"
                    r"(?: dev\s+(?P<dev_ms>[\d.]+) gemm\s+(?P<gemm_ms>[\d.]+) ms\s+(?P<tflops_gemm>[\d.]+) TF/s)?"
                    r"(?: err rel_fro (?P<rel_fro>\S+) rel_max (?P<rel_max>[^\s]+?)(?P<wrong> WRONG)?)?"
                    r" \(compile and first run (?P<compile_s>[\d.]+) s\)$")
_INVALID = re.compile(r"^INVALID: repo smem (?P<smem_repo>\d+) \(over by -?\d+\), mosaic (?P<smem_mosaic>\d+|None) "
                      r"\(over by [^)]*\); (?P<error>.*)$")
_FAILED = re.compile(r"^FAILED: (?P<error>.*)$")


def rows_from_log(text: str) -> tuple[dict, list[dict]]:
    """({device, jax, dims, configs}, rows) of a run's printed log: one row per config line, with the fields the
    run writes as far as the line gives them (figures as printed); the config's fields, `smem_repo` and an invalid
    config's error come from `Fp8GemmConfig` (its printed start must match). ValueError on a log without the
    header line or with a config line it cannot read."""
    head, rows = None, []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            head = dict(device=m["device"], jax=m["jax"], dims=ast.literal_eval(m["dims"]), configs=int(m["n"]))
            continue
        m = _LINE.match(line)
        if not m:
            continue
        if head is None:
            raise ValueError("rows_from_log: a config line before the header line ('device ... jax ... dims')")
        case = m["case"]
        kw = dict(tile_m=int(m["tm"]), tile_n=int(m["tn"]), stages=int(m["s"]), compute_wgs=int(m["wgs"]),
                  m_sub=int(m["msub"]), swap_ab=bool(m["swap"]), swiglu=case in ("up_fused", "e2e_fused"),
                  chain=bool(m["chain"]))
        c = unchecked(**kw)
        row = dict(case=case, config=dataclasses.asdict(c), status=None)
        rest = m["rest"]
        if (hit := _INVALID.match(rest)):
            try:
                Fp8GemmConfig(**kw)
                raise ValueError(f"rows_from_log: line {m['idx']}: {short(c)} is printed invalid but is accepted")
            except ValueError as e:
                error = str(e)
            # logs printed before the `chain` field existed show configs without it (an unchained config)
            older = error.replace(", chain=False)", ")")
            if not (error.startswith(hit["error"]) or older.startswith(hit["error"])) \
                    or int(hit["smem_repo"]) != c.smem_bytes():
                raise ValueError(f"rows_from_log: line {m['idx']}: the printed error or estimate is not this "
                                 f"commit's: {hit['error']!r}, {hit['smem_repo']}")
            ms = None if hit["smem_mosaic"] == "None" else int(hit["smem_mosaic"])
            row.update(status="invalid", error=error[:300], smem_repo=c.smem_bytes(), smem_mosaic=ms,
                       smem_limit=cfg_mod.SMEM_LIMIT, over_repo=c.smem_bytes() - cfg_mod.SMEM_LIMIT,
                       over_mosaic=None if ms is None else ms - cfg_mod.SMEM_LIMIT)
        elif (hit := _TIMED.match(rest)):
            d, i, pairs = head["dims"]["hidden"], head["dims"]["width"], head["dims"]["tokens"] * head["dims"]["topk"]
            n_out, k = {"up_fused": (i, d), "e2e_fused": (i, d), "up_unfused": (2 * i, d),
                        "e2e_unfused": (2 * i, d), "down": (d, i)}[case]
            flops = 2.0 * pairs * (2 * i * d if case != "down" else d * i)
            row.update(smem_repo=c.smem_bytes(), N=n_out, K=k, pairs=pairs, flops=flops,
                       compile_s=float(hit["compile_s"]))
            row.update({key: float(hit[key]) for key in ("wall_ms", "tflops_wall", "dev_ms", "gemm_ms", "tflops_gemm")
                        if hit[key] is not None})
            if hit["rel_fro"] is not None:
                row["check"] = dict(rel_fro=float(hit["rel_fro"]), rel_max=float(hit["rel_max"]),
                                    ok=not hit["wrong"])
            row["status"] = "wrong" if hit["wrong"] else "ok"
        elif (hit := _FAILED.match(rest)):
            row.update(status="failed", error=hit["error"])
        else:
            raise ValueError(f"rows_from_log: line {m['idx']} not read: {line!r}")
        rows.append(row)
    if head is None:
        raise ValueError("rows_from_log: no header line ('device ... jax ... dims ... configs N')")
    return head, rows


def rebuild(args, argv: list[str] | None) -> int:
    """--from-log: write the record of a printed log (the run's date, commit and command from the flags)."""
    with open(args.from_log) as f:
        head, rows = rows_from_log(f.read())
    note = ("rows rebuilt from the lines the run printed (its record did not come back): figures as printed (ms to "
            "3 decimals, TF/s to 1, errors to 2 digits); no tflops_dev, M, tiles or the check's absolute errors; "
            "config fields, smem_repo and the invalid rows' errors from Fp8GemmConfig at the rebuild's commit")
    rec = {"date": args.run_date, "commit": args.run_commit, "device": head["device"], "jax": head["jax"],
           "command": args.run_command, "rows": rows, "dims": head["dims"], "impl": "mosaic",
           "smem_limit": cfg_mod.SMEM_LIMIT,
           "rebuilt": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "commit": git_commit(), "command": command_line(argv, script=__file__),
                       "note": note + (f"; {args.run_note}" if args.run_note else "")}}
    write_json(args.out, rec)
    print(f"{len(rows)} rows of {head['configs']} configs from {args.from_log} -> {args.out}", flush=True)
    summary(rows)
    return 0


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (4 groups, D = I = 256) under the interpreter")
    p.add_argument("--budget", type=float, default=0.0, help="start no new config after this many wall seconds")
    p.add_argument("--iters", type=int, default=10, help="timed calls per config (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", default="", help=f"comma list of cases to keep ({', '.join(CASES)})")
    p.add_argument("--start", type=int, default=1, help="first config to run (1-based, after --only): a second call "
                                                         "goes on where a budgeted first one stopped")
    p.add_argument("--out", default="fp8_gemm_configs.json",
                   help="the record's path (with --start N > 1: _fromN before .json)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed configs")
    p.add_argument("--from-log", default=None, metavar="LOG",
                   help="run nothing: write the record of the lines a run printed to --out")
    p.add_argument("--run-date", default=None, help="with --from-log: the date of the run (the log has none)")
    p.add_argument("--run-commit", default=None, help="with --from-log: the commit the run was at")
    p.add_argument("--run-command", default="python benchmarks/diagnostics/fp8_gemm_configs.py",
                   help="with --from-log: the command of the run")
    p.add_argument("--run-note", default="", help="with --from-log: added to the record's note")
    args = p.parse_args(argv)
    if args.from_log:
        if not (args.run_date and args.run_commit):
            p.error("--from-log needs --run-date and --run-commit (the printed log says neither)")
        return rebuild(args, argv)
    unknown = sorted(set(filter(None, args.only.split(","))) - set(CASES))
    if unknown:
        p.error(f"--only: unknown case(s) {', '.join(unknown)} (cases: {', '.join(CASES)})")
    dims = SMOKE if args.smoke else GLM52
    if args.smoke:
        args.iters, args.warmup = min(args.iters, 2), min(args.warmup, 1)
    plan = config_list()
    if args.only:
        keep = set(args.only.split(","))
        plan = [(c, kw) for c, kw in plan if c in keep]
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, "dims", dims, "configs", len(plan),
          flush=True)
    t = time.time()
    sweep = Sweep(args, dims, argv)
    print(f"inputs built in {time.time() - t:.1f} s; experts used {sweep.used}; writing {sweep.out}", flush=True)
    sweep.run(plan)
    summary(sweep.rows)
    print(f"done in {time.time() - sweep.t0:.0f} s", flush=True)
    return 1 if any(r["status"] in ("wrong", "failed") for r in sweep.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
