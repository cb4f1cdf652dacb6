"""Logprobs against an independent oracle: a float64 log-softmax of `Engine.logits` over the same sequence."""

import numpy as np
import pytest

import glm_dsa
from glm_dsa import configs

CFG = configs.tiny


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_logprobs_match_float64_log_softmax_of_logits(eng):
    prompts = _prompts(11, [5, 14])
    out = eng.generate(prompts, max_new_tokens=4, stop_token_ids=[], logprobs=5)
    assert all(isinstance(c, glm_dsa.Completion) for c in out)
    for p, c in zip(prompts, out):
        assert c.finish_reason == "length" and len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs) == 4
        seq = np.asarray([p + c.token_ids[:-1]])
        want = _log_softmax64(eng.logits(seq)[0, len(p) - 1:])  # rows predicting each new token
        for j, tok in enumerate(c.token_ids):
            assert isinstance(c.logprobs[j], float)
            np.testing.assert_allclose(c.logprobs[j], want[j, tok], rtol=0, atol=2e-5)
            best = np.argsort(-want[j], kind="stable")[:5]
            assert list(c.top_logprobs[j]) == best.tolist()  # decreasing logprob
            np.testing.assert_allclose(list(c.top_logprobs[j].values()), want[j, best], atol=2e-5)
            assert tok == best[0]  # greedy: the sampled token is the best alternative


def test_sampled_logprobs_are_the_models_distribution_and_n0(eng):
    """Logprobs are reported before temperature: at temperature 2 the sampled tokens' logprobs still equal the
    model's log-softmax (a scaled distribution would be log_softmax(logits / 2)); N = 0 reports no alternatives."""
    p = _prompts(12, [7])[0]
    c = eng.generate([p], max_new_tokens=3, temperature=2.0, seed=5, stop_token_ids=[], logprobs=0)[0]
    assert c.top_logprobs == [{}, {}, {}]
    want = _log_softmax64(eng.logits(np.asarray([p + c.token_ids[:-1]]))[0, len(p) - 1:])
    np.testing.assert_allclose(c.logprobs, want[np.arange(3), c.token_ids], atol=2e-5)
    # the same request without logprobs samples the same tokens (the logprobs leave sampling alone)
    assert eng.generate([p], max_new_tokens=3, temperature=2.0, seed=5, stop_token_ids=[]) == [c.token_ids]


@pytest.mark.parametrize("bad, err", [(-1, ValueError), (21, ValueError), (1.0, TypeError), (True, TypeError)])
def test_bad_logprobs_name_the_argument(eng, bad, err):
    with pytest.raises(err, match="logprobs"):
        eng.generate([[1, 2]], max_new_tokens=1, logprobs=bad)
