"""What `python -m glm_dsa bench` runs: prefill and decode of a reduced-depth GLM-5.2 with random weights (the
engine benchmark), and with `--num-speculative-tokens` the cost of MTP speculative decoding; the timer and the JSON
record they share. benchmarks/ builds its suite on these (benchmarks/bench_engine.py, bench_mtp.py and
harness.py import them); nothing here imports benchmarks/.

The engine benchmark reports prefill tokens/s and MFU, decode ms/step at several batch sizes (caches filled with
random rows, so no long prefill is needed to reach a context length), a per-stage breakdown of one decode step
(each stage timed alone at the step's shapes, times the number of layers that run it), the attention bytes roofline
and peak device memory. Every impl runs in the same process on the same weights. Token ids are drawn from the
model's vocabulary. The step's collectives are not timed apart: the breakdown (each op alone on one device, at the
shapes of one TP shard) lists them as not measured rather than as a number; `-tp` / `-dcp` run the end-to-end and
decode steps on that mesh, and the distributed flags (`--coordinator-address HOST:PORT --num-processes N
--process-id I`, one process per host) run them across processes: process 0 reports (peak memory is that of its
first device), and the per-stage breakdown is skipped there (it is one device's, the same as a one-process run's).
Every process makes the same sequence of device calls: nothing device-side is run by one process alone, and no loop
count depends on a clock.

The MTP benchmark (docs/math.md §12; `run_mtp`): the cost of a draft + verify step against a plain decode step,
and tokens/s at batch 1, with random weights (a preset plus a random nextn layer) and caches filled with random
rows.
1. Step cost at each batch B and draft count k, every row a distinct random token (as the engine benchmark's decode
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

Timing (DESIGN.md, Benchmarks): warm up, then the median of many `jax.block_until_ready` timings; an op's device
time is the difference of two executables that run it n_hi and n_lo times (`per_op_time`, `device_time`), so the
fixed cost of dispatching an executable cancels.

    python -m glm_dsa bench --help
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glm_dsa.serving import host_buffer
from glm_dsa.model.config import GlmDsaConfig
from glm_dsa.serving.engine import Engine
from glm_dsa.model.random_init import init_params
from glm_dsa.model.layers import StepBatch
from glm_dsa.model.mtp import init_mtp_params
from glm_dsa.model.paged_cache import KV_CACHE_DTYPES, pages_needed
from glm_dsa.serving.sampling import SamplingParams
from glm_dsa.serving.scheduler import Request, StepPlan
from glm_dsa.serving.spec_decoder import SpecDecoder
from glm_dsa.model.step import step
from kernels import fused_norm_rope, indexer, sparse_mla
from kernels.common.fp8_formats import quantize_index_rows, quantize_mla_rows
from sharding import ParallelConfig

#: the repository root (the folder that holds the glm_dsa package): where the commit is read and a script's path
#: is made relative to
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------------------------
# device peaks


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """Roofline figures of a device kind: HBM bytes/s, dense bf16 and dense FP8 (e4m3) FLOP/s (datasheet values).

    `known` is False when the device is not in `PEAKS`: the figures are then the reference device's, and `name`
    says so, so that a percentage computed from them is read as "of the H200's roofline", not of this device's."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    known: bool = True


#: datasheet peaks by `jax.Device.device_kind`
PEAKS = {"NVIDIA H200": DevicePeaks("NVIDIA H200", hbm_bytes_per_s=4.8e12, bf16_flops_per_s=989e12,
                                    fp8_flops_per_s=1979e12)}
#: the device whose roofline stands in for an unknown one (DESIGN.md reports percentages of the H200 roofline)
REFERENCE_DEVICE = "NVIDIA H200"


def device_kind(device=None) -> str:
    """The kind of `device` (a `jax.Device`, a kind string, or None for the first device), e.g. 'NVIDIA H200'."""
    if isinstance(device, str):
        return device
    device = jax.devices()[0] if device is None else device
    return getattr(device, "device_kind", str(device))


def device_peaks(device=None) -> DevicePeaks:
    """The peaks of `device` (see `device_kind`); an unknown kind gets the reference device's figures with
    `known=False` and a name that says 'unknown device'."""
    kind = device_kind(device)
    if kind in PEAKS:
        return PEAKS[kind]
    return dataclasses.replace(PEAKS[REFERENCE_DEVICE], known=False,
                               name=f"unknown device {kind!r}: the {REFERENCE_DEVICE} roofline as a reference")


