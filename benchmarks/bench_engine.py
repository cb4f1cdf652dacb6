"""End-to-end benchmark: prefill and decode of a reduced-depth GLM-5.2 with random weights, per op impl.

The benchmark itself is the package's (`glm_dsa.serving.benchmark`: `python -m glm_dsa bench` runs it); this module is its
command line beside the other benchmarks, and the suite's e2e area (`benchmarks.suite`) calls `run_bench` for bf16
and FP8 weights. The flags are `python -m glm_dsa bench`'s.

    python -m glm_dsa bench --help        # the command line
    PYTHONPATH=. python3 benchmarks/bench_engine.py --help      # the same flags

`--batch-invariant-cost` times batch-invariant mode against the default mode in one process instead (prefill and
serving decode steps, their ratios; `run_invariant_cost`): its rows ("check": "batch_invariant_cost") go into
results/e2e.json, rendered as BENCHMARKS.md's table "batch_invariant_cost".
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# re-exported: the suite, the tests and the diagnostics reach the benchmark's parts through this module
from glm_dsa.serving.benchmark import (NOT_MEASURED, BenchConfig, add_arguments, command_line,  # noqa: E402,F401
                               config_from_args, decode_attention_bytes, decode_batch, decode_engine,
                               decode_ms_per_step, decode_plan, flops_per_token, format_results, result_rows,
                               run_bench, run_from_args, run_invariant_cost, serving_decode_ms, stage_times,
                               to_record)


def main(argv=None) -> int:
    """The command line (the same as `python -m glm_dsa bench`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    from glm_dsa import distributed
    try:
        return run_from_args(ap.parse_args(argv), command=command_line(argv, script=__file__))
    except (Exception, KeyboardInterrupt):
        if distributed.is_multiprocess():  # not through JAX's shutdown barrier: peers wait in a collective
            import traceback
            traceback.print_exc()
            distributed.exit_now(1)
        raise


if __name__ == "__main__":
    sys.exit(main())
