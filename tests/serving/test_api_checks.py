"""What a new user hits first (issue 15): argument checks at the API that name the argument, tiny temperatures
that behave as greedy, a traced sampler, one depth rule for configs, and the CLI's defaults and messages.
Each test here failed on 79b174b's behaviour."""

import json
import math

import jax
import numpy as np
import pytest

import glm_dsa
import kernels
from glm_dsa import ConfigError, configs
from glm_dsa.cli import build_parser, main
from glm_dsa.serving import sampling
from glm_dsa.serving.sampling import GREEDY_BELOW, SamplingParams, sample

CFG = configs.tiny  # the fixtures `ckpt` and `eng` (conftest.py) hold a random checkpoint of it


# ---- generate: arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("kw, err, name", [
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature="0.5"), TypeError, "temperature"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(seed=2**70), ValueError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=None), TypeError, "max_new_tokens"),
    (dict(max_new_tokens="4"), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids"),
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), TypeError, "stop_token_ids"),
])
def test_generate_rejects_bad_arguments_by_name(eng, kw, err, name):
    kw = {"max_new_tokens": 3, **kw}
    with pytest.raises(err, match=name):
        eng.generate([[5, 6, 7]], **kw)


@pytest.mark.parametrize("prompts, err", [
    ([[5.7, 6.2]], TypeError),        # was silently run as [[5, 6]]
    ([["5", "6"]], TypeError),
    ([[True, 6]], TypeError),
    ([[5, 6, 256]], ValueError),      # outside the vocabulary of 256
    ([[5, -1]], ValueError),
    ([[]], ValueError),
    ([5, 6, 7], TypeError),           # a flat list is not a list of prompts
    ("5 6 7", TypeError),
])
def test_generate_rejects_bad_token_ids(eng, prompts, err):
    with pytest.raises(err, match="prompt"):
        eng.generate(prompts, max_new_tokens=2)


def test_numpy_integer_token_ids_are_fine(eng):
    a = eng.generate([np.asarray([5, 6, 7], np.int64)], max_new_tokens=3, stop_token_ids=[])
    b = eng.generate([[5, 6, 7]], max_new_tokens=3, stop_token_ids=[np.int32(-0) + 300])  # never emitted
    assert a == b


def test_tiny_temperatures_are_greedy(eng):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    greedy = eng.generate(prompts, max_new_tokens=6, stop_token_ids=[])
    for t in (1e-40, 1e-30, GREEDY_BELOW / 2):
        assert eng.generate(prompts, max_new_tokens=6, temperature=t, seed=3, stop_token_ids=[]) == greedy


def test_large_seeds_are_distinct_and_reproducible(eng):
    kw = dict(max_new_tokens=8, temperature=1.0, stop_token_ids=[])
    a = eng.generate([[5, 6, 7]], seed=2**63 + 5, **kw)
    assert a == eng.generate([[5, 6, 7]], seed=2**63 + 5, **kw)
    others = [eng.generate([[5, 6, 7]], seed=s, **kw) for s in (5, 2**32 + 5, 2**64 - 1)]
    assert all(o != a for o in others)


def test_sampling_params_check_themselves():
    assert SamplingParams(temperature=np.float32(0.5), seed=np.int64(3)).temperature == 0.5
    assert SamplingParams(temperature=1e-9).greedy and not SamplingParams(temperature=0.1).greedy
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature=True)


# ---- the sampler: traced per row, against a float64 oracle ----------------------------------------
def _oracle_probs(logits, t, top_p):
    """float64 numpy: softmax(logits / t) cut to the smallest top set whose mass reaches top_p, renormalised."""
    z = logits.astype(np.float64) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def test_sampler_is_traced_per_row_and_matches_the_distribution():
    v, n = 6, 4000
    base = np.asarray([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], np.float32)
    logits = np.tile(base, (n, 1))
    keys = jax.random.split(jax.random.key(0), n)
    before = sampling._sample._cache_size()  # the jitted sampler behind `sample`
    for t, p in ((0.7, 1.0), (1.3, 0.8), (0.9, 0.95)):  # distinct values, one compiled sampler
        ids = np.asarray(sample(logits, keys, np.full(n, t, np.float32), np.full(n, p, np.float32)))
        freq = np.bincount(ids, minlength=v) / n
        want = _oracle_probs(base, t, p)
        assert np.all(freq[want == 0] == 0)
        np.testing.assert_allclose(freq, want, atol=4 * math.sqrt(0.25 / n))
    assert sampling._sample._cache_size() - before <= 1  # was one compile per (temperature, top_p)
    # rows of one batch with their own values: greedy rows take the argmax, the others sample
    temps = np.where(np.arange(n) % 2 == 0, 0.0, 5.0).astype(np.float32)
    ids = np.asarray(sample(logits, keys, temps, np.ones(n, np.float32)))
    assert np.all(ids[::2] == 5) and len(set(ids[1::2].tolist())) == v
    # inside a trace (the serving step) the same rows, and no conditional: a GPU reads a cond's predicate back to
    # the host, which stalled the dispatch of every serving step behind the previous one
    traced = jax.jit(lambda lg, k, t, p: sample(lg, k, t, p))
    np.testing.assert_array_equal(np.asarray(traced(logits, keys, temps, np.ones(n, np.float32))), ids)
    for greedy in (None, True, False):
        closed = jax.make_jaxpr(lambda lg, k, t, p: sample(lg, k, t, p, all_greedy=greedy))(
            logits, keys, temps, np.ones(n, np.float32))
        assert " cond[" not in str(closed) and ("sort" in str(closed)) == (greedy is not True)


