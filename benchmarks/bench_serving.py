"""Serving benchmark: N requests of given input/output lengths arriving at a rate (Poisson) or all at once, served
by the continuous-batching engine loop, against the static-group baseline on the same work (groups of
max_num_seqs requests, a group admitted only when the previous one has finished, as `generate` ran before
continuous batching). Random weights of a preset, token ids drawn from the model's vocabulary, EOS ignored.

Reports per mode: output tokens/s, TTFT and TPOT p50/p99 (from each request's arrival), steps, preemptions,
compiles inside the timed pass (should be 0: untimed passes of the same work and arrivals run first, until one
compiles nothing), host time per step against the step's wall time. --tp/--dcp pick the mesh (e.g. DCP=2 vs
DCP=1 on two GPUs with --num-pages small enough that DCP=1 runs out of pages: DCP=2 holds twice the tokens in the
same pages per rank).

Host overhead (--host-overhead-batches 1,32,128: B prompts of --host-overhead-input-len tokens, --output-len new
tokens each). The loop (`Engine.step`) plans and launches step n+1, then reads step n's ids and hands them out, so
the host's work on step n+1 runs while the device runs step n: host work that ends before the device's step costs
nothing. The overhead is therefore the time the DEVICE SITS IDLE between steps, not the host's busy time:

    idle_ms = step_ms - device_step_ms        (per decode step; idle_fraction = idle_ms / step_ms, goal <= 5%)

step_ms: the loop's wall time per decode step, from the host receiving the last prefill step's ids to its receiving
the last decode step's (the device runs decode steps only in that window; `Engine.last_timings`'s decode_step_ms,
reported as engine_decode_step_ms, counts the loop turns that waited for a decode step's ids: the same window, up to
the handling of the ids at its two ends). device_step_ms: the same decode steps (their recorded arguments: the same
compiled executables, shapes and inputs) replayed back to back with no host work between them but the dispatch, the
faster of two passes: the device's time per step when nothing waits for the host (an upper bound of it when one
dispatch takes longer than one device step). Also reported, as diagnostics of where host time goes: host_ms (loop
time per decode step NOT spent waiting for the previous step's ids; it overlaps the device) split into build
(planning and the numpy inputs), launch (the jitted call: transfers and dispatch; a launch that blocks on the device
shows up here, not as waiting) and process (the previous step's ids to their requests); wait_ms = step_ms - host_ms,
the host's slack per step (about 0: the host is the bottleneck). On CPU the "device" shares the cores with the host,
so idle_ms there is not the GPU's.

Multi-turn chat (--workload multi-turn): --conversations chats of --turns turns each, every one starting with the
same --system-len-token system prompt; a turn's prompt is the previous turn's prompt and answer plus --user-len new
tokens, and it arrives as soon as the previous answer is complete (conversations start at Poisson times of
--request-rate per second: pass it, the default is all at once). Served with automatic prefix caching and without, on two engines in the same run:
TTFT p50/p99 per turn (from its arrival), output tokens/s, prefix-cache hits.

    PYTHONPATH=. python3 benchmarks/bench_serving.py --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from benchmarks.harness import apply_platform_flags, command_line, record, write_json
from glm_dsa.serving.benchmark import add_quantization_argument
from glm_dsa.serving.engine import Engine
from glm_dsa.model.random_init import init_params
from glm_dsa.serving.sampling import SamplingParams
from sharding import ParallelConfig


@dataclasses.dataclass
class ServingBenchConfig:
    """What `run_serving_bench` runs (the command line's flags)."""

    preset: str = "bench"
    num_layers: int | None = None
    num_requests: int = 64
    input_len: int = 1024
    output_len: int = 128
    request_rate: float = float("inf")  # requests/s (Poisson arrivals); inf: all at once
    modes: tuple[str, ...] = ("continuous", "static")
    tp: int = 1
    dcp: int = 1
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # "fp8": the random model's linear weights quantised on device
    impl: str | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    num_pages: int | None = None
    block_size: int = 64
    host_overhead_batches: tuple[int, ...] = ()
    host_overhead_input_len: int = 128
    warm_passes: int = 3  # untimed passes before each mode's timed one (fewer when one compiles nothing)
    seed: int = 0


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def loop_figures(eng: Engine, before) -> dict:
    """The serving loop's figures since `before` (a copy of `eng.stats` taken then: `dataclasses.replace`): its
    steps (and of them those with prompt rows, and decode-only ones), wall and host ms per step, and the same over
    the turns that waited for a decode-only step (`engine._LoopStats`)."""
    st = eng.stats
    d = {k: getattr(st, k) - getattr(before, k) for k in ("steps", "prompt_steps", "decode_steps", "wall_s",
                                                           "host_s", "decode_wall_s", "decode_host_s",
                                                           "decode_timed_steps")}
    steps, timed = max(d["steps"], 1), max(d["decode_timed_steps"], 1)
    return {"steps": d["steps"], "prompt_steps": d["prompt_steps"], "decode_steps": d["decode_steps"],
            "step_ms": 1e3 * d["wall_s"] / steps, "host_ms_per_step": 1e3 * d["host_s"] / steps,
            "decode_step_ms": 1e3 * d["decode_wall_s"] / timed,
            "decode_host_ms_per_step": 1e3 * d["decode_host_s"] / timed}


def serve_workload(eng: Engine, prompts, output_len: int, arrivals, mode: str) -> dict:
    """Run `prompts` arriving at `arrivals` (seconds from now) through `eng`'s loop in this thread and return the
    per-request latencies and the loop's figures. mode "continuous": each request is submitted when it arrives;
    "static": groups of max_num_seqs in arrival order, each submitted once all of it has arrived and the previous
    group has finished."""
    if mode not in ("continuous", "static"):
        raise ValueError(f"mode must be 'continuous' or 'static', got {mode!r}")
    eng.reset_prefix_cache()  # repeated passes of the same prompts measure computing them, not the previous pass's pages
    params = SamplingParams(temperature=0.0, max_tokens=output_len, stop_token_ids=[])
    n = len(prompts)
    times: list[list[float]] = [[] for _ in range(n)]
    streams = [None] * n
    st, pre0 = eng.stats, eng.scheduler.preemptions
    s0 = dataclasses.replace(st)
    compiled0 = eng.runner.serve_step._cache_size()
    t0 = time.perf_counter()
    nxt = 0
    running: list[int] = []  # requests running after each step that dispatched work

    def submit(i):
        s = eng.submit(prompts[i], params, prompt_index=i)
        on_token = s.request.on_token  # the loop runs in this thread: wrapping before the next step is safe

        def stamp(r, tok, i=i, on_token=on_token):
            times[i].append(time.perf_counter())
            on_token(r, tok)
        s.request.on_token = stamp
        streams[i] = s

    while nxt < n or eng.scheduler.has_work or not eng._inbox.empty():
        now = time.perf_counter() - t0
        if mode == "continuous":
            while nxt < n and arrivals[nxt] <= now:
                submit(nxt)
                nxt += 1
        elif nxt < n and not eng.scheduler.has_work and eng._inbox.empty():
            group = range(nxt, min(nxt + eng.max_num_seqs, n))
            if arrivals[group[-1]] <= now:
                for i in group:
                    submit(i)
                nxt = group[-1] + 1
        n_steps = st.steps
        busy = eng.step()
        if st.steps > n_steps:
            running.append(len(eng.scheduler.running))
        if not busy and nxt < n:
            time.sleep(min(0.001, max(0.0, arrivals[nxt] - (time.perf_counter() - t0))))
    while eng.step():
        pass
    end = time.perf_counter()
    ttft = [times[i][0] - t0 - arrivals[i] for i in range(n)]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    out_tokens = sum(len(t) for t in times)
    return {"mode": mode, "requests": n, "output_tokens": out_tokens, "duration_s": end - t0,
            "output_tokens_per_s": out_tokens / (end - t0),
            "ttft_ms_p50": 1e3 * _pct(ttft, 50), "ttft_ms_p99": 1e3 * _pct(ttft, 99),
            "tpot_ms_p50": 1e3 * _pct(tpot, 50), "tpot_ms_p99": 1e3 * _pct(tpot, 99),
            "preemptions": eng.scheduler.preemptions - pre0,
            "compiles": eng.runner.serve_step._cache_size() - compiled0,
            "mean_running": float(np.mean(running)) if running else 0.0, **loop_figures(eng, s0)}


class DecodeStepRecorder:
    """Records the arguments of `eng`'s decode-only steps (plans without prefill rows) as the loop launches them,
    so that `replay_ms` can run the same steps again back to back, and when each step's ids reached the host
    (`decode_window`). Installed on the engine instance (its runner's `execute` and compiled `serve_step`, and its
    scheduler's `process`) until `close`."""

    def __init__(self, eng: Engine):
        self.eng, self.calls, self._decode = eng, [], False
        self.arrived: list[tuple[float, bool]] = []  # per processed step: when its ids were on the host, decode-only
        self._step, dispatch, process = eng.runner.serve_step, eng.runner.execute, eng.scheduler.process

        def on_process(plan, ids, now=None, **kw):  # kw: the step's logprobs, when a request asked
            self.arrived.append((time.perf_counter() if now is None else now, plan.prefill_rows == 0))
            return process(plan, ids, now, **kw)

        def on_dispatch(plan, dry=None):
            self._decode = plan.prefill_rows == 0
            return dispatch(plan, dry)

        def on_step(params, caches, tables, *args, **kw):
            if self._decode:  # the host buffers (not the previous ids: a replay chains its own) and static args
                self.calls.append((args[:-1], kw))
            return self._step(params, caches, tables, *args, **kw)
        eng.runner.execute, eng.runner.serve_step, eng.scheduler.process = on_dispatch, on_step, on_process

    def close(self) -> None:
        """Give the engine its own dispatch, compiled step and the scheduler's process back."""
        del self.eng.runner.execute  # the instance attributes: the classes' methods show again
        del self.eng.scheduler.process
        self.eng.runner.serve_step = self._step

    def decode_window(self) -> tuple[float, int]:
        """(seconds, steps): from the host receiving the last prefill step's ids to its receiving the last decode
        step's, and the decode steps in between: the device runs those decode steps only (and sits idle between
        them), so seconds / steps is the decode step's wall time in the loop (what the engine's own decode_step_ms
        measures from its loop turns)."""
        starts = [i for i, (_, decode) in enumerate(self.arrived) if not decode]
        first = starts[-1] if starts else 0
        n = len(self.arrived) - 1 - first
        if n < 1:
            raise RuntimeError("no decode step after the last prefill step was recorded")
        return self.arrived[-1][0] - self.arrived[first][0], n

    def replay_ms(self, passes: int = 2) -> float:
        """Device milliseconds per recorded step: the recorded steps launched back to back (the same compiled
        executables and host buffers; each takes the previous one's ids, as in the loop) with no host work but the
        dispatch, then one wait; the fastest of `passes`. Changes the engine's caches (the rows those steps write)."""
        if not self.calls:
            raise RuntimeError("no decode step was recorded")
        eng, best = self.eng, float("inf")
        prev = eng.runner.prev_ids
        for _ in range(passes):
            jax.block_until_ready((prev, eng.caches))
            t = time.perf_counter()
            for args, kw in self.calls:
                run = eng.runner
                prev, run.caches, run.tables = self._step(run.params, run.caches, run.tables, *args, prev, **kw)
            jax.block_until_ready(prev)
            best = min(best, time.perf_counter() - t)
        eng.runner.prev_ids = prev
        return 1e3 * best / len(self.calls)


def host_overhead(eng: Engine, prompts, output_len: int) -> dict:
    """One `generate` of `prompts` (compiled beforehand by `Engine.warmup`) with its decode steps recorded, then
    those steps replayed: the loop's wall time per decode step against the device's, the device's idle time
    between steps, and where the host's time goes (see the module docstring)."""
    st = eng.stats
    s0 = (st.steps, st.build_s, st.launch_s, st.process_s, st.h2d_bytes)
    compiled0 = eng.runner.serve_step._cache_size()
    rec = DecodeStepRecorder(eng)
    try:
        eng.generate(prompts, output_len, stop_token_ids=[])
        t = eng.last_timings
        window_s, window_steps = rec.decode_window()
        device_ms = rec.replay_ms()
    finally:
        rec.close()
    compiles = eng.runner.serve_step._cache_size() - compiled0  # the generate's and the replay's
    n = max(st.steps - s0[0], 1)
    step_ms, host_ms = 1e3 * window_s / window_steps, t["decode_host_ms_per_step"]
    return {"B": len(prompts), "decode_steps": t["decode_steps"], "window_steps": window_steps,
            "step_ms": step_ms, "device_step_ms": device_ms, "engine_decode_step_ms": t["decode_step_ms"],
            "idle_ms": step_ms - device_ms, "idle_fraction": (step_ms - device_ms) / max(step_ms, 1e-9),
            "host_ms": host_ms, "wait_ms": step_ms - host_ms, "host_fraction": host_ms / max(step_ms, 1e-9),
            "build_ms_per_step": 1e3 * (st.build_s - s0[1]) / n, "launch_ms_per_step": 1e3 * (st.launch_s - s0[2]) / n,
            "process_ms_per_step": 1e3 * (st.process_s - s0[3]) / n, "h2d_bytes_per_step": (st.h2d_bytes - s0[4]) / n,
            "compiles": compiles}


@dataclasses.dataclass
class MultiTurnConfig:
    """The multi-turn chat workload (`run_multi_turn_bench`): see the module docstring."""

    preset: str = "bench"
    num_layers: int | None = None
    conversations: int = 32
    turns: int = 4
    system_len: int = 2048
    user_len: int = 64
    output_len: int = 128
    request_rate: float = float("inf")  # conversations/s (Poisson starts); inf: all at once
    tp: int = 1
    dcp: int = 1
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # "fp8": the random model's linear weights quantised on device
    impl: str | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    num_pages: int | None = None
    block_size: int = 64
    warm_passes: int = 2
    # compile every step shape the workload can reach before the warm-up passes (`Engine.warmup_steps`): which
    # shapes a pass meets follows the arrival timing, and a compile inside the timed pass stalls every turn
    warm_steps: bool = True
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        """The longest prompt and answer: the system prompt and every turn's user tokens and answer."""
        return self.system_len + self.turns * (self.user_len + self.output_len)


def multi_turn_workload(mc: MultiTurnConfig, vocab_size: int) -> tuple[list[int], list[list[list[int]]], np.ndarray]:
    """(the shared system prompt, per conversation its turns' new user tokens, each conversation's start in seconds:
    Poisson at mc.request_rate, all at 0 for inf), drawn from mc.seed."""
    rng = np.random.default_rng(mc.seed)
    system = rng.integers(2, vocab_size, mc.system_len).tolist()
    users = [[rng.integers(2, vocab_size, mc.user_len).tolist() for _ in range(mc.turns)]
             for _ in range(mc.conversations)]
    starts = (np.zeros(mc.conversations) if np.isinf(mc.request_rate)
              else np.cumsum(rng.exponential(1.0 / mc.request_rate, mc.conversations)))
    return system, users, starts


def serve_multi_turn(eng: Engine, system: list[int], users, output_len: int, starts) -> dict:
    """Serve the conversations through `eng`'s loop in this thread: conversation i's first turn arrives at
    starts[i] (seconds from now), each later turn when the previous answer is complete (its prompt: the previous
    prompt, the answer and the next user tokens). Returns TTFT percentiles (from each turn's arrival), output
    tokens/s and the prefix cache's hits over the pass (the cache is emptied first)."""
    eng.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, stop_token_ids=[])
    n, turns = len(users), len(users[0])
    m0 = eng.metrics()
    s0 = dataclasses.replace(eng.stats)
    compiled0 = eng.runner.serve_step._cache_size()
    ttft: list[float] = []
    out_tokens = 0
    ready: list[tuple[int, list[int]]] = []  # (conversation, prompt) of turns that arrive now
    state = {i: (0, []) for i in range(n)}  # conversation -> (turns done, its context so far)
    t0 = time.perf_counter()
    nxt = 0
    streams = {}

    def submit(i, prompt):
        arrived = time.perf_counter()
        s = eng.submit(prompt, params, prompt_index=i)
        first = [None]
        on_token = s.request.on_token

        def stamp(r, tok, on_token=on_token):
            if first[0] is None:
                first[0] = time.perf_counter()
                ttft.append(first[0] - arrived)
            on_token(r, tok)
        s.request.on_token = stamp
        streams[i] = (s, prompt)

    finished = 0
    while finished < n * turns:
        now = time.perf_counter() - t0
        while nxt < n and starts[nxt] <= now:
            ready.append((nxt, list(system) + users[nxt][0]))
            nxt += 1
        for i, prompt in ready:
            submit(i, prompt)
        ready = []
        busy = eng.step()
        for i, (s, prompt) in list(streams.items()):
            r = s.request
            if r.finished:
                if r.finish_reason == "error":  # a failed step (out of memory, say) must not pass as a figure
                    raise RuntimeError(f"multi-turn: conversation {i}'s turn failed: {r.error}")
                del streams[i]
                finished += 1
                out_tokens += len(r.output)
                done = state[i][0] + 1
                state[i] = (done, prompt + list(r.output))
                if done < turns:
                    ready.append((i, state[i][1] + users[i][done]))
        if not busy and not ready and nxt < n:
            time.sleep(min(0.001, max(0.0, starts[nxt] - (time.perf_counter() - t0))))
    end = time.perf_counter()
    m = eng.metrics()
    return {"turns": n * turns, "output_tokens": out_tokens, "duration_s": end - t0,
            # where a turn's time goes: the loop's steps (wall time per step: the device's step, or the host's
            # when it is slower), their host share, and decode-only steps apart
            **loop_figures(eng, s0),
            "output_tokens_per_s": out_tokens / (end - t0),
            "ttft_ms_p50": 1e3 * _pct(ttft, 50), "ttft_ms_p99": 1e3 * _pct(ttft, 99),
            "prefix_cache_queries": m["prefix_cache_queries"] - m0["prefix_cache_queries"],
            "prefix_cache_hits": m["prefix_cache_hits"] - m0["prefix_cache_hits"],
            "preemptions": m["preemptions"] - m0["preemptions"],
            "compiles": eng.runner.serve_step._cache_size() - compiled0}


