"""Text in and out: a checkpoint with tokenizer.json takes text prompts in the CLI and prints text; ids still work."""

import pytest

import glm_dsa
from checkpoints.random import write_random_checkpoint
from glm_dsa.serving import text
from glm_dsa.cli import main

tokenizers = pytest.importorskip("tokenizers")

CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"))
WORDS = "the quick brown fox jumps over a lazy dog hello world".split()


def write_tokenizer(path, vocab_size=CFG.vocab_size):
    """A WordLevel tokenizer.json over `vocab_size` tokens (every id the tiny model can emit decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = ["[UNK]", "<eos>"] + WORDS
    vocab += [f"w{i}" for i in range(len(vocab), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("text_ckpt")
    write_random_checkpoint(CFG, path, seed=2, dtype="float32", progress=False)
    write_tokenizer(path)
    return path


def test_encode_decode(ckpt, tmp_path):
    tok = text.load_tokenizer(ckpt, vocab_size=CFG.vocab_size)
    ids = tok.encode("hello world the fox")
    assert ids == [11, 12, 2, 5] and tok.decode(ids) == "hello world the fox"
    assert tok.decode([11, 1]) == "hello" and tok.decode([11, 1], skip_special_tokens=False) == "hello <eos>"
    assert text.load_tokenizer(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json in .*--prompt-ids"):
        text.load_tokenizer(tmp_path, required=True)
    small = text.load_tokenizer(ckpt, vocab_size=12)
    with pytest.raises(ValueError, match=r"token 12 \('world'\), outside the model's vocabulary \[0, 12\)"):
        small.encode("fox world")
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        text.load_tokenizer(tmp_path)


def test_cli_generate_text_and_ids(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hello world", "--prompt", "the lazy dog",
                 "--prompt-ids", "11,12", "--max-new-tokens", "3", "--ignore-eos", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "prompt 0 (2 tokens): [11, 12]" in out and "prompt text: 'hello world'" in out
    assert "prompt 1 (3 tokens): [2, 9, 10]" in out and "prompt 2 (2 tokens): [11, 12]" in out
    lines = out.splitlines()
    texts = [ln.split("text: ", 1)[1] for ln in lines if ln.startswith("  text: ")]
    gens = [ln for ln in lines if ln.startswith("  generated 3: ")]
    assert len(texts) == 3 and len(gens) == 3
    assert texts[0] == texts[2] and gens[0] == gens[2]  # the text prompt and its ids give the same continuation
    tok = text.load_tokenizer(ckpt)
    assert texts[0] == repr(tok.decode(eval(gens[0].split(": ", 1)[1])))


def test_cli_text_prompt_needs_a_tokenizer(tmp_path, capsys):
    write_random_checkpoint(CFG, tmp_path, dtype="float32", progress=False)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hello"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