def peak_bytes(device) -> int | None:
    """The device allocator's peak bytes in use so far (None where the backend does not say: CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


# ---------------------------------------------------------------------------------------------------------------
# the timer


def check_count(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def median_seconds(call: Callable[[], Any], *, warmup: int = 2, reps: int = 10, calls_per_rep: int = 1) -> float:
    """Median wall seconds of `call()` after `warmup` calls, each blocked until its result is ready.

    A sample is `calls_per_rep` consecutive calls blocked once at the end, divided by `calls_per_rep`: calls that
    depend on each other (a decode loop threading donated caches) then overlap dispatch with execution as they do
    in a real loop. `call` may close over state it updates (donated buffers)."""
    check_count("warmup", warmup, 0)
    check_count("reps", reps, 1)
    check_count("calls_per_rep", calls_per_rep, 1)
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls_per_rep):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls_per_rep)
    return statistics.median(times)


def timeit(fn, *args, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of `fn(*args)` (blocked until ready) after warm-up calls."""
    return median_seconds(lambda: fn(*args), warmup=warmup, reps=reps)


def per_op_time(make: Callable[[int], Callable], args: tuple, reps: int, iters: int, lo: int = 1,
                warmup: int = 1) -> tuple[float, float]:
    """Device seconds of one op and the amortised seconds per op of the `reps`-op executable.

    `make(n)` builds an executable that runs the op n times; the first figure is (T(reps) - T(lo)) / (reps - lo),
    in which the fixed cost of dispatching and synchronising an executable cancels (floored at 1 ns: a quotient
    by it stays finite), the second T(reps) / reps. Each T is `timeit` over `iters` runs."""
    check_count("iters", iters, 1)
    if reps <= lo:
        raise ValueError(f"reps ({reps}) must exceed lo ({lo}): the difference of the two executables is the time")
    t_hi = timeit(make(reps), *args, warmup=warmup, reps=iters)
    t_lo = timeit(make(lo), *args, warmup=warmup, reps=iters)
    return max(t_hi - t_lo, 1e-9) / (reps - lo), t_hi / reps




def nudge(x, y):
    """x plus a tiny multiple of y: a data dependency between loop iterations that XLA cannot remove."""
    return x + (jnp.sum(y.astype(jnp.float32)) * 1e-9).astype(x.dtype)




def device_time(body, carry, *consts, reps: int = 10, iters: int = 5) -> float:
    """Device seconds of one `body(carry, *consts) -> carry`, from executables that loop it in a fori_loop:
    (T(1 + reps) - T(1)) / reps (`per_op_time`)."""
    def looped(n):
        return jax.jit(lambda c, *k: jax.lax.fori_loop(0, n, lambda i, c: body(c, *k), c))
    return per_op_time(looped, (carry, *consts), 1 + reps, iters, lo=1, warmup=2)[0]


# ---------------------------------------------------------------------------------------------------------------
# JSON records


def git_commit(repo: str | None = None) -> str | None:
    """The short commit of `repo` ('+dirty' when tracked files differ from it), or None outside a git checkout."""
    repo = repo or _REPO
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def command_line(argv: list[str] | None = None, script: str | None = None) -> str:
    """The command that ran: `python PATH` for a `script` file (its path from the repository root), else how this
    process was started (`python -m PACKAGE` or `python PATH`), then `argv` (default: the process's arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if script is not None:
        prog = f"python {os.path.relpath(os.path.abspath(script), _REPO)}"
    else:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        prog = (f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None and spec.name
                else f"python {sys.argv[0]}")
    return f"{prog} {shlex.join(argv)}".strip()


def record(rows: Iterable[dict], /, *, command: str | None = None, device=None, **extra) -> dict:
    """The JSON record of a run: date (UTC), commit, device kind, jax version, command and rows, then `extra`
    keys (the results schema of DESIGN.md, Benchmarks)."""
    head = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "device": device_kind(device), "jax": jax.__version__,
            "command": command if command is not None else command_line()}
    clash = sorted(set(extra) & (set(head) | {"rows"}))
    if clash:
        raise ValueError(f"record: extra keys {clash} would overwrite the record's own fields")
    return {**head, "rows": list(rows), **extra}


def _jsonable(x):
    if hasattr(x, "tolist"):  # numpy / jax scalars and arrays
        return x.tolist()
    return str(x)


def write_json(path: str, rec: dict) -> None:
    """Write a record (see `record`) as indented JSON."""
    with open(path, "w") as f:
        json.dump(rec, f, indent=1, default=_jsonable)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------------------
# the engine benchmark


#: stages of a decode step that `stage_times` does not time, and why (reported so, never as a number)
NOT_MEASURED = {"collectives": "not measured (the step's all-gathers and psums are not timed apart)"}


def flops_per_token(cfg: GlmDsaConfig, context: int) -> float:
    """Matmul FLOPs of one token through the model at a context length (sparse attention over top-k)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    k = min(cfg.index_topk, context)
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        attn = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim + d * cfg.mla_row_dim
        attn += h * cfg.qk_nope_head_dim * cfg.kv_lora_rank + h * cfg.kv_lora_rank * cfg.v_head_dim
        attn += h * cfg.v_head_dim * d
        attn += h * k * (cfg.mla_row_dim + cfg.kv_lora_rank)  # scores + weighted values
        if cfg.is_full(i):
            attn += (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
                     + d * (cfg.index_head_dim + cfg.index_n_heads))
            attn += cfg.index_n_heads * cfg.index_head_dim * context  # indexer scores over the context
        if cfg.is_moe(i):
            mlp = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
            mlp += d * cfg.n_routed_experts
        else:
            mlp = 3 * d * cfg.intermediate_size
        total += attn + mlp
    return 2.0 * (total + d * cfg.vocab_size / max(context, 1))  # lm_head only for the last row of a prompt