def run_multi_turn_bench(mc: MultiTurnConfig, log=print) -> dict:
    """The multi-turn chat workload with prefix caching and without (two engines, same weights and arrivals);
    returns a JSON-able dict (per setting: `serve_multi_turn`'s figures, and the TTFT p50 ratio)."""
    from glm_dsa import configs
    cfg = configs.get(mc.preset)
    if mc.num_layers:
        cfg = cfg.with_depth(mc.num_layers)
    parallel = ParallelConfig(tensor_parallel_size=mc.tp, decode_context_parallel_size=mc.dcp)
    params = init_params(cfg, seed=mc.seed, dtype=mc.dtype, parallel=parallel, quantization=mc.quantization)
    system, users, starts = multi_turn_workload(mc, cfg.vocab_size)
    max_len = mc.max_model_len
    dev0 = jax.devices()[0]
    res = {"config": dataclasses.asdict(mc), "device": getattr(dev0, "device_kind", str(dev0)),
           "layers": cfg.num_hidden_layers, "max_model_len": max_len, "settings": {}}
    for caching in (True, False):
        name = "prefix_caching" if caching else "no_prefix_caching"
        eng = Engine(cfg, params, parallel=parallel, dtype=mc.dtype, kv_cache_dtype=mc.kv_cache_dtype, impl=mc.impl,
                     block_size=mc.block_size, max_num_batched_tokens=mc.max_num_batched_tokens,
                     max_model_len=max_len, max_num_seqs=mc.max_num_seqs, num_pages=mc.num_pages,
                     enable_prefix_caching=caching)
        if mc.warm_steps:  # every step shape the workload's steps can take, whatever the arrival timing
            t = time.perf_counter()
            shortest = min(mc.system_len + mc.user_len, max_len)  # a step's longest request: its pages up to a full one
            n = eng.warmup_steps(pages=range(eng.scheduler.pages_for(shortest), eng.pages_per_seq + 1))
            log(f"[{name}] warm-up: {n} step shapes compiled ahead in {time.perf_counter() - t:.1f} s")
        for p in range(mc.warm_passes):  # untimed passes of the same work until one compiles nothing
            t = time.perf_counter()
            compiles = serve_multi_turn(eng, system, users, mc.output_len, starts)["compiles"]
            log(f"[{name}] warm-up pass {p + 1}: {time.perf_counter() - t:.1f} s, {compiles} step shapes compiled")
            if not compiles:
                break
        row = serve_multi_turn(eng, system, users, mc.output_len, starts)
        res["num_pages_per_rank"] = eng.num_pages
        res["settings"][name] = row
        log(f"[{name}] {json.dumps(row)}")
        del eng
    on, off = res["settings"]["prefix_caching"], res["settings"]["no_prefix_caching"]
    res["ttft_p50_speedup"] = off["ttft_ms_p50"] / max(on["ttft_ms_p50"], 1e-9)
    res["output_tokens_per_s_ratio"] = on["output_tokens_per_s"] / max(off["output_tokens_per_s"], 1e-9)
    log(format_multi_turn(res))
    return res


