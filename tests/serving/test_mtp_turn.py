"""The structure of one MTP speculative turn and of the MTP benchmark's steps (tiny preset, random weights).

Oracles: the compiled step's own cache of executables (no new one across turns whose accepted counts differ), the
arguments the turn hands it (one host buffer), the draft-distribution buffer's contents (a greedy turn leaves a
sentinel untouched, a sampling turn overwrites it), and the layer-0 KV rows a benchmark step writes (rows of equal
tokens at equal positions write equal rows, so distinct rows prove the step ran on distinct tokens).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_mtp
from glm_dsa import configs
from glm_dsa.serving.engine import Engine
from glm_dsa.model.random_init import init_params
from glm_dsa.model.mtp import init_mtp_params

CFG = configs.tiny
K = 3


@pytest.fixture(scope="module")
def weights():
    return init_params(CFG, seed=0, dtype="float32"), init_mtp_params(CFG, seed=1, dtype="float32")


def _engine(weights, k=K):
    params, mtp = weights
    return Engine(CFG, params, dtype="float32", max_model_len=96, max_num_seqs=4, num_speculative_tokens=k,
                  mtp_params=mtp)


def _prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(2, CFG.vocab_size, n).tolist() for n in (5, 9, 14)]


def test_turns_with_different_accepted_counts_reuse_one_executable_fed_one_host_buffer(weights):
    """Oracle drafts right up to draft position m (m = k, 1, 0): the accepted counts differ from run to run (and
    the tokens do not), yet no turn compiles a new executable, each turn launches the step once with one host
    array (the packed inputs, not one transfer per array) and reads the device once."""
    eng = _engine(weights)
    spec = eng.spec
    ref = eng.generate(_prompts(), max_new_tokens=12, stop_token_ids=[])  # compiles the run's shapes
    step, calls = spec._step, []

    def spy(*args, **kw):
        calls.append(sum(isinstance(a, np.ndarray) for a in args))
        return step(*args, **kw)

    spec._step = spy
    compiled = step._cache_size()
    lengths = []
    for m in (K, 1, 0):
        def oracle(r, m=m):
            right = ref[r.prompt_index][len(r.output): len(r.output) + K]
            return [t if i < m else (t + 1 + i) % CFG.vocab_size for i, t in enumerate(right)]
        spec.oracle = oracle
        steps, syncs, n_calls = spec.steps, eng.stats.syncs, len(calls)
        assert eng.generate(_prompts(), max_new_tokens=12, stop_token_ids=[]) == ref, f"m={m}"
        assert step._cache_size() == compiled, f"m={m}: a turn compiled a new executable"
        assert len(calls) - n_calls == spec.steps - steps == eng.stats.syncs - syncs, f"m={m}"
        lengths.append(eng.last_timings["spec_mean_accepted_length"])
    assert lengths[0] > lengths[1] > lengths[2] == 1.0  # the runs did accept different counts
    assert calls and set(calls) == {1}, f"host arrays per launch: {sorted(set(calls))}"


def test_a_greedy_turn_leaves_the_draft_distributions_untouched(weights):
    """Greedy turns never read the draft distributions, so they do not write them (a [S + 1, k, vocab] float32
    buffer); a sampling turn does (its drafts' q is what rejection sampling divides by)."""
    eng = _engine(weights)
    spec = eng.spec
    sentinel = jnp.full(spec.draft_probs.shape, 7.0, jnp.float32)
    spec.draft_probs = jax.device_put(sentinel, spec.draft_probs.sharding)
    eng.generate(_prompts(), max_new_tokens=8, stop_token_ids=[])
    assert eng.last_timings["spec_drafts"] > 0
    assert np.all(np.asarray(spec.draft_probs) == 7.0)
    eng.generate(_prompts(), max_new_tokens=8, temperature=0.8, seed=3, stop_token_ids=[])
    q = np.asarray(spec.draft_probs)
    written = np.any(q != 7.0, axis=(1, 2))[:-1]  # per request table row (the last is the padding groups')
    assert written.sum() == len(_prompts()), written  # the three requests' rows, not the fourth, unused one
    np.testing.assert_allclose(q[:-1][written].sum(-1), 1.0, rtol=1e-5)  # distributions


def test_the_benchmark_plain_step_runs_distinct_tokens(weights):
    """The MTP benchmark's plain decode step writes, for B rows at one position, layer-0 KV rows that differ
    pairwise: it ran on B distinct tokens (with src >= 0 every row read the previous step's id 0 instead and
    wrote B equal rows, so every row routed to the same experts and the step cost was flat in B)."""
    eng = _engine(weights, k=1)
    b, ctx = 4, 40
    eng.caches = jax.tree.map(jnp.zeros_like, eng.caches)
    bench_mtp.plain_step_ms(eng, b, ctx, np.random.default_rng(0))
    pp = bench_mtp.pages_needed(ctx + 1, eng.block_size)
    page = 1 + np.arange(b) * pp + (ctx - 1) // eng.block_size  # bench_mtp._tables: request i's pages 1 + i pp ..
    layer0 = np.asarray(eng.caches["mla"][0])
    written = layer0.reshape(-1, layer0.shape[-1])[page * eng.block_size + (ctx - 1) % eng.block_size]
    assert np.all(np.abs(written).sum(-1) > 0)
    diff = np.abs(written[:, None] - written[None]).sum(-1)
    assert np.all(diff[~np.eye(b, dtype=bool)] > 1e-3), diff