def decode_attention_bytes(cfg: GlmDsaConfig, batch: int, context: int, cache_itemsize: int, *,
                           mla_row_bytes: int | None = None, index_row_bytes: int | None = None) -> int:
    """Bytes a decode step's attention must read: top-k MLA rows per layer, the indexer keys on full layers. Rows
    are `cache_itemsize` bytes per element unless their byte widths are given (fp8_ds_mla caches: 656 and 132)."""
    k = min(cfg.index_topk, context)
    mla = cfg.num_hidden_layers * k * (mla_row_bytes or cfg.mla_row_dim * cache_itemsize)
    idx = len(cfg.full_layers) * context * (index_row_bytes or cfg.index_head_dim * cache_itemsize)
    return batch * (mla + idx)


def _random_caches(eng: Engine, key):
    """Every cache of `eng` filled with random rows: normal values in a float cache; in an fp8_ds_mla (uint8) cache,
    valid quantised rows of normal values (finite scales: random bytes would give NaN attention, NaN hidden
    states and a degenerate routing that reads a few experts), 65536 distinct rows repeated."""
    return random_caches(eng.config, eng.caches, key)


def random_caches(cfg: GlmDsaConfig, caches: dict, key) -> dict:
    """`caches` ({"mla": (...), "indexer": (...)}) filled with random rows as `_random_caches` fills an engine's, each
    on its own sharding (the caches are donated)."""

    def fill(c, k, kind):
        if c.dtype != jnp.uint8:
            return jax.random.normal(k, c.shape, jnp.float32).astype(c.dtype)
        total = math.prod(c.shape[:-1])  # [pages, block, row bytes]
        n, (k1, k2) = min(total, 65536), jax.random.split(k)
        if kind == "mla":
            rows = quantize_mla_rows(jax.random.normal(k1, (n, cfg.kv_lora_rank)),
                                     jax.random.normal(k2, (n, cfg.qk_rope_head_dim)))
        else:
            rows = quantize_index_rows(jax.random.normal(k1, (n, cfg.index_head_dim)))
        return jnp.tile(rows, (-(-total // n), 1))[:total].reshape(c.shape)
    out = {}
    for i, (kind, layers) in enumerate(caches.items()):
        keys = jax.random.split(jax.random.fold_in(key, i), len(layers))
        out[kind] = type(layers)(
            jax.jit(functools.partial(fill, kind=kind), donate_argnums=0, out_shardings=c.sharding)(c, k)
            for c, k in zip(layers, keys))
    return out


def decode_batch(b: int, context: int, block_size: int, vocab_size: int, rng, dcp: int = 1) -> StepBatch:
    """One decode row per sequence at position `context - 1` (pages 1.. in order; under DCP = `dcp` each rank's
    share of the context, the slot on the owning rank), token ids drawn uniformly from the model's vocabulary
    [0, vocab_size)."""
    from glm_dsa.model.paged_cache import owner_slots
    pages = pages_needed(context, block_size, dcp)
    tables = (1 + np.arange(b * pages, dtype=np.int32)).reshape(b, pages)
    pos = np.full(b, context - 1, np.int32)
    slots = owner_slots(tables, np.arange(b), pos, block_size, dcp)
    ids = rng.integers(0, vocab_size, b).astype(np.int32)
    return StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, np.arange(b, dtype=np.int32), tables,
                                                np.arange(b, dtype=np.int32))))


