"""The scheduler under TP/DCP layouts (8 simulated CPU devices, float32 weights): a staggered workload (requests
arriving while others decode, prefill chunks mixed with decode rows, a small page budget that forces preemption)
gives DCP=1's greedy tokens. Page tables are shared by the DCP ranks; each rank holds its share of positions."""

import numpy as np
import pytest

import glm_dsa
from glm_dsa import ParallelConfig, configs
from glm_dsa.serving.sampling import SamplingParams


def _workload(eng):
    """Three requests at once, two more after a few steps; returns every request's tokens."""
    rng = np.random.default_rng(7)
    ps = [rng.integers(0, configs.tiny.vocab_size, n).tolist() for n in (19, 6, 30, 11, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])
    streams = [eng.submit(p, params) for p in ps[:3]]
    for _ in range(4):
        eng.step()
    streams += [eng.submit(p, params) for p in ps[3:]]
    while eng.step():
        pass
    assert eng.allocator.free == eng.num_pages - 1
    return [s.output for s in streams], eng.scheduler.preemptions


@pytest.fixture(scope="module")
def reference(ckpt):
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                       progress=False)
    return _workload(eng)[0]


@pytest.mark.parametrize("tp,dcp,interleave,block_size,num_pages", [(2, 2, 1, 16, 4), (4, 4, 2, 4, 5)])
def test_scheduler_under_dcp_matches_dcp1(ckpt, reference, tp, dcp, interleave, block_size, num_pages):
    par = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                         cp_kv_cache_interleave_size=interleave)
    # num_pages is per rank: the longest request (42 tokens) holds 2 pages of 16 on rank 0 of 2, or 3 of 4 on
    # rank 0 of 4 (12 positions in runs of 2), so a few running requests run out of pages
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                       num_pages=num_pages, block_size=block_size, parallel=par, progress=False)
    got, preemptions = _workload(eng)
    assert preemptions > 0
    assert got == reference