def results_header(res: dict) -> str:
    """The first line of a results table: the device, the model's depth and the run's config."""
    return f"device {res['device']}, {res['layers']} layers, config {json.dumps(res['config'])}"


def format_multi_turn(res: dict) -> str:
    """The multi-turn results as a table."""
    lines = [results_header(res)]
    for name, r in res["settings"].items():
        lines.append(f"[{name:>17}] TTFT p50/p99 {r['ttft_ms_p50']:.1f}/{r['ttft_ms_p99']:.1f} ms; "
                     f"{r['output_tokens_per_s']:.0f} out tok/s; {r['steps']} steps ({r['prompt_steps']} with "
                     f"prompt rows) of {r['step_ms']:.2f} ms ({r['host_ms_per_step']:.2f} ms host), decode-only "
                     f"{r['decode_step_ms']:.2f} ms; {r['prefix_cache_hits']} of "
                     f"{r['prefix_cache_queries']} prompt tokens cached; {r['preemptions']} preemptions; "
                     f"{r['compiles']} compiled in the timed pass")
    lines.append(f"prefix caching: TTFT p50 {res['ttft_p50_speedup']:.2f}x lower, output tokens/s x"
                 f"{res['output_tokens_per_s_ratio']:.2f}")
    return "\n".join(lines)