def stage_times(eng: Engine, batch: StepBatch) -> dict[str, float]:
    """Seconds per decode step spent in each stage: each op's device time (`device_time`) at the step's shapes,
    times the number of layers that run it. The collectives are not among them (`NOT_MEASURED`)."""
    cfg, impl, b = eng.config, eng.impl, batch.token_ids.shape[0]
    key = jax.random.key(1)
    dt = eng.dtype
    rnd = lambda *s, d=dt: jax.random.normal(key, s, jnp.float32).astype(d)  # noqa: E731
    mla = eng.caches["mla"][0].reshape(-1, eng.caches["mla"][0].shape[-1])
    idx_cache = eng.caches["indexer"][0].reshape(-1, eng.caches["indexer"][0].shape[-1])
    h_local = cfg.num_attention_heads // eng.parallel.tp
    kv_lens = batch.positions + 1
    n_full, n_moe = len(cfg.full_layers), sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    out = {}
    # as the model calls it: the entries as a set (the select kernel skips their sort)
    topk = functools.partial(indexer.indexer_topk, block_size=eng.block_size, topk=cfg.index_topk, ordered=False,
                             impl=impl)
    q_i, w_i = rnd(b, cfg.index_n_heads, cfg.index_head_dim), rnd(b, cfg.index_n_heads, d=jnp.float32)
    idx_args = (w_i, idx_cache, batch.token_req, kv_lens, batch.block_tables)
    top = jax.jit(topk)(q_i, *idx_args)
    out["indexer"] = n_full * device_time(lambda q, *a: nudge(q, topk(q, *a)), q_i, *idx_args)
    from glm_dsa.model.paged_cache import positions_to_slots
    slots = positions_to_slots(top, batch.token_req, batch.block_tables, eng.block_size)
    attend = functools.partial(sparse_mla.sparse_mla, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                               impl=impl)
    q = rnd(b, h_local, cfg.mla_row_dim)
    out["sparse_mla"] = cfg.num_hidden_layers * device_time(lambda q, c, s: nudge(q, attend(q, c, s)[1]), q, mla,
                                                            slots)
    norm = functools.partial(fused_norm_rope.fused_norm_rope_cache, rope_theta=cfg.rope, impl=impl)
    args = (rnd(b, cfg.q_lora_rank), rnd(b, cfg.mla_row_dim), batch.positions, batch.slot_mapping,
            rnd(cfg.q_lora_rank), rnd(cfg.kv_lora_rank))
    out["norms_rope_cache"] = cfg.num_hidden_layers * device_time(lambda c, *a: norm(*a, c)[1], jnp.zeros_like(mla),
                                                                  *args)
    moe_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)), None)
    if moe_layer is not None:
        from flax import nnx
        from jax.sharding import PartitionSpec as P

        from glm_dsa.model.options import StepOptions
        from glm_dsa.model.placement import partition_specs
        from glm_dsa.model.step import fp8_paths, model_graphdef
        gd = model_graphdef(cfg, fp8_paths(eng.params))

        def moe_step(x, params):  # weights as arguments: a closure would bake them in as constants
            y = jax.shard_map(lambda p, x: nnx.merge(gd, p).layers[moe_layer].moe(x, cfg, StepOptions(impl=impl)),
                              mesh=eng.mesh,
                              in_specs=(partition_specs(params, cfg, eng.parallel), P()),
                              out_specs=P(), check_vma=False)(params, x)
            return nudge(x, y)
        out["moe"] = n_moe * device_time(moe_step, rnd(b, cfg.hidden_size), eng.params)
    return out


def decode_engine(cfg: GlmDsaConfig, params, parallel, dtype: str, impl: str, b: int, context: int,
                  kv_cache_dtype: str = "auto", batch_invariant: bool = False) -> Engine:
    """An engine of `b` sequences whose caches hold random rows, for `decode_ms_per_step` at `context`."""
    eng = Engine(cfg, params, parallel=parallel, dtype=dtype, max_model_len=context + 1, max_num_seqs=b, impl=impl,
                 block_size=64, kv_cache_dtype=kv_cache_dtype, batch_invariant=batch_invariant)
    eng.caches = _random_caches(eng, jax.random.key(b))
    return eng


def decode_ms_per_step(eng: Engine, batch: StepBatch, steps: int = 10) -> float:
    """Milliseconds per decode step of `batch` (`decode_batch`) on `eng`: 2 warm-up steps (the compile), then
    one sample of `steps` consecutive steps blocked at the end, as a decode loop runs them. A fixed number of
    calls, so every process of a multi-process run makes the same ones."""
    run = jax.jit(functools.partial(step, config=eng.config, parallel=eng.parallel, options=eng.runner.options),
                  donate_argnums=(1,))

    def decode_step():  # the caches are donated: each step feeds the next one's
        logits, eng.caches = run(eng.params, eng.caches, batch)
        return logits
    return 1e3 * median_seconds(decode_step, warmup=2, reps=1, calls_per_rep=steps)


@dataclasses.dataclass
class BenchConfig:
    """What `run_bench` runs (the `python -m glm_dsa bench` flags)."""

    preset: str = "bench"
    num_layers: int | None = None
    input_len: int = 32768
    output_len: int = 128
    batch: int = 8
    decode_batches: tuple[int, ...] = (1, 32, 128)
    decode_context: int | None = None  # default: input_len
    impls: tuple[str, ...] = ("xla",)
    dtype: str = "bfloat16"
    max_num_batched_tokens: int = 8192
    end_to_end: bool = True
    stages: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    quantization: str | None = None  # "fp8": the same random model with its linear weights quantised on device
    kv_cache_dtype: str = "auto"  # paged_cache.KV_CACHE_DTYPES ("fp8_ds_mla": 656-byte MLA rows)
    batch_invariant: bool = False  # the engine's batch-invariant mode (Engine(batch_invariant=True))


