"""DCP=N against DCP=1 on 8 simulated devices: identical greedy tokens, fp32 logits within 1e-5.

The oracle is the DCP=1 engine (itself checked against HF in tests/reference). The two field defects of
docs/math.md §4 and §6 are patched in to show these tests catch them.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm_dsa
import kernels.fused_norm_rope as fnr
from checkpoints.random import write_random_checkpoint
from glm_dsa.model.config import indexer_schedule
from glm_dsa.model.options import StepOptions, resolve_options
from glm_dsa.model.paged_cache import owner_slots, pages_needed
from kernels import default_impl
from kernels.common.chunking import map_row_chunks
from sharding import DCP, ParallelConfig
from sharding import dcp as dcp_mod

# 8 heads so TP=8 divides; GLM-5.2 schedule (F F F S S S) with a dense first layer; top-k 8 < prompt lengths
CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=6, num_attention_heads=8,
                                   indexer_types=indexer_schedule(6, freq=4, offset=3))
PAIRS = [(2, 2), (4, 4), (8, 4), (8, 8), (4, 2)]
INTERLEAVE = [1, 2, 16]
# A pairwise covering of (TP, DCP) x interleave x QREP x backend: every pair of values appears in some run.
DCP_RUNS = [(PAIRS[i], INTERLEAVE[j], bool((i + j) % 2), ["a2a", "ag_rs"][(i + (j == 2) + (i >= 3 and j == 0)) % 2])
            for i in range(5) for j in range(3)]
PROMPT_LENS = [1, 3, 17, 64]
NEW = 6


def test_runs_cover_every_pair():
    factors = list(zip(*DCP_RUNS))
    for a, b in itertools.combinations(range(4), 2):
        want = {(x, y) for x in set(factors[a]) for y in set(factors[b])}
        assert want == {(r[a], r[b]) for r in DCP_RUNS}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp_tiny")
    write_random_checkpoint(CFG, path, seed=1, dtype="float32", progress=False)
    return path


def _load(ckpt, parallel=None):
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=96, progress=False, parallel=parallel)


def _prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(ckpt):
    eng = _load(ckpt)
    ids = np.asarray(_prompts()[2:3] * 2)
    return {"logits": eng.logits(ids), "tokens": eng.generate(_prompts(), NEW, stop_token_ids=[]), "ids": ids}


@pytest.mark.parametrize("pair,interleave,qrep,backend", DCP_RUNS,
                         ids=[f"tp{p[0]}-dcp{p[1]}-I{i}-{'qrep' if q else 'gather'}-{b}" for p, i, q, b in DCP_RUNS])
def test_dcp_matches_dcp1(ckpt, reference, pair, interleave, qrep, backend):
    par = ParallelConfig(tensor_parallel_size=pair[0], decode_context_parallel_size=pair[1],
                         dcp_q_replicate=qrep, dcp_comm_backend=backend, cp_kv_cache_interleave_size=interleave)
    eng = _load(ckpt, par)
    assert eng.parallel.q_replicate is qrep and eng.parallel.dcp_comm_backend == backend
    np.testing.assert_allclose(eng.logits(reference["ids"]), reference["logits"], atol=1e-5, rtol=0)
    assert eng.generate(_prompts(), NEW, stop_token_ids=[]) == reference["tokens"]


def test_qrep_and_backends_agree_closely(ckpt, reference):
    outs = {}
    for qrep, backend in itertools.product([False, True], ["a2a", "ag_rs"]):
        eng = _load(ckpt, ParallelConfig(4, 4, dcp_q_replicate=qrep, dcp_comm_backend=backend))
        outs[qrep, backend] = eng.logits(reference["ids"])
    for k, v in outs.items():
        np.testing.assert_allclose(v, outs[False, "a2a"], atol=1e-6, rtol=0, err_msg=str(k))


def test_mixed_prefill_and_decode_rows_under_dcp(ckpt, reference):
    """One ragged step holding a decode row of request 0 and the whole prefill of request 1 (DCP=4, I=2)."""
    par = ParallelConfig(4, 4, cp_kv_cache_interleave_size=2)
    eng = _load(ckpt, par)
    a, b = _prompts()[2], _prompts()[3]
    bs = eng.block_size
    tables = np.array([[1, 2, 0], [3, 4, 5]], np.int32)
    assert pages_needed(len(b), bs, 4, 2) <= 3
    run = jax.jit(functools.partial(glm_dsa.step, config=CFG, parallel=par))

    def batch(rows, logits_rows):
        req, pos, ids = (np.array([r[k] for r in rows], np.int32) for k in range(3))
        slots = owner_slots(tables, req, pos, bs, 4, 2)
        return glm_dsa.StepBatch(*(jnp.asarray(x) for x in (ids, pos, slots, req, tables,
                                                            np.asarray(logits_rows, np.int32))))

    caches = jax.tree.map(jnp.zeros_like, eng.caches)
    _, caches = run(eng.params, caches, batch([(0, p, t) for p, t in enumerate(a[:-1])], [0]))
    rows = [(0, len(a) - 1, a[-1])] + [(1, p, t) for p, t in enumerate(b)]
    logits, _ = run(eng.params, caches, batch(rows, [0, len(rows) - 1]))
    one = _load(ckpt)
    np.testing.assert_allclose(np.asarray(logits[0]), one.logits(np.asarray([a]))[0, -1], atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[1]), one.logits(np.asarray([b]))[0, -1], atol=1e-5)


def test_long_prefill_runs_in_bounded_row_chunks(ckpt, reference, monkeypatch):
    """Gather/attend/merge in chunks of 5 query rows (StepOptions.dcp_row_chunk) gives the same result as one
    round; every layer's attention does run in chunks of 5."""
    from glm_dsa.model import layers as model
    rounds = []

    def spy(fn, args, chunk):
        rounds.append((args[0].shape[0], chunk))
        return map_row_chunks(fn, args, chunk)

    monkeypatch.setattr(model, "map_row_chunks", spy)
    par = ParallelConfig(2, 2)
    fwd = jax.jit(functools.partial(glm_dsa.forward, config=CFG, parallel=par, options=StepOptions(dcp_row_chunk=5)))
    logits = fwd(_load(ckpt, par).params, jnp.asarray(reference["ids"]))
    assert rounds == [(reference["ids"].size, 5)] * CFG.num_hidden_layers
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], atol=1e-5, rtol=0)