def multi_turn_record(res: dict, command: str | None = None) -> dict:
    """The multi-turn results as a harness record: one row per setting, the caching row carrying its TTFT p50
    speed-up and output tokens/s ratio against the row without caching (same run)."""
    rows = [{"check": "multi_turn", "setting": k, **r} for k, r in res["settings"].items()]
    for r in rows:
        if r["setting"] == "prefix_caching" and "ttft_p50_speedup" in res:
            r.update(ttft_p50_speedup=res["ttft_p50_speedup"],
                     output_tokens_per_s_ratio=res["output_tokens_per_s_ratio"])
    return record(rows, command=command, device=res["device"], **{k: v for k, v in res.items() if k != "device"})


def run_serving_bench(bc: ServingBenchConfig, log=print) -> dict:
    """Run the benchmark; returns a JSON-able dict and logs one line per measurement."""
    from glm_dsa import configs
    cfg = configs.get(bc.preset)
    if bc.num_layers:
        cfg = cfg.with_depth(bc.num_layers)
    parallel = ParallelConfig(tensor_parallel_size=bc.tp, decode_context_parallel_size=bc.dcp)
    params = init_params(cfg, seed=bc.seed, dtype=bc.dtype, parallel=parallel, quantization=bc.quantization)
    kw = dict(parallel=parallel, dtype=bc.dtype, kv_cache_dtype=bc.kv_cache_dtype, impl=bc.impl,
              block_size=bc.block_size, max_num_batched_tokens=bc.max_num_batched_tokens)
    rng = np.random.default_rng(bc.seed)
    prompts = [rng.integers(0, cfg.vocab_size, bc.input_len).tolist() for _ in range(bc.num_requests)]
    if np.isinf(bc.request_rate):
        arrivals = np.zeros(bc.num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / bc.request_rate, bc.num_requests))
    dev0 = jax.devices()[0]
    res = {"config": dataclasses.asdict(bc), "device": getattr(dev0, "device_kind", str(dev0)),
           "layers": cfg.num_hidden_layers, "modes": {}, "host_overhead": {}}
    if bc.modes:  # (none: the host-overhead rows alone)
        eng = Engine(cfg, params, max_model_len=bc.input_len + bc.output_len, max_num_seqs=bc.max_num_seqs,
                     num_pages=bc.num_pages, **kw)
        res["num_pages_per_rank"] = eng.num_pages
        res["tokens_in_cache"] = (eng.num_pages - 1) * bc.block_size * bc.dcp
        log(f"engine: {cfg.num_hidden_layers} layers, TP={bc.tp} DCP={bc.dcp}, {eng.num_pages} pages of "
            f"{bc.block_size} per rank ({res['tokens_in_cache']} tokens), max_num_seqs {eng.max_num_seqs}")
        for mode in bc.modes:
            # the same work and arrivals untimed, until a pass compiles nothing: which step shapes a pass meets
            # depends on how arrivals fall between steps, and a pass that compiled ran its steps late (arrivals
            # all at once: the plans do not depend on the clock, one pass meets every shape)
            for p in range(bc.warm_passes):
                t = time.perf_counter()
                compiles = serve_workload(eng, prompts, bc.output_len, arrivals, mode)["compiles"]
                log(f"[{mode}] warm-up pass {p + 1}: {time.perf_counter() - t:.1f} s, {compiles} step shapes compiled")
                if not compiles or not np.any(arrivals):
                    break
            row = serve_workload(eng, prompts, bc.output_len, arrivals, mode)
            res["modes"][mode] = row
            log(f"[{mode}] {json.dumps(row)}")
        del eng
    for b in bc.host_overhead_batches:
        eng = Engine(cfg, params, max_model_len=bc.host_overhead_input_len + bc.output_len, max_num_seqs=b, **kw)
        ps = [rng.integers(0, cfg.vocab_size, bc.host_overhead_input_len).tolist() for _ in range(b)]
        t = time.perf_counter()
        eng.warmup(b, bc.host_overhead_input_len, bc.output_len)
        log(f"host overhead B={b}: warm-up {time.perf_counter() - t:.1f} s")
        row = host_overhead(eng, ps, bc.output_len)
        res["host_overhead"][b] = row
        log(f"host overhead B={b}: {json.dumps(row)}")
        del eng
    log(format_results(res))
    return res