def run_bench(bc: BenchConfig, log=print) -> dict:
    """Run the engine benchmark; returns a JSON-able dict and logs a table."""
    from glm_dsa.model import presets as configs
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.replace(num_hidden_layers=bc.num_layers, indexer_types=cfg.indexer_types[: bc.num_layers]
                          if len(cfg.indexer_types) >= bc.num_layers else ())
    from sharding import mesh_for
    parallel = ParallelConfig(tensor_parallel_size=bc.tensor_parallel_size,
                              decode_context_parallel_size=bc.decode_context_parallel_size)
    from glm_dsa.distributed import check_mesh_spans_processes
    check_mesh_spans_processes(mesh_for(parallel))  # before minutes of init and compiles, in every process
    params = init_params(cfg, seed=bc.seed, dtype=bc.dtype, parallel=parallel, quantization=bc.quantization)
    stages = bc.stages and jax.process_count() == 1  # one device's op times: a one-process run gives them
    ctx = bc.decode_context or bc.input_len
    rng = np.random.default_rng(bc.seed)
    device = jax.local_devices()[0]  # across processes jax.devices()[0] is process 0's: elsewhere unaddressable
    peaks = device_peaks(device)
    results = {"config": dataclasses.asdict(bc), "device": getattr(device, "device_kind", str(device)),
               "roofline": dataclasses.asdict(peaks), "layers": cfg.num_hidden_layers, "impls": {}}
    for impl in bc.impls:
        r: dict = {}
        if bc.end_to_end:
            eng = Engine(cfg, params, parallel=parallel, dtype=bc.dtype, max_model_len=bc.input_len + bc.output_len,
                         max_num_seqs=bc.batch, max_num_batched_tokens=bc.max_num_batched_tokens, impl=impl,
                         kv_cache_dtype=bc.kv_cache_dtype, batch_invariant=bc.batch_invariant)
            prompts = [rng.integers(0, cfg.vocab_size, bc.input_len).tolist() for _ in range(bc.batch)]
            eng.warmup(bc.batch, bc.input_len, bc.output_len)
            total = median_seconds(functools.partial(eng.generate, prompts, bc.output_len, stop_token_ids=[]),
                                   warmup=0, reps=1)
            prefill = eng.last_timings["prefill_s"]  # to the first token of every prompt
            tokens = bc.batch * bc.input_len
            flops = sum(flops_per_token(cfg, c) for c in range(1, bc.input_len + 1)) * bc.batch
            r["prefill_s"] = prefill
            r["prefill_tokens_per_s"] = tokens / prefill
            r["prefill_mfu"] = flops / prefill / peaks.bf16_flops_per_s
            if bc.quantization == "fp8":  # FP8 weights: the GEMMs that can run e4m3 x e4m3 have twice the peak
                r["prefill_mfu_fp8_peak"] = flops / prefill / peaks.fp8_flops_per_s
            r["end_to_end_s"] = total
            r["decode_ms_per_step_e2e"] = 1e3 * eng.last_timings["decode_s"] / max(eng.last_timings["decode_steps"], 1)
            r["peak_bytes"] = peak_bytes(device)
            log(f"[{impl}] end-to-end: {json.dumps(r)}")
            del eng
        r["decode"] = {}
        for b in bc.decode_batches:
            try:
                row = _decode_row(cfg, params, parallel, bc, impl, b, ctx, rng, stages, peaks, device)
            except jax.errors.JaxRuntimeError as e:
                # a batch whose caches do not fit (full-width layers at B = 128) is a result, not the end of the run;
                # across processes every process must stop the same way, so there it is raised
                if "RESOURCE_EXHAUSTED" not in str(e) or jax.process_count() > 1:
                    raise
                row = {"error": "out of memory: " + str(e).splitlines()[0][:300]}
            r["decode"][b] = row
            log(f"[{impl}] decode B={b}: {json.dumps(row)}")
        results["impls"][impl] = r
    log(format_results(results))
    return results


def _decode_row(cfg, params, parallel, bc, impl, b, ctx, rng, stages, peaks, device) -> dict:
    """One decode batch's figures: ms per step, the attention bytes and their roofline, the stages, peak memory."""
    eng = decode_engine(cfg, params, parallel, bc.dtype, impl, b, ctx, bc.kv_cache_dtype, bc.batch_invariant)
    try:
        batch = decode_batch(b, ctx, eng.block_size, cfg.vocab_size, rng, dcp=eng.parallel.dcp)
        ms = decode_ms_per_step(eng, batch)
        rows = [c[0].shape[-1] * jnp.dtype(c[0].dtype).itemsize for c in (eng.caches["mla"], eng.caches["indexer"])]
        attn_bytes = decode_attention_bytes(cfg, b, ctx, 0, mla_row_bytes=rows[0], index_row_bytes=rows[1])
        row = {"ms_per_step": ms, "attention_bytes": attn_bytes,
               "attention_roofline_ms": 1e3 * attn_bytes / peaks.hbm_bytes_per_s}
        if stages:
            row["stages_ms"] = {k: 1e3 * v for k, v in stage_times(eng, batch).items()}
            row["stages_not_measured"] = dict(NOT_MEASURED)
        row["peak_bytes"] = peak_bytes(device)
        return row
    finally:
        del eng  # before the next B's caches


