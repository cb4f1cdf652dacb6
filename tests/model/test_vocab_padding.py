"""Vocabularies that TP does not divide (docs/math.md §14): the LM head is stored padded to a multiple of 128 columns
(zeros), split over the TP devices, and the model returns exactly vocab_size logits, so no caller (logits, trace,
sampling) ever sees a pad id. Checkpoints in and out (HF, FP8, orbax, init_params) keep vocab_size rows."""

import functools
import types

import jax
import numpy as np
import pytest

import glm_dsa
from checkpoints import fp8_blocks
from checkpoints.layout import padded_vocab_size, param_specs
from checkpoints.loader import HFCheckpoint
from checkpoints.random import write_random_checkpoint
from checkpoints.writer import save_hf_params, write_hf_tensors
from glm_dsa import ParallelConfig, configs
from glm_dsa.model.param_tree import flatten_params

#: tiny with a prime vocabulary and 8 heads, so that TP = 8 applies.
PRIME = configs.tiny.replace(vocab_size=257, num_attention_heads=8)
PROMPTS = [[256, 3, 9, 200, 17, 5, 250, 1, 64, 128, 255, 7], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 256, 256, 14]]


def test_padded_width():
    assert [padded_vocab_size(v) for v in (1, 128, 129, 256, 257, 129280, 154880)] == [128, 128, 256, 256, 384,
                                                                                      129280, 154880]


def test_layout_pads_the_lm_head_only():
    specs = param_specs(PRIME)
    head, embed = specs["lm_head"], specs["embed"]
    assert head.shape == (64, 384) and head.hf_shapes == ((257, 64),) and head.hf_axes is None
    assert embed.shape == (257, 64)  # replicated on every device: nothing to split, nothing to pad
    w = np.random.default_rng(0).standard_normal((257, 64)).astype(np.float32)
    ours = head.from_hf(w)
    np.testing.assert_array_equal(ours[:, :257], w.T)
    np.testing.assert_array_equal(ours[:, 257:], 0)
    (back,) = head.to_hf(ours)
    np.testing.assert_array_equal(back, w)
    tied = param_specs(PRIME.replace(tie_word_embeddings=True))["lm_head"]
    assert tied.hf_keys == ("model.embed_tokens.weight",) and tied.shape == (64, 384)
    assert param_specs(configs.tiny)["lm_head"].hf_axes is not None  # 256: not padded, read shard by shard


def _cfg(**widths):
    base = dict(num_attention_heads=8, intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1,
                vocab_size=257, padded_vocab_size=384)
    return types.SimpleNamespace(**{**base, **widths})


def test_check_model_pads_the_vocabulary_not_the_heads():
    for tp in (1, 2, 4, 8):
        ParallelConfig(tp).check_model(PRIME)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(8\)"):
        ParallelConfig(8).check_model(configs.tiny.replace(vocab_size=257))
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(36\) is not divisible by .* \(8\)"):
        ParallelConfig(8).check_model(_cfg(moe_intermediate_size=36))
    with pytest.raises(ValueError, match=r"vocab_size \(257, LM head padded to 384 columns\) is not divisible by "
                                         r"tensor_parallel_size \(5\)"):
        ParallelConfig(5).check_model(_cfg(num_attention_heads=5, intermediate_size=5, moe_intermediate_size=5))


@pytest.fixture(scope="module")
def prime_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("prime")
    write_random_checkpoint(PRIME, path, seed=1, dtype="float32", progress=False)
    return path


@pytest.fixture(scope="module")
def one(prime_ckpt):
    return glm_dsa.load(prime_ckpt, dtype="float32", max_model_len=64, progress=False)


def _logits(eng):
    return [np.asarray(eng.logits(np.array([p])))[0] for p in PROMPTS]


@pytest.mark.parametrize("tp,dcp", [(4, 1), (4, 2), (8, 4)])
def test_prime_vocabulary_across_layouts(prime_ckpt, one, tp, dcp):
    """TP = 4 / 8 over a 257-token vocabulary: the LM head's 384 columns split evenly, pad columns zero, and the
    logits (exactly 257 wide) and greedy tokens those of one device."""
    eng = glm_dsa.load(prime_ckpt, dtype="float32", max_model_len=64, progress=False, parallel=ParallelConfig(tp, dcp))
    head = eng.params["lm_head"]
    assert head.shape == (64, 384) and {s.data.shape for s in head.addressable_shards} == {(64, 384 // tp)}
    np.testing.assert_array_equal(np.asarray(head)[:, 257:], 0)
    np.testing.assert_array_equal(np.asarray(head)[:, :257],
                                  HFCheckpoint(prime_ckpt).read("lm_head.weight").T)
    for a, b in zip(_logits(one), _logits(eng)):
        assert a.shape == b.shape == (len(a), 257) and np.abs(a - b).max() <= 1e-5
    want = one.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[])
    assert eng.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[]) == want