def format_results(res: dict) -> str:
    """The results as a table."""
    lines = [results_header(res)]
    for mode, r in res["modes"].items():
        lines.append(f"[{mode:>10}] {r['output_tokens_per_s']:.0f} out tok/s; TTFT p50/p99 {r['ttft_ms_p50']:.1f}/"
                     f"{r['ttft_ms_p99']:.1f} ms; TPOT p50/p99 {r['tpot_ms_p50']:.2f}/{r['tpot_ms_p99']:.2f} ms; "
                     f"{r['steps']} steps ({r['compiles']} compiled), host {r['host_ms_per_step']:.2f} of "
                     f"{r['step_ms']:.2f} ms/step; {r['preemptions']} preemptions, {r['mean_running']:.1f} running on "
                     "average")
    for b, r in res["host_overhead"].items():
        lines.append(f"[host B={b}] decode step {r['step_ms']:.3f} ms (engine's {r['engine_decode_step_ms']:.3f}), "
                     f"device {r['device_step_ms']:.3f} ms: idle "
                     f"{r['idle_ms']:.3f} ms ({100 * r['idle_fraction']:.1f}%); host busy {r['host_ms']:.3f} ms "
                     f"({100 * r['host_fraction']:.1f}%, overlapped), waits {r['wait_ms']:.3f} ms; all steps: build "
                     f"{r['build_ms_per_step']:.3f}, launch {r['launch_ms_per_step']:.3f}, process "
                     f"{r['process_ms_per_step']:.3f} ms, {r['h2d_bytes_per_step']:.0f} B to the device per step; "
                     f"{r['compiles']} compiles")
    return "\n".join(lines)