def format_results(res: dict) -> str:
    """The results of `run_bench` as a table, one line per impl and decode batch."""
    lines = [f"device {res['device']}, {res['layers']} layers, config {json.dumps(res['config'])}; MFU and "
             f"rooflines of {res['roofline']['name']}"]
    for impl, r in res["impls"].items():
        if "prefill_s" in r:
            lines.append(f"[{impl}] prefill {r['prefill_s']:.3f} s, {r['prefill_tokens_per_s']:.0f} tok/s, "
                         f"MFU {100 * r['prefill_mfu']:.1f}%"
                         + (f" ({100 * r['prefill_mfu_fp8_peak']:.1f}% of the FP8 peak)" if "prefill_mfu_fp8_peak" in r
                            else "") + f"; end-to-end {r['end_to_end_s']:.2f} s, "
                         f"decode {r['decode_ms_per_step_e2e']:.2f} ms/step")
        for b, row in r["decode"].items():
            if "error" in row:
                lines.append(f"[{impl}] decode B={b}: {row['error']}")
                continue
            st = ", ".join([f"{k} {v:.3f}" for k, v in row.get("stages_ms", {}).items()]
                           + [f"{k} {why}" for k, why in row.get("stages_not_measured", {}).items()])
            lines.append(f"[{impl}] decode B={b}: {row['ms_per_step']:.3f} ms/step; attention bytes roofline "
                         f"{row['attention_roofline_ms']:.3f} ms; stages (ms): {st}; peak {row['peak_bytes']}")
    return "\n".join(lines)


def to_record(res: dict, command: str | None = None) -> dict:
    """The results of `run_bench` as a harness record (`benchmarks.harness.record`): flat rows (`result_rows`)
    and the nested results beside them."""
    return record(result_rows(res), command=command, device=res["device"],
                  **{k: v for k, v in res.items() if k != "device"})


def result_rows(res: dict) -> list[dict]:
    """The results of `run_bench` as flat JSON rows: one per impl for the end-to-end run, one per impl and
    decode batch."""
    out = []
    for impl, r in res["impls"].items():
        if "prefill_s" in r:
            out.append({"impl": impl, "phase": "end_to_end", **{k: v for k, v in r.items() if k != "decode"}})
        for b, row in r["decode"].items():
            out.append({"impl": impl, "phase": "decode", "B": int(b), "context": res["config"]["decode_context"]
                        or res["config"]["input_len"], **row})
    return out


def add_quantization_argument(p: argparse.ArgumentParser) -> None:
    """--quantization of the benchmarks over a random model (`init_params`' quantization): this one and
    benchmarks/bench_serving.py's."""
    p.add_argument("--quantization", default=None, choices=["fp8", "none"],
                   help="fp8: the random model's linear weights quantised on device to FP8 (128x128 block scales, as "
                        "the released checkpoint stores them) and computed from; none / default: all in --dtype")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: the `python -m glm_dsa bench` subcommand's and this module's `main`'s."""
    from glm_dsa.model.presets import PRESETS
    p.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--input-len", type=int, default=32768)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decode-batches", default="1,32,128", help="comma-separated decode batch sizes")
    p.add_argument("--decode-context", type=int, default=None, help="context length of the decode runs")
    p.add_argument("--impls", default="xla", help="comma-separated op implementations, e.g. triton,xla")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_quantization_argument(p)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine's batch-invariant mode (bitwise reproducible requests; see Engine)")
    p.add_argument("--batch-invariant-cost", action="store_true",
                   help="instead: batch-invariant mode's cost against the default mode's, both in this process on the "
                        "same weights: the prefill of --batch x --input-len (unless --no-end-to-end) and one serving "
                        "decode step at each --decode-batches size, with their ratios (rows 'batch_invariant_cost' of "
                        "--json-out; the first of --impls)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="paged cache dtype (fp8_ds_mla: 656-byte MLA rows, as vLLM serves GLM-5.x)")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the prefill + generate run")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write the results here as a JSON record (benchmarks.harness)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--shard-of", default=None, metavar="TP[,DCP]",
                   help="run one device's share of this layout on one device, every collective a local stand-in, and "
                        "report the decode step per stage (glm_dsa/serving/shard_benchmark.py, which the CLI runs "
                        "for this flag)")
    from glm_dsa.distributed import add_flags
    add_flags(p)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed `add_arguments` flags."""
    return BenchConfig(preset=args.preset, num_layers=args.num_layers, input_len=args.input_len,
                       output_len=args.output_len, batch=args.batch,
                       decode_batches=tuple(int(x) for x in args.decode_batches.split(",") if x),
                       decode_context=args.decode_context, impls=tuple(args.impls.split(",")), dtype=args.dtype,
                       max_num_batched_tokens=args.max_num_batched_tokens, end_to_end=not args.no_end_to_end,
                       stages=not args.no_stages, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                       decode_context_parallel_size=args.decode_context_parallel_size,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       batch_invariant=args.batch_invariant)


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the benchmark of parsed `add_arguments` flags and write its record to --json-out; exit code 0."""
    from glm_dsa import distributed
    distributed.initialize_from_flags(args)  # a no-op in one process, or when the CLI has joined already
    log = print if jax.process_index() == 0 else lambda *a, **k: None
    if getattr(args, "batch_invariant_cost", False):
        res = run_invariant_cost(config_from_args(args), log=log)
        if args.json_out and jax.process_index() == 0:
            write_json(args.json_out, record(res.pop("rows"), command=command, **res))
        return 0
    res = run_bench(config_from_args(args), log=log)
    if args.json_out and jax.process_index() == 0:
        write_json(args.json_out, to_record(res, command=command))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# the cost of batch-invariant mode


