"""The benchmark suite: one command runs every area's benchmark on the GPU and writes the current figures.

    python -m benchmarks suite [--only AREA,...] [--out DIR] [--timeout-AREA S] [--smoke] [--results DIR]

Each area (`AREAS`) runs in a process of its own (`python -m benchmarks area NAME`: its compile caches and device
memory do not add up with the next area's) under its own timeout, and writes `results/AREA.json` in the schema of
DESIGN.md (Benchmarks): `{"date", "commit", "device", "jax", "command", "rows": [...]}`. An area that fails or
runs past its timeout is reported and the suite goes on; the exit code is then 1. An area that needs more devices
than the machine has is skipped with a line that says so (not a failure). With `--out DIR` the suite writes one
tarball of everything it wrote (the area JSONs and each area's log).

The area runners call the benchmarks themselves (each bench module's `main` with an `--out` file, or the engine
benchmark's `run_bench`) and turn their rows into the schema's (`moe_rows`, `e2e_row`). `--smoke` runs each area
at tiny sizes on whatever device there is (CPU included), for the tests: its figures measure nothing, so a smoke
run writes under `--results` (default: a new temporary folder), never over the committed results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
#: the exit code of an area process that did not run because the machine has too few devices
SKIPPED = 75
#: how the suite starts one area's process (then: NAME --results DIR [--smoke])
AREA_COMMAND = (sys.executable, "-m", "benchmarks", "area")
#: the keys every results file starts with (DESIGN.md, Benchmarks)
SCHEMA_KEYS = ("date", "commit", "device", "jax", "command", "rows")


@dataclasses.dataclass(frozen=True)
class Area:
    """One area of the suite: what it measures, how long it may take, how many devices it needs, and its runner
    (`run(smoke, work)` -> (rows, extra keys of the results file); `work` a folder for the benchmark's own files)."""

    name: str
    what: str
    timeout_s: int
    run: Callable[[bool, str], tuple[list[dict], dict]]
    min_devices: int = 1
    gpu_only: bool = False  # no smoke run (its benchmarks time GPU kernels: Triton / Mosaic GPU, profiler traces)
    spawns: bool = False  # its benchmark runs in processes of its own, which need the devices' memory


# ---------------------------------------------------------------------------------------------------------------
# area runners


def _bench_record(main: Callable, argv: list[str], work: str, name: str, flag: str = "--out") -> dict:
    """Run a benchmark's `main(argv + [flag, FILE])` in this process and return the record it wrote; a non-zero
    exit code (a benchmark's own check failed) is an error of the area."""
    path = os.path.join(work, f"{name}.json")
    rc = main([*argv, flag, path])
    if rc not in (0, None):
        raise RuntimeError(f"{name}: {main.__module__}.main returned {rc}")
    with open(path) as f:
        return json.load(f)


def _on_cpu() -> bool:
    import jax
    return jax.devices()[0].platform == "cpu"


#: the attention area's smoke run: three ops at one small size each (the Mosaic sparse MLA probe is the full run's)
ATTENTION_SMOKE = ["--ops", "sparse_mla,indexer,fused_norm_rope", "--timeout_s", "300",
                   "--extra", "sparse_mla=--batches 1 --formats bf16 --reps 3 --iters 2 --budget_s 0",
                   "--extra", "indexer=--batches 1 --reps 3 --iters 2",
                   "--extra", "fused_norm_rope=--tokens 64 --caches bfloat16 --default-only --iters 2"]


def run_attention(smoke: bool, work: str) -> tuple[list[dict], dict]:
    """Sparse MLA (xla, Triton, Mosaic GPU), the indexer and the fused norm/RoPE/cache write, each beside its xla
    reference in the same run (`benchmarks/bench_attention.py`, which runs each op's benchmark as a process)."""
    from benchmarks import bench_attention
    rec = _bench_record(bench_attention.main, ATTENTION_SMOKE if smoke else [], work, "attention")
    return rec["rows"], {k: rec[k] for k in ("commands", "failed") if k in rec}


#: `benchmarks/bench_fp8_gemm.py`'s linear shapes are those of one shard at TP = 8; its experts are all 256
LINEAR_TP = 8
#: a MoE row count above this is a prefill chunk, else a decode step
DECODE_ROWS_MAX = 128


def _moe_row(op: str, weights: str, rows: int, tp: int, impl: str, fig: dict, **extra) -> dict:
    return {"op": op, "weights": weights, "rows": rows, "tp": tp, "impl": impl, "device_us": fig["us"],
            "tflops": fig["tflops"], "hbm_fraction": fig["pct_hbm"] / 100, **extra}


def moe_rows(bench_rows: list[dict], impl: str = "triton") -> list[dict]:
    """`benchmarks/bench_fp8_gemm.py`'s rows (one per shape and row count, every form's figures in it) as moe.json
    rows (DESIGN.md): one per (op, weights, form, impl). `impl`: the kernel impl the benchmark ran (its --impl)."""
    out = []
    for r in bench_rows:
        t = r["T"]
        if r["op"] == "linear":
            where = {"name": r["name"], "N": r["N"], "K": r["K"]}
            out.append(_moe_row("fp8_linear", "bf16", t, LINEAR_TP, "xla", r["bf16_xla"], **where))
            for key, fig in r.items():
                if key.startswith("xla_fp8_"):
                    out.append(_moe_row("fp8_linear", "fp8", t, LINEAR_TP, "xla", fig, form=key[len("xla_fp8_"):],
                                        **where))
                elif isinstance(fig, dict) and "speedup_vs_bf16" in fig:
                    out.append(_moe_row("fp8_linear", "fp8", t, LINEAR_TP, impl, fig, form=key,
                                        speedup_vs_bf16=fig["speedup_vs_bf16"], **where))
        elif r["op"] == "moe":
            op = "moe_decode" if t <= DECODE_ROWS_MAX else "moe_prefill"
            where = {"dims": r["dims"], "experts_used": r["experts_used"]}
            out.append(_moe_row(op, "bf16", t, 1, impl, r["bf16"], **where))
            if "bf16_xla" in r:
                out.append(_moe_row(op, "bf16", t, 1, "xla", r["bf16_xla"], **where))
            for key, fig in r.items():
                if isinstance(fig, dict) and "speedup_vs_bf16" in fig:
                    out.append(_moe_row(op, "fp8", t, 1, impl, fig, form=key, speedup_vs_bf16=fig["speedup_vs_bf16"],
                                        **where))
            if "xla_fp8" in r:
                out.append(_moe_row(op, "fp8", t, 1, "xla", r["xla_fp8"], form="w8a16", **where))
    return out


def _config_label(c: dict) -> str:
    """An Fp8GemmConfig's fields (a dict) in a few words: tile, stages, and what is not the default."""
    words = [f"{c['tile_m']}x{c['tile_n']} s{c['stages']}"]
    words += [w for w, on in (("swap_ab", c.get("swap_ab")), ("swiglu", c.get("swiglu")),
                              (f"m_sub {c.get('m_sub')}", c.get("m_sub", 1) != 1),
                              (f"{c.get('compute_wgs')} WG", c.get("compute_wgs", 2) != 2),
                              ("chained", c.get("chain"))) if on]
    return " ".join(words)


def mosaic_moe_rows(rec: dict) -> list[dict]:
    """`benchmarks/bench_fp8_gemm_mosaic.py`'s record as moe.json rows: its rows (the whole routed-experts op,
    moe_prefill / moe_decode, and the dense FP8 linears, fp8_linear, each form beside its baselines) as they are,
    and its detail rows of the grouped GEMMs alone (op fp8_grouped_gemm, form: gate_up or down); each launch config
    as a label (up and down for the experts)."""
    out = []
    for r in rec["rows"]:
        r = dict(r)
        if isinstance(r.get("config"), list):  # the experts' (up, down) configs
            r["config"] = {"label": "up " + _config_label(r["config"][0]) + ", down " + _config_label(r["config"][1])}
        out.append(r)
    for r in rec.get("detail_rows", []):
        if r["op"] == "fp8_grouped_gemm":
            out.append(dict(r, weights="fp8", form=r["which"], config={"label": _config_label(r["config"])}))
    return out


def run_moe(smoke: bool, work: str) -> tuple[list[dict], dict]:
    """Routed experts (bf16 and FP8 grouped GEMMs) and the FP8 block-scaled linear layers against bf16 and their xla
    forms (`benchmarks/bench_fp8_gemm.py`), at GLM-5.2 widths; then on a GPU the Mosaic W8A8 grouped GEMM's
    experts, linears and GEMMs alone beside the current forms (`benchmarks/bench_fp8_gemm_mosaic.py`, whose own
    `--smoke` run is tested apart: under the Mosaic interpreter it would take minutes of a CPU smoke run)."""
    from benchmarks import bench_fp8_gemm, bench_fp8_gemm_mosaic
    impl = "triton_interpret" if smoke and _on_cpu() else "triton"
    argv = (["--impl", impl, "--batches", "1,16", "--linear", "256x384", "--moe_dims", "256,128,8", "--iters", "1",
             "--budget_s", "0"] if smoke else [])
    rec = _bench_record(bench_fp8_gemm.main, argv, work, "fp8_gemm")
    rows, extra = moe_rows(rec["rows"], impl), {"source_command": rec["command"]}
    if _on_cpu():
        print("moe: bench_fp8_gemm_mosaic.py not run on a CPU (Mosaic GPU kernels)", flush=True)
        return rows, extra
    mosaic = _bench_record(bench_fp8_gemm_mosaic.main, ["--smoke"] if smoke else [], work, "fp8_gemm_mosaic")
    extra["mosaic_source_command"] = mosaic["command"]
    return rows + mosaic_moe_rows(mosaic), extra


def e2e_row(res: dict, weights: str, fp8_experts_prefill: str | None = None,
            fp8_linears_prefill: str | None = None) -> dict:
    """An e2e.json row (DESIGN.md) of the engine benchmark's results (`glm_dsa.serving.benchmark.run_bench`, one impl):
    prefill seconds and MFU, decode ms per step by batch size; `fp8_experts_prefill` and `fp8_linears_prefill` name
    the FP8 routed experts' and dense linears' forms in prompt steps ("dequant" or "w8a8_mosaic"; FP8 rows of the
    suite, which sets them)."""
    (impl, r), = res["impls"].items()
    cfg = res["config"]
    extra = {k: v for k, v in (("fp8_experts_prefill", fp8_experts_prefill),
                               ("fp8_linears_prefill", fp8_linears_prefill)) if v is not None}
    return {"preset": cfg["preset"], "weights": weights, **extra, "batch_invariant": False, "impl": impl,
            "kv_cache": cfg["kv_cache_dtype"], "layers": res["layers"], "input_len": cfg["input_len"],
            "batch": cfg["batch"], "prefill_s": r.get("prefill_s"), "prefill_tokens_per_s": r.get("prefill_tokens_per_s"),
            "prefill_mfu": r.get("prefill_mfu"), **({"prefill_mfu_fp8_peak": r["prefill_mfu_fp8_peak"]}
                                                     if "prefill_mfu_fp8_peak" in r else {}),
            "decode_context": cfg["decode_context"] or cfg["input_len"],
            "decode_ms": {str(b): row.get("ms_per_step") for b, row in r["decode"].items()}}


#: The FP8 runs of the e2e area: the routed experts' and dense linears' form in prompt steps, and the value of
#: GLM_DSA_MOE_MOSAIC and GLM_DSA_FP8_LINEAR_MOSAIC that picks it whatever the `MOSAIC_ROWS` switches say (decode
#: steps keep the Triton forms in both).
E2E_FP8_PREFILL = (("dequant", "none"), ("w8a8_mosaic", "prefill"))


@contextlib.contextmanager
def _environ(name: str, value: str):
    """`name`=`value` in os.environ inside the block, the previous state after it (a step reads the kernel
    switches when it is traced, and each engine traces its own)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


#: GLM-5.2 at full width, 8 layers (3 dense, 5 MoE), FP8 weights and the fp8_ds_mla cache on one device: the
#: e2e area runs it where the device's allocator has GLM52_MIN_BYTES free (an H200: about 104 GB at the allocator's
#: default 75%; the run peaked at 86.4 GiB at B = 128), and says why not elsewhere.
GLM52_LAYERS = 8
GLM52_MIN_BYTES = 95e9


def run_e2e(smoke: bool, work: str) -> tuple[list[dict], dict]:
    """Prefill and decode of the `bench` preset with random weights: bf16 weights, then FP8 weights with each prompt
    step form of the routed experts (`E2E_FP8_PREFILL`; the second run's decode steps are the first's, so it
    times the prefill alone); then, where the device holds it (`GLM52_MIN_BYTES`), `GLM52_LAYERS` full-width
    GLM-5.2 layers with FP8 weights and the fp8_ds_mla cache, the experts' forms as the rules pick them
    (`glm_dsa.serving.benchmark.run_bench`, what `python -m glm_dsa bench` runs)."""
    from glm_dsa.model import loading
    from glm_dsa.serving.benchmark import BenchConfig, run_bench
    from kernels import fp8_linear, moe
    if smoke:
        base = BenchConfig(preset="tiny", num_layers=2, input_len=16, output_len=2, batch=1, decode_batches=(1,),
                           impls=("auto",), stages=False)
    else:
        base = BenchConfig(preset="bench", input_len=32768, output_len=16, batch=8, decode_batches=(1, 32, 128),
                           decode_context=32768, impls=("auto",))
    res = run_bench(dataclasses.replace(base, quantization=None))
    rows, runs = [e2e_row(res, "bf16")], {"bf16": res}
    for n, (form, switch) in enumerate(E2E_FP8_PREFILL):
        cfg = dataclasses.replace(base, quantization="fp8", decode_batches=base.decode_batches if n == 0 else ())
        with _environ(moe.MOSAIC_ENV, switch), _environ(fp8_linear.MOSAIC_ENV, switch):
            res = run_bench(cfg)
        rows.append(e2e_row(res, "fp8", form, form))
        runs[f"fp8_{form}"] = res
    extra = {"runs": runs}
    if smoke:
        return rows, extra
    room = loading.device_free_bytes()
    if room is None or room < GLM52_MIN_BYTES:
        free = "an unknown amount" if room is None else f"{room / 1e9:.0f} GB"
        extra["glm52_skipped"] = (f"glm52, {GLM52_LAYERS} layers, FP8: not run, it needs {GLM52_MIN_BYTES / 1e9:.0f} "
                                  f"GB of device memory and the allocator has {free} free")
        print(extra["glm52_skipped"], flush=True)
        return rows, extra
    res = run_bench(dataclasses.replace(base, preset="glm52", num_layers=GLM52_LAYERS, quantization="fp8",
                                        kv_cache_dtype="fp8_ds_mla"))
    rows.append(e2e_row(res, "fp8", *("w8a8_mosaic" if "prefill" in m.mosaic_rows() else "dequant"
                                       for m in (moe, fp8_linear))))
    runs["glm52_fp8"] = res
    return rows, extra


def _args_run(module: str, smoke_argv: list[str], argv: list[str], flag: str = "--out", cpu_flag: bool = False):
    """An area runner of `benchmarks/MODULE.py`'s `main`: `argv` for the figures, `smoke_argv` for a smoke run
    (with `--cpu` in front on a CPU where the benchmark has that flag: it then sets up CPU devices itself)."""
    def run(smoke: bool, work: str) -> tuple[list[dict], dict]:
        mod = __import__(f"benchmarks.{module}", fromlist=["main"])
        args = (["--cpu"] if cpu_flag and _on_cpu() else []) + smoke_argv if smoke else argv
        rec = _bench_record(mod.main, args, work, module, flag)
        return rec["rows"], {k: v for k, v in rec.items() if k not in SCHEMA_KEYS} | {"source_command": rec["command"]}
    run.__doc__ = f"`benchmarks/{module}.py`'s rows (`main` with {' '.join(argv) or 'its defaults'})."
    return run


#: the serving area's workloads: random prompts (continuous batching against static groups; host overhead per
#: decode step), then the multi-turn chat with automatic prefix caching against without (32 conversations x 4
#: turns on a 2K-token system prompt, Poisson arrivals; both engines get the same pages)
SERVING_RUNS = (
    (["--preset", "tiny", "--num-requests", "4", "--input-len", "16", "--output-len", "4", "--max-num-seqs", "2",
      "--warm-passes", "1"],
     ["--host-overhead-batches", "1,32,128"]),
    (["--preset", "tiny", "--workload", "multi-turn", "--conversations", "2", "--turns", "2", "--system-len", "32",
      "--user-len", "4", "--output-len", "2", "--block-size", "16", "--max-num-seqs", "2", "--warm-passes", "1"],
     ["--workload", "multi-turn", "--conversations", "32", "--turns", "4", "--system-len", "2048", "--user-len", "64",
      "--output-len", "128", "--request-rate", "4", "--block-size", "64", "--max-num-seqs", "32",
      "--max-num-batched-tokens", "8192", "--num-pages", "1600"]),
)


def run_serving(smoke: bool, work: str) -> tuple[list[dict], dict]:
    """`benchmarks/bench_serving.py`'s rows of each of `SERVING_RUNS` (`main` with those arguments): one results
    file whose `sources` are the runs, every row naming its own (`source`)."""
    from benchmarks import bench_serving
    rows, sources = [], []
    for i, (smoke_argv, argv) in enumerate(SERVING_RUNS):
        args = (["--cpu"] if _on_cpu() else []) + smoke_argv if smoke else argv
        rec = _bench_record(bench_serving.main, args, work, f"bench_serving_{i}")
        sources.append({k: rec[k] for k in SCHEMA_KEYS if k != "rows"})
        rows += [{**r, "source": i} for r in rec["rows"]]
    return rows, {"sources": sources}


run_dcp = _args_run(
    "bench_dcp", ["--preset", "tiny", "--tp", "2", "--dcp", "2", "--variants", "qrep:a2a", "--input-len", "16",
                  "--output-len", "2", "--batch", "1", "--identity-steps", "2", "--identity-prompt-len", "16",
                  "--identity-batch", "1"],
    ["--tp", "2", "--dcp", "2"], cpu_flag=True)
run_mtp = _args_run(
    "bench_mtp", ["--preset", "tiny", "--num-speculative-tokens", "1", "--decode-batches", "1", "--decode-context", "32",
                  "--input-len", "8", "--output-len", "4"],
    [], flag="--json-out")
run_multihost = _args_run(
    "bench_multihost", ["--preset", "tiny", "--tp", "2", "--input-len", "16", "--output-len", "4"],
    ["--preset", "heads", "--num-layers", "2", "--tp", "2"], cpu_flag=True)

run_projection = _args_run(
    "bench_projection", ["--preset", "tiny", "--tp", "4", "--dcp", "1,2", "--concurrency", "1,2", "--input-len", "32",
                         "--output-len", "8", "--dtype", "float32", "--quantization", "none", "--kv-cache-dtype",
                         "auto", "--iters", "1"],
    [])

AREAS = {a.name: a for a in (
    Area("attention", "sparse MLA, indexer, fused norm/RoPE/cache write kernels beside xla", 1800, run_attention,
         gpu_only=True, spawns=True),
    Area("moe", "routed experts and FP8 GEMMs (bf16 vs FP8 weights; the Mosaic W8A8 grouped GEMM)", 1800, run_moe),
    Area("e2e", "engine prefill and decode: bench preset, bf16 and FP8 weights (both FP8 prefill forms); glm52, 8 "
                "FP8 layers", 2400, run_e2e),
    Area("serving", "continuous batching against static groups; host overhead per decode step", 900, run_serving),
    Area("mtp", "MTP draft + verify against plain decode", 900, run_mtp),
    Area("dcp", "decode context parallelism: identity with DCP = 1 and the cost of each variant", 1200, run_dcp,
         min_devices=2),
    Area("multihost", "N processes of one GPU against one process of N GPUs", 1200, run_multihost, min_devices=2,
         spawns=True),
    Area("projection", "GLM-5.2 FP8 on an 8-GPU node (TP 8, DCP 1 and 8) projected from one device's share on one "
         "GPU and modelled collectives, beside SGLang's published figures", 570, run_projection),
)}


# ---------------------------------------------------------------------------------------------------------------
# one area, in its own process


def run_area(name: str, smoke: bool, results: str) -> int:
    """Run one area in this process and write `results/NAME.json`; `SKIPPED` where the machine has too few
    devices (or no GPU for a GPU-only area), 0 when written, 1 when written but a part of the area failed."""
    area = AREAS[name]
    if smoke and os.environ.get("JAX_PLATFORMS", "") == "cpu" and area.min_devices > 1:
        # the smoke runs of several-device areas use simulated CPU devices; set before jax starts a backend
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ)
    if area.spawns:  # this process only counts the devices: JAX's default would take 75% of each one's memory
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    from benchmarks.harness import record, write_json
    devices = jax.devices()
    os.environ.clear()
    os.environ.update(env)  # the benchmark's own processes start as this one was started
    if area.gpu_only and devices[0].platform != "gpu":
        print(f"{name}: skipped: needs a GPU (found {devices[0].platform})", flush=True)
        return SKIPPED
    if len(devices) < area.min_devices:
        print(f"{name}: skipped: needs {area.min_devices} devices, found {len(devices)}", flush=True)
        return SKIPPED
    with tempfile.TemporaryDirectory() as work:
        rows, extra = area.run(smoke, work)
    command = f"python -m benchmarks suite --only {name}" + (" --smoke" if smoke else "")
    os.makedirs(results, exist_ok=True)
    write_json(os.path.join(results, f"{name}.json"), record(rows, command=command, **extra))
    if extra.get("failed"):  # the rows of what ran are written; the area still fails
        print(f"{name}: failed: {', '.join(extra['failed'])} (their output is above)", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------------------
# the suite


def parse_only(only: str | None) -> list[str]:
    """The areas of `--only` (comma-separated; None or '': all, in `AREAS` order); SystemExit naming an unknown
    area."""
    if not only:
        return list(AREAS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in AREAS]
    if unknown or not names:
        raise SystemExit(f"suite: --only: unknown area {', '.join(map(repr, unknown)) or repr(only)} "
                         f"(areas: {', '.join(AREAS)})")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's flags: --only, --out, --results, --smoke and a --timeout-AREA per area."""
    p.add_argument("--only", default=None, help=f"comma-separated areas (default: all of {', '.join(AREAS)})")
    p.add_argument("--out", default=None, help="also write one tarball of everything the run wrote into this folder")
    p.add_argument("--results", default=None,
                   help="folder of the AREA.json files (default: benchmarks/results; with --smoke a new temporary "
                        "folder)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on any device (a check of the suite, not figures)")
    for a in AREAS.values():
        p.add_argument(f"--timeout-{a.name}", type=float, default=a.timeout_s, metavar="S",
                       help=f"seconds the {a.name} area may take (default {a.timeout_s}): {a.what}")


def _check_timeouts(args) -> None:
    for name in AREAS:
        t = getattr(args, f"timeout_{name}")
        if not t > 0:
            raise SystemExit(f"suite: --timeout-{name} must be a number of seconds > 0, got {t!r}")


def _run_one(name: str, args, results: str, logs: str) -> tuple[str, str]:
    """Run area `name` as a process under its timeout; (status, detail): status 'ok', 'skipped', 'failed' or
    'timeout'."""
    timeout = getattr(args, f"timeout_{name}")
    cmd = [*AREA_COMMAND, name, "--results", results] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    log_path = os.path.join(logs, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the area's own children (bench_attention's op processes) too
            proc.wait()
            return "timeout", f"ran past --timeout-{name} {timeout:g} s (log: {log_path})"
    with open(log_path) as f:
        tail = f.read()[-2000:]
    if rc == SKIPPED:
        return "skipped", tail.strip().splitlines()[-1] if tail.strip() else "skipped"
    if rc != 0:
        return "failed", f"exit code {rc}; the end of its log ({log_path}):\n{tail}"
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return "failed", f"exit code 0 but no {path}"
    with open(path) as f:
        n = len(json.load(f)["rows"])
    return "ok", f"{n} rows -> {path}"


def run_suite(args) -> int:
    """Run the areas of parsed `add_arguments` flags one after another; 0 when none failed or timed out."""
    names = parse_only(args.only)
    _check_timeouts(args)
    results = args.results or (tempfile.mkdtemp(prefix="benchmarks-smoke-") if args.smoke else RESULTS)
    logs = tempfile.mkdtemp(prefix="benchmarks-logs-")
    status = {}
    for name in names:
        print(f"suite: {name}: started ({AREAS[name].what}; timeout {getattr(args, f'timeout_{name}'):g} s)",
              flush=True)
        t0 = time.time()
        status[name], detail = _run_one(name, args, results, logs)
        print(f"suite: {name}: {status[name]} in {time.time() - t0:.0f} s: {detail}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        tar_path = os.path.join(args.out, f"benchmarks-{stamp}.tar.gz")
        with tarfile.open(tar_path, "w:gz") as tar:
            for name in names:
                for path, arc in ((os.path.join(results, f"{name}.json"), f"results/{name}.json"),
                                  (os.path.join(logs, f"{name}.log"), f"logs/{name}.log")):
                    if os.path.exists(path):
                        tar.add(path, arcname=arc)
        print(f"suite: wrote {tar_path}", flush=True)
    bad = [n for n, s in status.items() if s in ("failed", "timeout")]
    print("suite: " + ", ".join(f"{n} {s}" for n, s in status.items()) + (f"; results in {results}"), flush=True)
    return 1 if bad else 0
