"""On two or more GPUs: DCP = 2 on the Triton kernels (the GPU default) against DCP = 1, float32, at the real
head geometry (576-wide MLA rows, 64 heads, the 128-dim indexer) so the kernels run at their real tile shapes.
Every QREP x comm-backend variant; prompts longer than index_topk so attention is sparse."""

import itertools

import jax
import numpy as np
import pytest

import glm_dsa
from checkpoints.random import write_random_checkpoint
from sharding import ParallelConfig

pytestmark = pytest.mark.gpu
CFG = glm_dsa.configs.heads  # the real head geometry at small width and depth

PROMPT_LENS = [1, 70, 200]
NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if len([d for d in jax.devices() if d.platform == "gpu"]) < 2:
        pytest.skip("needs two GPUs (DCP = 2)")
    path = tmp_path_factory.mktemp("gpu_dcp")
    write_random_checkpoint(CFG, path, seed=2, dtype="float32", progress=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]
    ids = np.asarray([prompts[2]])
    one = glm_dsa.load(path, dtype="float32", max_model_len=256, progress=False,
                       parallel=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=1))
    assert one.impl == "triton"
    return path, prompts, ids, one.logits(ids), one.generate(prompts, NEW, stop_token_ids=[])


@pytest.mark.parametrize("qrep,backend", list(itertools.product([False, True], ["a2a", "ag_rs"])))
def test_dcp2_triton_matches_dcp1(setup, qrep, backend):
    path, prompts, ids, logits, tokens = setup
    par = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, dcp_q_replicate=qrep,
                         dcp_comm_backend=backend)
    eng = glm_dsa.load(path, dtype="float32", max_model_len=256, progress=False, parallel=par)
    assert eng.impl == "triton" and eng.parallel.q_replicate is qrep
    got = eng.logits(ids)
    assert np.linalg.norm(got - logits) / np.linalg.norm(logits) < 1e-5
    assert eng.generate(prompts, NEW, stop_token_ids=[]) == tokens
