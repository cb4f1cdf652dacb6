"""Shared fixtures of the serving tests: a tiny random float32 checkpoint (with a word-level tokenizer and a chat
template, for the server's text paths) and helpers."""

import json

import pytest

from checkpoints.random import write_random_checkpoint
from glm_dsa import configs

CFG = configs.tiny
#: the chat template of the test checkpoint: one line per message, then the assistant's turn
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def write_text_files(path, vocab_size=CFG.vocab_size):
    """A WordLevel tokenizer.json over `vocab_size` tokens ("w<i>" is token i, so every id decodes) and a
    tokenizer_config.json with `TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = ["[UNK]", "<eos>", "user", "assistant", "system", ":", ";", "hello", "world"]
    vocab += [f"w{i}" for i in range(len(vocab), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random `configs.tiny` checkpoint (float32, HF layout, seed 0) with tokenizer files."""
    path = tmp_path_factory.mktemp("tiny_serving")
    write_random_checkpoint(CFG, path, seed=0, dtype="float32", progress=False)
    write_text_files(path)
    return path