def test_step_options_validated_and_impl_conflict_raises(ckpt):
    """StepOptions resolves impl=None to the platform default and rejects unknown values by name; `impl=` and
    `options=` naming different impls is an error, the same impl twice is not."""
    assert StepOptions().impl == default_impl()
    for bad, field in (({"impl": "cuda"}, "impl"), ({"moe_mode": "sparse"}, "moe_mode"),
                       ({"dcp_row_chunk": 0}, "dcp_row_chunk")):
        with pytest.raises(ValueError, match=f"StepOptions.{field}"):
            StepOptions(**bad)
    params, ids = _load(ckpt).params, jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="impl='triton_interpret' conflicts with options.impl='xla'"):
        glm_dsa.forward(params, ids, config=CFG, impl="triton_interpret", options=StepOptions(impl="xla"))
    with pytest.raises(ValueError, match="conflicts"):
        glm_dsa.step(params, None, None, config=CFG, impl="xla", options=StepOptions(impl="triton_interpret"))
    with pytest.raises(TypeError, match="StepOptions"):
        glm_dsa.forward(params, ids, config=CFG, options={"impl": "xla"})
    same = StepOptions(impl="xla", moe_mode="dense")
    assert resolve_options("xla", same) is same and resolve_options("xla", None) == StepOptions(impl="xla")


# ---- the two field defects, patched in --------------------------------------------------------------

def _skip_q_norm_for_unowned(original):
    def defective(q_c, *args, **kw):
        out = original(q_c, *args, **kw)
        slot_mapping = args[2]
        return (jnp.where((slot_mapping < 0)[:, None], q_c, out[0]),) + tuple(out[1:])
    return defective


def test_defect_q_norm_skipped_for_unowned_slots_is_caught(ckpt, reference, monkeypatch):
    monkeypatch.setattr(fnr, "fused_norm_rope_cache", _skip_q_norm_for_unowned(fnr.fused_norm_rope_cache))
    eng = _load(ckpt, ParallelConfig(4, 4))
    # 100x the tolerance the DCP tests hold the correct code to
    assert np.abs(eng.logits(reference["ids"]) - reference["logits"]).max() > 1e-3


@pytest.mark.parametrize("backend", ["a2a", "ag_rs"])
def test_defect_lse_merge_skipped_is_caught(ckpt, reference, monkeypatch, backend):
    def keep_partial(o, lse, comm=None):  # each rank keeps its own heads' partial over its local tokens only
        h = lse.shape[1] // jax.lax.axis_size(DCP)
        r = jax.lax.axis_index(DCP)
        return (jax.lax.dynamic_slice_in_dim(o, r * h, h, axis=1),
                jax.lax.dynamic_slice_in_dim(lse, r * h, h, axis=1))
    monkeypatch.setattr(dcp_mod, "merge_a2a" if backend == "a2a" else "merge_ag_rs", keep_partial)
    eng = _load(ckpt, ParallelConfig(4, 4, dcp_comm_backend=backend))
    assert np.abs(eng.logits(reference["ids"]) - reference["logits"]).max() > 1e-3
    assert eng.generate(_prompts(), NEW, stop_token_ids=[]) != reference["tokens"]


@pytest.mark.parametrize("par", [ParallelConfig(2, 2, dcp_q_replicate=True, dcp_comm_backend="a2a"),
                                 ParallelConfig(4, 4, dcp_q_replicate=False, dcp_comm_backend="ag_rs")],
                         ids=["tp2-dcp2-qrep-a2a", "tp4-dcp4-gather-ag_rs"])
def test_dcp_on_the_triton_kernels_matches_dcp1(ckpt, reference, par):
    """The GPU default path under DCP, interpreted: the Triton sparse MLA (partials + LSE), indexer (local
    scores for the global top-k) and fused norm kernels per rank give DCP = 1's logits and tokens."""
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=96, progress=False, parallel=par,
                       impl="triton_interpret")
    np.testing.assert_allclose(eng.logits(reference["ids"]), reference["logits"], atol=1e-5, rtol=0)
    assert eng.generate(_prompts(), NEW, stop_token_ids=[]) == reference["tokens"]