# ---- Engine arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, name", [
    (dict(max_model_len=0), "max_model_len"),     # was silently 4096
    (dict(max_model_len=-5), "max_model_len"),
    (dict(num_pages=-3), "num_pages"),
    (dict(num_pages=1), "num_pages"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=-1), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=12), "block_size"),
    (dict(cache_memory_fraction=0.0), "cache_memory_fraction"),
])
def test_engine_rejects_bad_sizes_by_name(eng, kw, name):
    with pytest.raises(ValueError, match=name):
        glm_dsa.Engine(eng.config, eng.params, **kw)


def test_load_names_a_file_given_for_a_directory(ckpt):
    for f in ("model.safetensors", "config.json"):
        with pytest.raises(ValueError, match="is a file; give the checkpoint directory"):
            glm_dsa.load(ckpt / f, progress=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        glm_dsa.load(ckpt / "missing", progress=False)


# ---- config: one depth rule, token-id fields --------------------------------------------------------
def test_depth_follows_the_models_own_schedule():
    f, s = "full", "shared"
    assert configs.glm52.replace(num_hidden_layers=8).indexer_types == (f, f, f, s, s, s, f, s)
    assert configs.glm52.with_depth(8) == configs.glm52.replace(num_hidden_layers=8)
    assert configs.glm52.with_depth(12).mlp_layer_types == ("dense",) * 3 + ("sparse",) * 9
    assert configs.glm5.with_depth(5).indexer_types == (f,) * 5
    assert configs.bench.with_depth(3).indexer_types == (f, f, s)  # an explicit pattern is cut
    with pytest.raises(ConfigError, match="explicit 4-layer pattern"):
        configs.bench.with_depth(6)
    # a changed schedule field in the same replace is the one used
    assert configs.glm52.replace(num_hidden_layers=4, index_topk_freq=2).indexer_types == (f, f, f, s)


def test_config_json_round_trips_the_schedule(tmp_path):
    cfg = configs.glm52.with_depth(10)
    cfg.save_pretrained(tmp_path)
    back = glm_dsa.GlmDsaConfig.from_pretrained(tmp_path)
    assert back == cfg and back.with_depth(14) == configs.glm52.with_depth(14)


@pytest.mark.parametrize("eos", ["</s>", 1.5, [1, "2"], [True], -3])
def test_bad_eos_token_id_is_a_config_error(tmp_path, eos):
    d = CFG.to_dict()
    d["eos_token_id"] = eos
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="eos_token_id"):
        glm_dsa.GlmDsaConfig.from_pretrained(tmp_path)


# ---- CLI ---------------------------------------------------------------------------------------------
def test_cli_impl_defaults_to_the_platforms(eng):
    args = build_parser().parse_args(["generate", "--checkpoint", "x", "--prompt-ids", "1"])
    assert args.impl is None  # was "xla" on every platform
    assert glm_dsa.Engine(eng.config, eng.params, max_model_len=32).impl == kernels.default_impl()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--checkpoint", "x", "--prompt-ids", "1", "--impl", "cuda"])


def test_cli_random_checkpoint_uses_the_depth_rule(tmp_path):
    assert main(["random-checkpoint", "--preset", "demo", "--num-layers", "5", "--out", str(tmp_path / "d")]) == 0
    got = json.loads((tmp_path / "d" / "config.json").read_text())["indexer_types"]
    assert tuple(got) == configs.demo.with_depth(5).indexer_types


def test_cli_bad_outputs_are_messages(tmp_path, ckpt, capsys):
    existing = tmp_path / "a_file"
    existing.write_text("x")
    assert main(["random-checkpoint", "--preset", "tiny", "--out", str(existing)]) == 2
    assert "error:" in capsys.readouterr().err and existing.read_text() == "x"
    out = tmp_path / "missing" / "dir" / "t.safetensors"
    assert main(["trace", "--checkpoint", str(ckpt), "--prompt-ids", "5,6,7", "--out", str(out),
                 "--dtype", "float32"]) == 0
    assert out.is_file()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "5,6", "--max-model-len", "0"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_the_module_paths_the_readme_names_still_import():
    """`glm_dsa.configs` (the presets), `glm_dsa.sampling`, `glm_dsa.text` and `glm_dsa.distributed` are modules the
    README and DESIGN.md name: importable by those paths and the package's attributes, whatever subpackage holds
    them now."""
    import importlib

    for name in ("configs", "sampling", "text", "distributed"):
        assert importlib.import_module(f"glm_dsa.{name}") is getattr(glm_dsa, name)
    from glm_dsa.configs import PRESETS, glm52
    from glm_dsa.sampling import SamplingParams as Params
    assert PRESETS["glm52"] is glm52 and glm_dsa.configs.tiny.model_type == "glm_moe_dsa"
    assert Params is glm_dsa.SamplingParams and callable(glm_dsa.text.load_tokenizer)