def to_record(res: dict, command: str | None = None) -> dict:
    """The results as a harness record: one row per mode and per host-overhead batch."""
    rows = [{"check": "serving", **r} for r in res["modes"].values()]
    rows += [{"check": "host_overhead", **r} for r in res["host_overhead"].values()]
    return record(rows, command=command, device=res["device"], **{k: v for k, v in res.items() if k != "device"})


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv=None) -> int:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf, "
                                                                             "all at once)")
    ap.add_argument("--modes", default="continuous,static", help="continuous and/or static ('': neither)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dcp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto")
    add_quantization_argument(ap)
    ap.add_argument("--impl", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages per DCP rank (default: from free memory)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--host-overhead-batches", default="", help="e.g. 1,32,128: decode host overhead at these B")
    ap.add_argument("--host-overhead-input-len", type=int, default=128)
    ap.add_argument("--warm-passes", type=int, default=3, help="untimed passes of the same work before each mode's "
                    "timed pass, until one compiles no new step shape (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--xla-autotune", type=int, default=None,
                    help="XLA's GPU autotune level (0 skips GEMM autotuning: shorter compiles of each step shape)")
    ap.add_argument("--cpu", action="store_true", help="8 simulated CPU devices (smoke runs)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--workload", default="random", choices=["random", "multi-turn"],
                    help="random: --num-requests prompts of --input-len; multi-turn: chats sharing a system prompt, "
                         "with prefix caching and without (see the module docstring)")
    ap.add_argument("--conversations", type=int, default=32, help="multi-turn: conversations")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--system-len", type=int, default=2048, help="multi-turn: tokens of the shared system prompt")
    ap.add_argument("--user-len", type=int, default=64, help="multi-turn: new user tokens per turn")
    ap.add_argument("--warm-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="multi-turn: compile every step shape the workload can reach before the warm-up passes "
                         "(Engine.warmup_steps; --no-warm-steps: the passes alone, whose shapes follow the timing)")
    args = ap.parse_args(argv)
    apply_platform_flags(args.cpu, args.xla_autotune)  # jax is imported, but no backend started yet
    if args.workload == "multi-turn":
        mc = MultiTurnConfig(preset=args.preset, num_layers=args.num_layers, conversations=args.conversations,
                             turns=args.turns, system_len=args.system_len, user_len=args.user_len,
                             output_len=args.output_len, request_rate=args.request_rate, tp=args.tp, dcp=args.dcp,
                             dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                             quantization=args.quantization, impl=args.impl,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             num_pages=args.num_pages, block_size=args.block_size,
                             warm_passes=max(args.warm_passes, 1), warm_steps=args.warm_steps, seed=args.seed)
        res = run_multi_turn_bench(mc)
        if args.out:
            write_json(args.out, multi_turn_record(res, command_line(argv, script=__file__)))
        return 0
    bc = ServingBenchConfig(preset=args.preset, num_layers=args.num_layers, num_requests=args.num_requests,
                            input_len=args.input_len, output_len=args.output_len, request_rate=args.request_rate,
                            modes=tuple(m for m in args.modes.split(",") if m), tp=args.tp, dcp=args.dcp,
                            dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                            quantization=args.quantization, impl=args.impl,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            num_pages=args.num_pages,
                            block_size=args.block_size, host_overhead_batches=_ints(args.host_overhead_batches),
                            host_overhead_input_len=args.host_overhead_input_len, warm_passes=args.warm_passes,
                            seed=args.seed)
    res = run_serving_bench(bc)
    if args.out:
        write_json(args.out, to_record(res, command_line(argv, script=__file__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