#: batch-invariant mode's time over the default mode's that the acceptance allows (issue 44), by row: the prefill,
#: and the decode step at B = 32
INVARIANT_COST_LIMITS = {"prefill": 1.15, ("decode", 32): 1.10}


def decode_plan(eng: Engine, b: int, ctx: int, rng) -> StepPlan:
    """A scheduler plan of one decode row for each of b requests at position ctx - 1 (distinct random tokens from
    the host, each row sampled greedily), over pages 1.. of the engine's device block table (`_tables`), as the
    scheduler plans a decode step of b running requests: `ModelRunner.execute` gives it the engine's step shapes
    (in batch-invariant mode a decode step's fixed rows, block-table width and request count)."""
    pp = pages_needed(ctx, eng.block_size, eng.parallel.dcp, eng.parallel.interleave)
    _tables(eng, b, pp)
    params = SamplingParams(max_tokens=1 << 20, stop_token_ids=[])
    reqs = []
    for i in range(b):
        r = Request(f"bench-{i}", [0], params, frozenset())  # a one-token prompt: every row is a generated token
        r.pages, r.table_row, r.table_sent = list(range(1 + i * pp, 1 + (i + 1) * pp)), i, pp
        reqs.append(r)
    ids = np.arange(b)
    return StepPlan(reqs, ids, np.full(b, ctx - 1), rng.integers(0, eng.config.vocab_size, b), np.full(b, -1), ids,
                    reqs, np.zeros(b, np.int64), 0, np.zeros((3, 0), np.int64), [])


def serving_decode_ms(eng: Engine, b: int, ctx: int, rng, steps: int = 10) -> float:
    """Milliseconds per serving decode step of b requests at context ctx (`decode_plan`): the runner's `execute`
    (host inputs, the fused step with the sampler), 2 warm-up steps, then the median of 5 samples of `steps`
    consecutive steps blocked at the end, as the serving loop overlaps a step's host work with the previous one."""
    plan = decode_plan(eng, b, ctx, rng)
    return 1e3 * median_seconds(lambda: eng.runner.execute(plan), warmup=2, reps=5, calls_per_rep=steps)


def _cost_row(phase: str, default: float, invariant: float, b: int | None = None, **extra) -> dict:
    limit = INVARIANT_COST_LIMITS.get(phase if b is None else (phase, b))
    ratio = invariant / default
    return {"check": "batch_invariant_cost", "phase": phase, **({} if b is None else {"B": b}), **extra,
            "ratio": ratio, "limit": limit, "within_limit": None if limit is None else bool(ratio <= limit)}