def test_pad_ids_are_never_sampled(one):
    """Give the pad columns the weights of 3 x the first greedy token's column: were they not cut off, their logit
    would beat that token's and greedy decoding would emit ids >= 257. They are cut: nothing changes."""
    first = one.generate(PROMPTS[:1], max_new_tokens=1, stop_token_ids=[])[0][0]
    want = one.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[])
    params = jax.tree.map(lambda x: x, one.params)
    head = np.asarray(params["lm_head"]).copy()
    head[:, 257:] = 3.0 * head[:, [first]]
    params["lm_head"] = jax.device_put(head, one.params["lm_head"].sharding)
    eng = glm_dsa.Engine(PRIME, params, parallel=ParallelConfig(1), dtype="float32", max_model_len=64)
    assert eng.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[]) == want
    sampled = eng.generate(PROMPTS, max_new_tokens=16, temperature=5.0, seed=3, stop_token_ids=[])
    assert all(0 <= t < 257 for s in sampled for t in s)
    assert eng.logits(np.array([PROMPTS[0]])).shape == (1, len(PROMPTS[0]), 257)
    logits, _ = jax.jit(functools.partial(glm_dsa.step, config=PRIME))(*_one_step(eng))  # "pure: jit it"
    assert logits.shape[-1] == 257


def _one_step(eng):
    from glm_dsa.model.step import prefill_inputs
    caches, batch = prefill_inputs(eng.params, np.array([PROMPTS[1]]), config=PRIME, parallel=eng.parallel)
    return eng.params, caches, batch


def test_trace_and_forward_are_vocab_wide(one):
    from glm_dsa.debug.trace import traced_step
    params, caches, batch = _one_step(one)
    logits, _, taps = traced_step(params, caches, batch, config=PRIME)
    assert logits.shape == (len(PROMPTS[1]), 257) and taps
    assert glm_dsa.forward(params, np.array([PROMPTS[1]]), config=PRIME).shape == (1, len(PROMPTS[1]), 257)


def test_init_params_and_saves_keep_the_vocabulary(one, tmp_path):
    """init_params makes the padded head on a TP = 4 mesh; HF saves write 257 rows back; orbax saves restore onto
    another mesh."""
    params = glm_dsa.init_params(PRIME, seed=0, dtype="float32", parallel=ParallelConfig(4))
    assert params["lm_head"].shape == (64, 384)
    assert {s.data.shape for s in params["lm_head"].addressable_shards} == {(64, 96)}

    save_hf_params(flatten_params(one.params), PRIME, tmp_path / "hf", progress=False)
    ck = HFCheckpoint(tmp_path / "hf")
    assert ck.shape("lm_head.weight") == (257, 64)
    np.testing.assert_array_equal(ck.read("lm_head.weight"), np.asarray(one.params["lm_head"])[:, :257].T)

    import checkpoints
    checkpoints.save_orbax_params(one.params, PRIME, tmp_path / "orbax")
    eng = glm_dsa.load(tmp_path / "orbax", dtype="float32", max_model_len=64, progress=False,
                       parallel=ParallelConfig(8, 2))
    for a, b in zip(_logits(one), _logits(eng)):
        assert np.abs(a - b).max() <= 1e-5


def test_fp8_lm_head_of_a_prime_vocabulary_loads(prime_ckpt, one, tmp_path):
    """An FP8 block-scaled lm_head [257, 64] (a ragged last block row) is dequantised whole and padded."""
    src = HFCheckpoint(prime_ckpt)
    q, s = fp8_blocks.quantize_blocks(src.read("lm_head.weight"))
    tensors = {k: np.asarray(src.read(k)) for k in src.keys() if k != "lm_head.weight"}
    tensors.update({"lm_head.weight": q, "lm_head.weight_scale_inv": s})
    write_hf_tensors(tmp_path / "fp8", [(k, t.dtype, t.shape) for k, t in tensors.items()], tensors.items(),
                     extra=PRIME.save_pretrained)
    eng = glm_dsa.load(tmp_path / "fp8", dtype="float32", max_model_len=64, progress=False,
                       parallel=ParallelConfig(4))
    head = np.asarray(eng.params["lm_head"])
    np.testing.assert_array_equal(head[:, :257], fp8_blocks.dequantize_blocks_np(q, s).T)
    np.testing.assert_array_equal(head[:, 257:], 0)
