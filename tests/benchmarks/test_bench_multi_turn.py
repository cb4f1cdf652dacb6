"""The multi-turn chat workload of benchmarks/bench_serving.py at tiny sizes on CPU: it runs with prefix caching
and without, both settings produce the same output tokens, and only the caching one reuses the shared system
prompt's pages."""

from benchmarks import bench_serving


def test_multi_turn_smoke():
    mc = bench_serving.MultiTurnConfig(preset="tiny", conversations=3, turns=2, system_len=16, user_len=4,
                                       output_len=2, request_rate=float("inf"), block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=64, warm_passes=1, dtype="float32")
    res = bench_serving.run_multi_turn_bench(mc, log=lambda *a: None)
    on, off = res["settings"]["prefix_caching"], res["settings"]["no_prefix_caching"]
    assert on["output_tokens"] == off["output_tokens"] == 3 * 2 * 2
    assert off["prefix_cache_hits"] == 0
    # turn 1 (20-token prompts, all arriving at once): the 2nd and 3rd conversations reuse the system prompt's 4
    # pages, written by the 1st in the same step; turn 2 (26 tokens): each reuses the 5 pages of its own turn 1
    # (its answer's last token was never computed, so the 6th page is not complete)
    assert on["prefix_cache_hits"] == 2 * 16 + 3 * 20
    # every step shape compiled before the passes (Engine.warmup_steps), whatever the timing: none in the timed one
    assert on["compiles"] == off["compiles"] == 0
    assert "multi-turn" in bench_serving.__doc__


def test_a_failed_step_fails_the_run(monkeypatch):
    """A step that fails (out of device memory, say) ends its requests with reason "error": the benchmark must
    raise instead of reporting the empty run's NaN TTFT as a figure."""
    import pytest

    from glm_dsa.serving.runner import ModelRunner

    def fail(self, plan, dry):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (injected)")
    monkeypatch.setattr(ModelRunner, "execute", fail)
    mc = bench_serving.MultiTurnConfig(preset="tiny", conversations=2, turns=1, system_len=8, user_len=4,
                                       output_len=2, request_rate=float("inf"), block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=64, warm_passes=1, dtype="float32")
    with pytest.raises(RuntimeError, match="turn failed.*injected"):
        bench_serving.run_multi_turn_bench(mc, log=lambda *a: None)


def test_fp8_weights_reach_both_engines(monkeypatch):
    """--quantization fp8 serves the random model with its linear weights in e4m3 (the released checkpoint's
    format), in both settings, and caching still finds the shared system prompt."""
    import jax
    import jax.numpy as jnp

    drawn = []
    real = bench_serving.init_params

    def spy(*a, **kw):
        drawn.append(real(*a, **kw))
        return drawn[-1]
    monkeypatch.setattr(bench_serving, "init_params", spy)
    mc = bench_serving.MultiTurnConfig(preset="tiny", conversations=2, turns=1, system_len=16, user_len=4,
                                       output_len=2, request_rate=float("inf"), block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=64, warm_passes=1, quantization="fp8",
                                       warm_steps=False)
    res = bench_serving.run_multi_turn_bench(mc, log=lambda *a: None)
    (params,) = drawn
    fp8 = [x for x in jax.tree.leaves(params) if x.dtype == jnp.float8_e4m3fn]
    assert fp8, "no float8_e4m3fn weight in the served params"
    on, off = res["settings"]["prefix_caching"], res["settings"]["no_prefix_caching"]
    assert on["output_tokens"] == off["output_tokens"] == 2 * 2
    assert on["prefix_cache_hits"] == 16 and off["prefix_cache_hits"] == 0
    assert res["config"]["quantization"] == "fp8"


def test_a_bad_quantization_is_refused_before_anything_runs(capsys):
    """--quantization takes fp8 or none: another value is an argparse error naming the flag, before any model is
    drawn."""
    import pytest
    with pytest.raises(SystemExit) as e:
        bench_serving.main(["--workload", "multi-turn", "--quantization", "int4", "--cpu"])
    assert e.value.code == 2
    assert "--quantization: invalid choice: 'int4'" in capsys.readouterr().err
