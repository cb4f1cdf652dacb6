"""The Mosaic GPU W8A8 routed experts (kernels/fp8_gemm, MoE impl "mosaic") at GLM-5.2 widths against the current
forms, in one run.

Shapes (256 experts, top-8, hidden 6144, expert width 2048; uniform random routing, K-major FP8 stacks with 128 x 128
block scales as the model keeps them):
  prefill, TP = 1, 8192 tokens (65536 routed rows): the whole routed-experts op (x quantised, rows grouped, gate+up
    GEMM with the SwiGLU epilogue, h quantised, down GEMM, combine) with the "grouped" layout, against the current
    FP8 prefill form (Triton impl, form "dequant": the experts dequantised to bf16, then the bf16 grouped GEMM) and
    XLA's bf16 matmul of the same FLOPs (one dense [rows, 6144] x [6144, 4096] and [rows, 2048] x [2048, 6144]);
  decode, the TP = 8 shard (width 256), T = 32 and 128: the whole op with the "swap_ab" layout, against the current
    FP8 decode form (Triton impl, form "w8a8") and XLA's bf16 experts (impl "xla" over the same experts in bf16);
  the activation quantisation alone (`quantize_rows`, one pass, against `quantize_rows_barrier`, the formulation
    it replaced) at x's and h's prefill shapes;
  the dense FP8 linears at their TP = 8 shards (kernels/fp8_linear, the model's [in, out] e4m3 weights with their
    grids), q_b (2048 -> 2048) and o_proj (2048 -> 6144), at prefill 8192 rows and decode 32: the Mosaic W8A8 GEMM
    with one group (impl "mosaic", form "w8a8": what the model form "w8a8_mosaic" runs, the per-call transpose of
    the [in, out] weight included), the same kernel over the release's [out, in] weight (w_layout "nk": no
    transpose), the model's current form (prefill "dequant": the weight dequantised to bf16, then XLA's GEMM;
    decode "fp8_linear": the Triton W8A16 kernel) and XLA's bf16 GEMM of the same shape.
The full run (no --quick) adds the grouped GEMMs alone at a few launch configs, the Triton W8A8 form at prefill and
the bf16 Triton experts at decode, and for the linears every decode row count, the Triton W8A8 form and the dense
layers' SwiGLU MLP at TP = 8 (6144 -> 2 x 1536 -> 6144: gate and up as one Mosaic GEMM with the SwiGLU epilogue, then
down, against the current forms of its three linears and XLA bf16).

Times are device time from CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`): the median over --iters calls
of the sum of every kernel of the call. TF/s count the real routed rows; hbm_fraction is the bytes the op must read
(the used experts' e4m3 weights and scales, or bf16 weights for the bf16 rows) over the time, over 4.8 TB/s (the
results schema's H200 figure; an H100 has 3.35 TB/s). Each FP8 op's output is compared with the Triton form of the
same row (rel_diff: W8A8 against W8A8 is bf16-rounding close, against "dequant" about 3%, the activation rounding).

Writes the record to --out: `rows` in benchmarks/results/moe.json's schema (DESIGN.md: op moe_prefill / moe_decode /
fp8_linear, weights, rows, tp, impl, device_us, tflops, hbm_fraction, plus form, dims, experts_used, rel_diff; the
linears' rows add linear, N, K, w_layout), `detail_rows`
(GEMMs alone, quantisation, the dense baseline), `failed` (what raised, with the error). Every row is printed as a
JSON line and the record rewritten as it comes, so a run cut short keeps what it measured.

    PYTHONPATH=. python benchmarks/bench_fp8_gemm_mosaic.py --quick --out fp8_mosaic.json    # ~4 min, one H100/H200
    PYTHONPATH=. python benchmarks/bench_fp8_gemm_mosaic.py --out fp8_mosaic_full.json      # ~7 min
    PYTHONPATH=. python benchmarks/bench_fp8_gemm_mosaic.py --quick --only linear            # the linears alone
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/bench_fp8_gemm_mosaic.py --smoke --out /tmp/s.json  # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import command_line, record, write_json
from kernels import fp8_formats, fp8_gemm, fp8_linear, moe
from kernels.fp8_gemm import Fp8GemmConfig, experts as fp8_experts
from kernels.fp8_linear import mosaic as fp8_linear_mosaic

HBM = 4.8e12  # the results schema's bytes/s (DESIGN.md)
E4M3 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Dims:
    """The model's routed-experts widths (experts, top-k, hidden, full expert width), the decode TP, and the dense
    linears' (q_lora rank, heads, q head width 192 + 64, v head width, dense MLP width)."""
    experts: int = 256
    topk: int = 8
    hidden: int = 6144
    width: int = 2048
    decode_tp: int = 8
    q_lora: int = 2048
    heads: int = 64
    q_head: int = 256
    v_head: int = 256
    dense_width: int = 12288

    def linears(self) -> dict:
        """{name: (K, N)} of the dense linears at the TP = decode_tp shard: q_b (columns split), o_proj (rows
        split)."""
        tp = self.decode_tp
        return {"q_b": (self.q_lora, self.heads * self.q_head // tp),
                "o_proj": (self.heads * self.v_head // tp, self.hidden)}


GLM52 = Dims()
SMOKE = Dims(experts=8, topk=2, hidden=256, width=256, decode_tp=2, q_lora=256, heads=4, q_head=128, v_head=128,
             dense_width=512)


class Run:
    """The rows, the record file and the budget of one run."""

    def __init__(self, args):
        self.args, self.t0 = args, time.time()
        self.rows, self.detail, self.failed = [], [], []
        self.on_gpu = jax.default_backend() == "gpu"
        self.kernel = "mosaic" if self.on_gpu else "mosaic_interpret"
        self.triton = "triton" if self.on_gpu else "triton_interpret"

    def elapsed(self) -> float:
        return time.time() - self.t0

    def over_budget(self, what: str) -> bool:
        if self.args.budget_s and self.elapsed() > self.args.budget_s:
            print(f"skipped (budget {self.args.budget_s} s spent): {what}", flush=True)
            self.failed.append({"what": what, "error": "skipped: budget spent"})
            return True
        return False

    def emit(self, row: dict, detail: bool = False):
        (self.detail if detail else self.rows).append(row)
        print(json.dumps(row), flush=True)
        self.write()

    def fail(self, what: str, e: Exception):
        traceback.print_exc()
        self.failed.append({"what": what, "error": repr(e)[:400]})
        self.write()

    def guarded(self, what: str, step: Callable[[], None]) -> bool:
        """One step of a sweep (`step()` times one form and emits its rows), named `what` in the record: once
        --budget_s is spent it is skipped and listed in `failed` as such; what it raises is listed in `failed` (the
        traceback printed) and the run goes on, so one form that fails to compile or run costs only its own row.
        False when the budget was spent (a sweep whose later steps would only be skipped too stops there), else
        True."""
        if self.over_budget(what):
            return False
        try:
            step()
        except Exception as e:  # a form that fails to compile or run is reported, not fatal
            self.fail(what, e)
        return True

    def write(self):
        if self.args.out:
            write_json(self.args.out, record(self.rows, command=command_line(script=__file__),
                                             detail_rows=self.detail, failed=self.failed,
                                             elapsed_s=round(self.elapsed(), 1)))

    def measure(self, f, *args) -> float:
        """Median device seconds of `f(*args)` (CUPTI: every kernel of the call) over --iters calls; on a CPU
        (--smoke) the median wall time."""
        out = jax.block_until_ready(f(*args))
        del out
        if not self.on_gpu:
            times = []
            for _ in range(self.args.iters):
                t = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append(time.perf_counter() - t)
            return statistics.median(times)
        from jax.experimental.mosaic.gpu import profiler
        _, per = profiler.measure(f, aggregate=False, iterations=self.args.iters)(*args)
        return statistics.median(sum(t for _, t in it) for it in per) * 1e-3


def random_e4m3(key, shape):
    """Random finite e4m3 values over the format's range (bytes drawn as uint32 words: uint8 draws build a 4x
    larger array first, which for the 6.4 GB TP = 1 stacks ran out of memory on an H100)."""
    *lead, last = shape
    b = jax.lax.bitcast_convert_type(jax.random.bits(key, (*lead, last // 4), jnp.uint32), jnp.uint8).reshape(shape)
    return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b ^ 0x01, b), E4M3)


def experts_fp8(key, dims: Dims, width: int):
    """K-major FP8 stacks (gate/up [E, width, D], down [E, D, width]) and their scale grids (scales spread over
    2^-12..2^-6, so the random e4m3 weights have products of a realistic size)."""
    ks = jax.random.split(key, 6)
    e, d = dims.experts, dims.hidden
    gate, up, down = random_e4m3(ks[0], (e, width, d)), random_e4m3(ks[1], (e, width, d)), random_e4m3(
        ks[2], (e, d, width))
    grid = lambda k, r, c: jax.random.uniform(k, (e, r // 128, c // 128), jnp.float32, 2.0 ** -12, 2.0 ** -6)  # noqa
    return (gate, up, down), dict(wg_scale=grid(ks[3], width, d), wu_scale=grid(ks[4], width, d),
                                  wd_scale=grid(ks[5], d, width), w_layout="nk")


def routing(key, t: int, dims: Dims):
    """experts [t, k] distinct per row (uniform), routing weights [t, k], and how many experts are used."""
    k1, k2 = jax.random.split(key)
    experts = jnp.argsort(jax.random.uniform(k1, (t, dims.experts)), axis=1)[:, :dims.topk].astype(jnp.int32)
    weights = jax.random.uniform(k2, (t, dims.topk), jnp.float32, 0.1, 1.0)
    return experts, weights, int(np.unique(np.asarray(experts)).size)


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def routed(run: Run, stage: str, t: int, tp: int, dims: Dims, key, quick: bool):
    """The whole routed-experts op at T rows: the Mosaic W8A8 experts against the current Triton form, and XLA bf16
    (prefill: the dense matmul of the same FLOPs; decode: impl "xla" over bf16 experts)."""
    width = dims.width // tp
    ks = jax.random.split(key, 3)
    (wg, wu, wd), fp8 = experts_fp8(ks[0], dims, width)
    experts, weights, used = routing(ks[1], t, dims)
    x = jax.random.normal(ks[2], (t, dims.hidden), jnp.bfloat16)
    op = "moe_prefill" if stage == "prefill" else "moe_decode"
    flops = 2.0 * t * dims.topk * 3 * width * dims.hidden
    fp8_read = used * 3 * width * dims.hidden * (1 + 4 / 128 / 128)
    base = dict(op=op, rows=t, tp=tp, dims=[dims.hidden, width, dims.experts], experts_used=used)
    layout = "grouped" if stage == "prefill" else "swap_ab"
    triton_forms = ["dequant"] + ([] if quick else ["w8a8"]) if stage == "prefill" else ["w8a8"]
    outs = {}

    def fp8_form(impl: str, form: str, up_config: Fp8GemmConfig | None = None):
        mosaic = form == "w8a8_mosaic"
        opts = dict(layout=layout, up_config=up_config) if mosaic else dict(form=form)
        f = jax.jit(functools.partial(moe.routed_experts, impl=impl, **opts, **fp8))
        sec = run.measure(f, x, experts, weights, wg, wu, wd)
        out = np.asarray(f(x, experts, weights, wg, wu, wd))
        row = dict(base, weights="fp8", impl=impl, form=form, device_us=sec * 1e6, tflops=flops / sec / 1e12,
                   hbm_fraction=fp8_read / sec / HBM)
        if "w8a8_mosaic" in outs:
            row["rel_diff_mosaic"] = rel_diff(outs["w8a8_mosaic"], out)
        if mosaic:
            up, down = fp8_experts.expert_configs(layout, t, dims.topk, dims.experts)
            row.update(layout=layout, config=[dataclasses.asdict(up_config or up), dataclasses.asdict(down)])
        outs.setdefault(form, out)
        run.emit(row)

    def bf16():
        kb = jax.random.split(ks[0], 3)
        if stage == "prefill":  # the same FLOPs as one dense GEMM chain (what cuBLAS does at this size)
            rows = t * dims.topk
            xr = jax.random.normal(kb[0], (rows, dims.hidden), jnp.bfloat16)
            w_up = jax.random.normal(kb[1], (dims.hidden, 2 * width), jnp.bfloat16) * 0.01
            w_dn = jax.random.normal(kb[2], (width, dims.hidden), jnp.bfloat16) * 0.01
            f = jax.jit(lambda a, b, c: (jax.nn.silu(a @ b[:, :width]) * (a @ b[:, width:])) @ c)
            sec = run.measure(f, xr, w_up, w_dn)
            run.emit(dict(base, weights="bf16", impl="xla", form="dense_same_flops", device_us=sec * 1e6,
                          tflops=flops / sec / 1e12, hbm_fraction=None))
        else:
            e, d = dims.experts, dims.hidden
            bg = jax.random.normal(kb[0], (e, d, width), jnp.bfloat16) * 0.01
            bu = jax.random.normal(kb[1], (e, d, width), jnp.bfloat16) * 0.01
            bd = jax.random.normal(kb[2], (e, width, d), jnp.bfloat16) * 0.01
            impls = ["xla"] + ([] if quick else [run.triton])
            for impl in impls:
                f = jax.jit(functools.partial(moe.routed_experts, impl=impl))
                sec = run.measure(f, x, experts, weights, bg, bu, bd)
                run.emit(dict(base, weights="bf16", impl=impl, form=moe.pick_mode(t, dims.topk, e) if impl == "xla"
                              else "bf16", device_us=sec * 1e6, tflops=flops / sec / 1e12,
                              hbm_fraction=used * 3 * width * d * 2 / sec / HBM))

    # prefill: the default gate+up tile (128 + 128 weight rows) and the narrow one (64 + 64, more stages)
    variants = [(run.kernel, "w8a8_mosaic", None)]
    if stage == "prefill":
        variants.append((run.kernel, "w8a8_mosaic", fp8_gemm.PREFILL_SWIGLU_NARROW))
    for impl, form, up in variants + [(run.triton, f, None) for f in triton_forms]:
        if run.guarded(f"{op} T={t} {impl} {form} {up or ''}", functools.partial(fp8_form, impl, form, up)):
            print("elapsed", round(run.elapsed(), 1), flush=True)
    del wg, wu, wd  # the FP8 stacks are freed before the bf16 ones are made
    run.guarded(f"{op} T={t} xla bf16", bf16)


def quantize(run: Run, shapes, key):
    """`quantize_rows` (one pass) against `quantize_rows_barrier` at the given [rows, K] shapes of bf16."""

    def one(x, outs: list, name: str, fn):
        rows, k = x.shape
        f = jax.jit(fn)
        sec = run.measure(f, x)
        outs.append(np.asarray(f(x)[0]).view(np.uint8))
        run.emit(dict(op="quantize_rows", rows=rows, K=k, impl="xla", form=name, device_us=sec * 1e6,
                      hbm_fraction=rows * k * (2 + 1 + 4 / 128) / sec / HBM,
                      same_bits=bool(np.array_equal(outs[0], outs[-1]))), detail=True)

    for rows, k in shapes:
        x = jax.random.normal(key, (rows, k), jnp.bfloat16)
        outs = []
        for name, fn in (("one_pass", fp8_gemm.quantize_rows), ("barrier", fp8_gemm.quantize_rows_barrier)):
            run.guarded(f"quantize_rows {rows}x{k} {name}", functools.partial(one, x, outs, name, fn))
        del x


def gemms(run: Run, stage: str, t: int, tp: int, dims: Dims, key):
    """The grouped GEMMs alone (no quantisation, gather or combine) at a few launch configs."""
    width = dims.width // tp
    (wg, wu, wd), fp8 = experts_fp8(key, dims, width)
    experts, _, used = routing(key, t, dims)
    if stage == "prefill":
        ups = [fp8_gemm.PREFILL_SWIGLU, fp8_gemm.PREFILL_SWIGLU_NARROW]
        downs = [Fp8GemmConfig(tile_n=128, stages=4), Fp8GemmConfig(tile_n=256, stages=3),
                 Fp8GemmConfig(tile_m=256, tile_n=128, stages=3, m_sub=2)]
    else:
        ups = [Fp8GemmConfig(tile_m=tm, tile_n=256, stages=s, swap_ab=True, swiglu=True) for tm in (8, 16)
               for s in (4, 6)]
        downs = [Fp8GemmConfig(tile_m=tm, tile_n=128, stages=6, swap_ab=True) for tm in (8, 16)]
    pairs = t * dims.topk

    def one(which: str, cfg: Fp8GemmConfig, w, s, k: int, n: int):
        tg = fp8_experts.pair_rows(experts, dims.experts, cfg.tile_m).tile_group
        m = tg.shape[0] * cfg.tile_m
        a_q, s_a = fp8_gemm.quantize_rows(jax.random.normal(key, (m, k), jnp.bfloat16))
        f = jax.jit(functools.partial(fp8_gemm.grouped_matmul, impl=run.kernel, config=cfg))
        sec = run.measure(f, a_q, s_a, w, s, tg)
        flops = 2.0 * pairs * k * n * (2 if cfg.swiglu else 1)
        read = used * n * k * (2 if cfg.swiglu else 1) * (1 + 4 / 128 / 128) + pairs * k
        run.emit(dict(op="fp8_grouped_gemm", stage=stage, which=which, rows=t, tp=tp, impl=run.kernel,
                      config=dataclasses.asdict(cfg), N=n, K=k, device_us=sec * 1e6,
                      tflops=flops / sec / 1e12, hbm_fraction=read / sec / HBM), detail=True)

    for which, configs, w, s, k, n in (("gate_up", ups, (wg, wu), (fp8["wg_scale"], fp8["wu_scale"]), dims.hidden,
                                        width),
                                       ("down", downs, wd, fp8["wd_scale"], width, dims.hidden)):
        for cfg in configs:
            if not run.guarded(f"grouped gemm {stage} {which} {cfg}", functools.partial(one, which, cfg, w, s, k, n)):
                return  # the budget is spent: the stage's remaining configs are not listed one by one


def fp8_weight(key, k: int, n: int):
    """A random e4m3 weight in the model's [in, out] layout [K, N] and its grid [K/128, N/128] (scales over
    2^-12..2^-6)."""
    kq, ks = jax.random.split(key)
    grid = jax.random.uniform(ks, (-(-k // 128), -(-n // 128)), jnp.float32, 2.0 ** -12, 2.0 ** -6)
    return random_e4m3(kq, (k, n)), grid


def dequant_matmul(x, w, s):
    """The model form "dequant": the [in, out] weight dequantised to x's dtype, then XLA's GEMM."""
    wd = fp8_formats.dequantize_weight_blocks(w, s, 0, 0, dtype=x.dtype)
    return jnp.dot(x, wd, preferred_element_type=jnp.float32).astype(x.dtype)


def linear_forms(run: Run, stage: str, quick: bool) -> list:
    """(form, impl, w_layout, function of (x, w [K, N], grid)) of one FP8 linear: the Mosaic W8A8 GEMM over the
    model's layout and over the release's (the weight transposed before timing), the model's current form, and in
    the full run the Triton W8A8 kernel."""
    mosaic = functools.partial(fp8_linear.fp8_linear, form="w8a8", impl=run.kernel)
    forms = [("w8a8_mosaic", run.kernel, "kn", functools.partial(mosaic, w_layout="kn")),
             ("w8a8_mosaic", run.kernel, "nk", lambda x, w, s: mosaic(x, w, s, w_layout="nk"))]
    if stage == "prefill":
        forms.append(("dequant", "xla", "kn", dequant_matmul))
    else:
        forms.append(("fp8_linear", run.triton, "kn", functools.partial(fp8_linear.fp8_linear, form="w8a16",
                                                                        impl=run.triton, w_layout="kn")))
    if not quick:
        forms.append(("w8a8", run.triton, "kn", functools.partial(fp8_linear.fp8_linear, form="w8a8",
                                                                  impl=run.triton, w_layout="kn")))
    return forms


def linear(run: Run, stage: str, t: int, dims: Dims, key, quick: bool):
    """The dense FP8 linears at the TP shard (`Dims.linears`) at T rows: the Mosaic W8A8 GEMM against the model's
    current form and XLA bf16 (module docstring)."""
    for name, (k, n) in dims.linears().items():
        one_linear(run, stage, t, dims, name, k, n, jax.random.fold_in(key, k * 7 + n), quick)


def one_linear(run: Run, stage: str, t: int, dims: Dims, name: str, k: int, n: int, key, quick: bool):
    """`linear` for one of the linears ([K, N] weight, named `name` in the rows), its inputs drawn from `key`."""
    ks = jax.random.split(key, 3)
    w, s = fp8_weight(ks[0], k, n)
    x = jax.random.normal(ks[1], (t, k), jnp.bfloat16)
    flops = 2.0 * t * k * n
    act = t * (k + n) * 2  # bf16 rows in and out
    base = dict(op="fp8_linear", linear=name, rows=t, tp=dims.decode_tp, N=n, K=k, stage=stage)
    outs = {}

    def fp8_form(form: str, impl: str, w_layout: str, fn):
        args = (x, w.T, s.T) if w_layout == "nk" else (x, w, s)
        f = jax.jit(fn)
        sec = run.measure(f, *args)
        out = np.asarray(f(*args).astype(jnp.float32))
        row = dict(base, weights="fp8", impl=impl, form=form, w_layout=w_layout, device_us=sec * 1e6,
                   tflops=flops / sec / 1e12, hbm_fraction=(n * k * (1 + 4 / 128 / 128) + act) / sec / HBM)
        if form == "w8a8_mosaic":
            layout = fp8_linear.mosaic_layout(t)
            cfg = fp8_linear_mosaic.linear_config(layout, t)
            row.update(layout=layout, config=dataclasses.asdict(cfg))
            outs.setdefault("w8a8_mosaic", out)
        if "w8a8_mosaic" in outs:
            row["rel_diff_mosaic"] = rel_diff(out, outs["w8a8_mosaic"])
        run.emit(row)

    def bf16():
        wb = jax.random.normal(ks[2], (k, n), jnp.bfloat16) * 0.01
        f = jax.jit(lambda a, b: jnp.dot(a, b))
        sec = run.measure(f, x, wb)
        run.emit(dict(base, weights="bf16", impl="xla", form="bf16", w_layout="kn", device_us=sec * 1e6,
                      tflops=flops / sec / 1e12, hbm_fraction=(2 * n * k + act) / sec / HBM))

    for form, impl, w_layout, fn in linear_forms(run, stage, quick):
        run.guarded(f"fp8_linear {name} T={t} {impl} {form} {w_layout}", functools.partial(fp8_form, form, impl,
                                                                                            w_layout, fn))
    if run.guarded(f"fp8_linear {name} T={t} xla bf16", bf16):
        print("elapsed", round(run.elapsed(), 1), flush=True)


def dense_mlp(run: Run, stage: str, t: int, dims: Dims, key):
    """The dense layers' SwiGLU MLP at the TP shard (hidden -> 2 x dense_width / tp -> hidden) at T rows: gate and
    up as one Mosaic GEMM with the SwiGLU epilogue, then down through the Mosaic linear (what the model runs under
    "w8a8_mosaic"), against the current form of each linear and XLA bf16."""
    d, i = dims.hidden, dims.dense_width // dims.decode_tp
    ks = jax.random.split(key, 5)
    (wg, sg), (wu, su), (wd, sd) = fp8_weight(ks[0], d, i), fp8_weight(ks[1], d, i), fp8_weight(ks[2], i, d)
    x = jax.random.normal(ks[3], (t, d), jnp.bfloat16)
    flops = 2.0 * t * 3 * d * i
    base = dict(op="fp8_linear", linear="dense_mlp", rows=t, tp=dims.decode_tp, N=i, K=d, stage=stage,
                w_layout="kn")

    def mosaic(x, wg, wu, wd, sg, su, sd):
        h = fp8_linear.fp8_swiglu(x, wg, wu, sg, su, impl=run.kernel, w_layout="kn")
        return fp8_linear.fp8_linear(h, wd, sd, form="w8a8", impl=run.kernel, w_layout="kn")

    def current(x, wg, wu, wd, sg, su, sd):
        if stage == "prefill":
            one = dequant_matmul
        else:
            one = functools.partial(fp8_linear.fp8_linear, form="w8a16", impl=run.triton, w_layout="kn")
        return one(jax.nn.silu(one(x, wg, sg)) * one(x, wu, su), wd, sd)

    outs = {}

    def fp8_form(form: str, impl: str, fn):
        f = jax.jit(fn)
        args = (x, wg, wu, wd, sg, su, sd)
        sec = run.measure(f, *args)
        out = np.asarray(f(*args).astype(jnp.float32))
        outs.setdefault(form, out)
        row = dict(base, weights="fp8", impl=impl, form=form, device_us=sec * 1e6, tflops=flops / sec / 1e12,
                   hbm_fraction=3 * d * i * (1 + 4 / 128 / 128) / sec / HBM)
        if form != "w8a8_mosaic" and "w8a8_mosaic" in outs:
            row["rel_diff_mosaic"] = rel_diff(out, outs["w8a8_mosaic"])
        run.emit(row)

    def bf16():
        bg, bu, bd = (jax.random.normal(jax.random.fold_in(ks[4], j), shape, jnp.bfloat16) * 0.01
                      for j, shape in enumerate(((d, i), (d, i), (i, d))))
        f = jax.jit(lambda a, g, u, dn: (jax.nn.silu(a @ g) * (a @ u)) @ dn)
        sec = run.measure(f, x, bg, bu, bd)
        run.emit(dict(base, weights="bf16", impl="xla", form="bf16", device_us=sec * 1e6, tflops=flops / sec / 1e12,
                      hbm_fraction=3 * d * i * 2 / sec / HBM))

    for form, impl, fn in (("w8a8_mosaic", run.kernel, mosaic),
                           ("dequant", "xla", current) if stage == "prefill" else ("fp8_linear", run.triton, current)):
        if not run.guarded(f"dense_mlp T={t} {impl} {form}", functools.partial(fp8_form, form, impl, fn)):
            return  # the budget is spent: what is left of the MLP is not listed one by one
    run.guarded(f"dense_mlp T={t} xla bf16", bf16)


def main(argv: list[str] | None = None):
    """Time the Mosaic W8A8 routed experts and their baselines; write the record to --out."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="fp8_gemm_mosaic.json")
    p.add_argument("--iters", type=int, default=10, help="profiled calls per measurement (median)")
    p.add_argument("--only", default="quantize,prefill,decode,linear",
                   help="parts: quantize, prefill, decode (the routed experts), linear (the dense FP8 linears), and "
                        "gemms (the grouped GEMMs alone; on without --quick)")
    p.add_argument("--quick", action="store_true",
                   help="~4 min on one H100/H200: the whole op at prefill 8192 and decode 32/128 beside the current "
                        "Triton forms and XLA bf16, the quantisation, the dense linears q_b and o_proj at prefill "
                        "8192 and decode 32; no GEMM config sweep, no Triton W8A8 forms, no dense MLP")
    p.add_argument("--decode_rows", default="32,128")
    p.add_argument("--prefill_rows", type=int, default=8192)
    p.add_argument("--budget_s", type=float, default=0.0,
                   help="skip what starts after this many seconds (0: no budget; --quick: 230)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny widths (8 experts, top-2, hidden 256) under the interpreters: a CPU check of the script")
    args = p.parse_args(argv)
    if args.quick and not args.budget_s:
        args.budget_s = 230.0
    dims = SMOKE if args.smoke else GLM52
    if args.smoke:
        args.prefill_rows, args.decode_rows, args.iters = min(args.prefill_rows, 64), "4", min(args.iters, 2)
    run = Run(args)
    parts = set(args.only.split(","))
    if not args.quick and not args.smoke:
        parts.add("gemms")
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    key = jax.random.key(0)
    if "quantize" in parts:
        t = args.prefill_rows
        quantize(run, [(t, dims.hidden), (t * dims.topk, dims.width)], jax.random.fold_in(key, 1))
    if "prefill" in parts:
        routed(run, "prefill", args.prefill_rows, 1, dims, jax.random.fold_in(key, 2), args.quick or args.smoke)
    if "decode" in parts:
        for t in (int(r) for r in args.decode_rows.split(",")):
            routed(run, "decode", t, dims.decode_tp, dims, jax.random.fold_in(key, 3 + t), args.quick or args.smoke)
    if "linear" in parts:
        decode_rows = [int(r) for r in args.decode_rows.split(",")]
        linear(run, "prefill", args.prefill_rows, dims, jax.random.fold_in(key, 6), args.quick or args.smoke)
        for t in decode_rows[:1] if args.quick else decode_rows:
            linear(run, "decode", t, dims, jax.random.fold_in(key, 7 + t), args.quick or args.smoke)
        if not args.quick:
            dense_mlp(run, "prefill", args.prefill_rows, dims, jax.random.fold_in(key, 8))
            dense_mlp(run, "decode", decode_rows[0], dims, jax.random.fold_in(key, 9))
    if "gemms" in parts:
        gemms(run, "prefill", args.prefill_rows, 1, dims, jax.random.fold_in(key, 4))
        for t in (int(r) for r in args.decode_rows.split(",")):
            gemms(run, "decode", t, dims.decode_tp, dims, jax.random.fold_in(key, 5 + t))
    run.write()
    print("done", round(run.elapsed(), 1), "s;", len(run.rows), "rows,", len(run.detail), "detail rows,",
          len(run.failed), "failed", flush=True)
    return 1 if any(not f["error"].startswith("skipped") for f in run.failed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