def run_invariant_cost(bc: BenchConfig, log=print) -> dict:
    """Batch-invariant mode's cost (`python -m glm_dsa bench --batch-invariant-cost`): the default mode and
    batch-invariant mode in this process, on the same random weights, one after the other at each point:
    - prefill (unless `bc.end_to_end` is off): `bc.batch` prompts of `bc.input_len` tokens through `generate`
      (`bc.output_len` new tokens), seconds to the first token of every prompt, after a warm-up that compiles
      every step shape; batch-invariant prompt steps hold 8192 rows (`kernels.registry.INVARIANT_PROMPT_ROWS`)
      whatever `bc.max_num_batched_tokens`, which still caps a step's rows, and alternate with decode steps for
      the prompts whose first token is out;
    - decode at each of `bc.decode_batches` (at `bc.decode_context`, default `bc.input_len`; caches of random
      rows): one serving step (`serving_decode_ms`, whose warm-up steps compile it), padded in batch-invariant
      mode to the bucket of its B rows (`kernels.registry.decode_step_rows`: 8 to `INVARIANT_STEP_ROWS`; the row's
      "invariant_rows"), the block-table width of max_model_len and max_num_seqs requests.
    Returns {"config", "device", "layers", "invariant_step_rows", "decode_buckets", "rows"}: one row {"check":
    "batch_invariant_cost", "phase": "prefill" | "decode", "default_s" / "default_ms", "invariant_s" /
    "invariant_ms", "ratio" (invariant over default), "limit" (`INVARIANT_COST_LIMITS`, None where the acceptance
    names none), "within_limit", ...} per point."""
    from glm_dsa.model import presets as configs
    from kernels import registry
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.with_depth(bc.num_layers)
    parallel = ParallelConfig(tensor_parallel_size=bc.tensor_parallel_size,
                              decode_context_parallel_size=bc.decode_context_parallel_size)
    params = init_params(cfg, seed=bc.seed, dtype=bc.dtype, parallel=parallel, quantization=bc.quantization)
    impl = bc.impls[0]
    ctx = bc.decode_context or bc.input_len
    rng = np.random.default_rng(bc.seed)
    device = jax.local_devices()[0]
    weights = "fp8" if bc.quantization == "fp8" else {"bfloat16": "bf16"}.get(bc.dtype, bc.dtype)
    common = {"preset": bc.preset, "layers": cfg.num_hidden_layers, "weights": weights, "kv_cache": bc.kv_cache_dtype,
              "impl": impl}
    rows = []
    if bc.end_to_end:
        prompts = [rng.integers(0, cfg.vocab_size, bc.input_len).tolist() for _ in range(bc.batch)]
        got = {}
        for invariant in (False, True):
            eng = Engine(cfg, params, parallel=parallel, dtype=bc.dtype, max_model_len=bc.input_len + bc.output_len,
                         max_num_seqs=bc.batch, max_num_batched_tokens=bc.max_num_batched_tokens, impl=impl,
                         kv_cache_dtype=bc.kv_cache_dtype, batch_invariant=invariant)
            eng.warmup(bc.batch, bc.input_len, bc.output_len)
            eng.generate(prompts, bc.output_len, stop_token_ids=[])
            got[invariant] = eng.last_timings
            t = eng.last_timings
            log(f"prefill {bc.batch} x {bc.input_len}, {'batch-invariant' if invariant else 'default'} mode: "
                f"{t['prefill_s']:.3f} s ({t['steps']} steps in all, {t['prompt_steps']} with prompt tokens)")
            del eng
        d, i = got[False], got[True]
        rows.append(_cost_row("prefill", d["prefill_s"], i["prefill_s"], **common, batch=bc.batch,
                              input_len=bc.input_len, output_len=bc.output_len,
                              max_num_batched_tokens=bc.max_num_batched_tokens, default_s=d["prefill_s"],
                              invariant_s=i["prefill_s"], default_steps=d["steps"], invariant_steps=i["steps"],
                              invariant_prompt_steps=i["prompt_steps"]))
        log(f"prefill: batch-invariant / default = {rows[-1]['ratio']:.3f} (limit {rows[-1]['limit']})")
    for b in bc.decode_batches:
        ms = {}
        for invariant in (False, True):
            eng = decode_engine(cfg, params, parallel, bc.dtype, impl, b, ctx, bc.kv_cache_dtype, invariant)
            try:
                ms[invariant] = serving_decode_ms(eng, b, ctx, rng)
            finally:
                del eng
        rows.append(_cost_row("decode", ms[False], ms[True], b, **common, context=ctx, default_ms=ms[False],
                              invariant_ms=ms[True], invariant_rows=registry.decode_step_rows(b)))
        log(f"decode B={b} at {ctx}: default {ms[False]:.3f} ms, batch-invariant {ms[True]:.3f} ms per step, ratio "
            f"{rows[-1]['ratio']:.3f} (limit {rows[-1]['limit']})")
    return {"config": dataclasses.asdict(bc), "device": getattr(device, "device_kind", str(device)),
            "layers": cfg.num_hidden_layers,
            "invariant_step_rows": [registry.INVARIANT_PROMPT_ROWS, registry.INVARIANT_STEP_ROWS],
            "decode_buckets": list(registry.decode_buckets()), "rows": rows}


# ---------------------------------------------------------------------------------------------------------------
# the MTP benchmark


#: mean accepted lengths the MTP benchmark projects tokens/s for
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
    """The host arrays of a greedy speculative step (`spec_step.spec_serve_step`, less the block-table ones) for
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


def run_mtp(args: argparse.Namespace, log=print) -> dict:
    """Run the MTP benchmark of parsed flags (`python -m glm_dsa bench --num-speculative-tokens K,...` or
    benchmarks/bench_mtp.py's): the plain step per batch, then per draft count k and batch the verify, draft +
    verify and synchronous-turn costs (and at B = 1 the projected and oracle-draft tokens/s); returns
    {"preset", "context", "impl", "rows"}."""
    from glm_dsa.model import presets as configs
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


def run_mtp_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Run `run_mtp` and write its record to --json-out; exit code 0."""
    res = run_mtp(args)
    if args.json_out:
        write_json(args.json_out, record(res.pop("rows"), command=command, **res))
    return 0
