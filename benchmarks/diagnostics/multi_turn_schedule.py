"""The multi-turn chat workload through the engine's scheduler alone, on a virtual clock (BENCHMARKS.md, Serving).

`benchmarks/bench_serving.py --workload multi-turn` measures TTFT with prefix caching on and off on a GPU. This
diagnostic asks the scheduler's half of that question without a device: the same conversations and arrivals
(`bench_serving.multi_turn_workload`: Poisson starts), the same scheduler settings, and the engine loop's
shape (one step in flight: step n+1 is planned and launched before step n's ids are read, as `Engine.step` does),
but each step takes `--base-ms` + `--us-per-row` x its rows of virtual time. So any TTFT difference it shows comes
from planning (admission, chunking, cache hits), none from kernels:

    PYTHONPATH=. python3 benchmarks/diagnostics/multi_turn_schedule.py --base-ms 8 --us-per-row 4

Prints, per setting, TTFT p50 / p99 (ms, virtual), steps, mean rows per step and the prefix cache's hits.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from benchmarks.bench_serving import MultiTurnConfig, multi_turn_workload
from glm_dsa.model.paged_cache import PageAllocator
from glm_dsa.serving.prefix_cache import PrefixCachingAllocator
from glm_dsa.serving.sampling import SamplingParams
from glm_dsa.serving.scheduler import Request, Scheduler


def simulate(mc: MultiTurnConfig, vocab_size: int, caching: bool, base_ms: float, us_per_row: float) -> dict:
    """One pass of `mc`'s conversations through a `Scheduler` (num_pages `mc.num_pages`), each step costing
    base_ms + us_per_row x rows of virtual time; sampled ids are a constant (no stop ids, so every turn runs to
    its length, as in the bench)."""
    system, users, starts = multi_turn_workload(mc, vocab_size)
    alloc = (PrefixCachingAllocator if caching else PageAllocator)(mc.num_pages)
    sched = Scheduler(alloc, block_size=mc.block_size, dcp=1, interleave=1, max_num_seqs=mc.max_num_seqs,
                      max_num_batched_tokens=mc.max_num_batched_tokens,
                      max_model_len=mc.max_model_len, prefix_caching=caching)
    params = SamplingParams(temperature=0.0, max_tokens=mc.output_len, stop_token_ids=[])
    n, turns = mc.conversations, mc.turns
    now, device_free, pending, nxt = 0.0, 0.0, None, 0
    ready: list[tuple[int, list[int]]] = []
    live: dict[int, tuple[Request, list[int], float]] = {}  # conversation -> (its turn, prompt, arrival)
    first: set[str] = set()  # turns whose first token has arrived
    done_turns = {i: 0 for i in range(n)}
    ttft: list[float] = []
    finished = steps = rows = 0
    while finished < n * turns:
        while nxt < n and starts[nxt] <= now:
            ready.append((nxt, list(system) + users[nxt][0]))
            nxt += 1
        for i, prompt in ready:
            r = Request(f"{i}.{done_turns[i]}", prompt, params, frozenset())
            sched.add(r)
            live[i] = (r, prompt, now)
        ready = []
        plan = sched.schedule()
        launched = None
        if plan is not None:  # runs once the device is free, for its modelled time
            device_free = max(now, device_free) + 1e-3 * (base_ms + 1e-3 * us_per_row * plan.num_rows)
            launched = (plan, device_free)
            steps, rows = steps + 1, rows + plan.num_rows
        if pending is not None:  # the previous step's ids: the loop waits for them
            prev, end = pending
            now = max(now, end)
            sched.process(prev, np.full(len(prev.sample_reqs), 7, np.int64))
            for i, (r, prompt, arrived) in list(live.items()):
                if r.output and r.request_id not in first:
                    first.add(r.request_id)
                    ttft.append(now - arrived)
                if r.finished:
                    del live[i]
                    finished += 1
                    done_turns[i] += 1
                    if done_turns[i] < turns:
                        ready.append((i, prompt + list(r.output) + users[i][done_turns[i]]))
        pending = launched
        if plan is None and pending is None and not ready and nxt < n:
            now = max(now, float(starts[nxt]))  # idle until the next conversation starts
    return {"setting": "prefix_caching" if caching else "no_prefix_caching",
            "ttft_ms_p50": 1e3 * float(np.percentile(ttft, 50)), "ttft_ms_p99": 1e3 * float(np.percentile(ttft, 99)),
            "turns": len(ttft), "steps": steps, "mean_rows": rows / max(steps, 1), "duration_s": now,
            "prefix_cache_queries": sched.prefix_queries, "prefix_cache_hits": sched.prefix_hits}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-ms", type=float, default=8.0, help="virtual ms of every step")
    ap.add_argument("--us-per-row", type=float, default=4.0, help="virtual µs per row of a step")
    ap.add_argument("--preset", default="bench", help="its vocabulary size draws the token ids")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=4.0, help="conversations/s (Poisson starts)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-pages", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from glm_dsa import configs
    mc = MultiTurnConfig(preset=args.preset, conversations=args.conversations, turns=args.turns,
                         system_len=args.system_len, user_len=args.user_len, output_len=args.output_len,
                         request_rate=args.request_rate, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages, seed=args.seed)
    vocab = configs.get(args.preset).vocab_size
    for caching in (True, False):
        print(json.dumps(simulate(mc, vocab, caching, args.base_ms, args.us_per_row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
