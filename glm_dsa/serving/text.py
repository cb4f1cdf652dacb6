"""Text in and out: a checkpoint's `tokenizer.json`, read with the Hugging Face `tokenizers` library.

`tokenizers` is an optional dependency (`pip install 'glm-dsa[text]'`): token ids work without it. A
checkpoint directory, HF or orbax (where `convert` copies the tokenizer files to its root), "has text" when
it holds `tokenizer.json`.

    tok = glm_dsa.text.load_tokenizer(path, vocab_size=cfg.vocab_size)
    ids = tok.encode("Hello")            # list[int], checked against the model's vocabulary
    tok.decode(eng.generate([ids], 16)[0])
"""

from __future__ import annotations

import os

TOKENIZER_FILE = "tokenizer.json"
#: Files that travel with a checkpoint's text side (copied by `convert`, when present).
TEXT_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja")


def tokenizer_file(checkpoint: str | os.PathLike) -> str | None:
    """The path of `tokenizer.json` in a checkpoint directory, or None."""
    path = os.path.join(os.fspath(checkpoint), TOKENIZER_FILE)
    return path if os.path.isfile(path) else None


class TextTokenizer:
    """A `tokenizers.Tokenizer` with encode / decode over plain lists, whose ids are checked against the
    model's vocabulary (a tokenizer larger than the model is an error that names the token, not an index
    error on the device)."""

    def __init__(self, tokenizer, path: str, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.path = path
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own special tokens unless `add_special_tokens=False`)."""
        # encode_batch, not encode: the batch form lets go of the GIL while it runs, so a server tokenising a long
        # prompt in a worker thread keeps answering on its event loop
        ids = list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text)} characters)"
        if not ids:
            raise ValueError(f"prompt {shown} encodes to no tokens with {self.path}")
        if self.vocab_size is not None:
            for i in ids:
                if i >= self.vocab_size:
                    raise ValueError(f"{self.path}: prompt {shown} encodes to token {i} "
                                     f"({self.tokenizer.id_to_token(i)!r}), outside the model's vocabulary "
                                     f"[0, {self.vocab_size})")
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens dropped unless `skip_special_tokens=False`)."""
        # decode_batch for the same reason as encode_batch in `encode`
        return self.tokenizer.decode_batch([[int(i) for i in ids]], skip_special_tokens=skip_special_tokens)[0]


def load_tokenizer(checkpoint: str | os.PathLike, *, vocab_size: int | None = None,
                   required: bool = False) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it has no `tokenizer.json` (an error if `required`).

    Raises ImportError with the install hint when `tokenizers` is missing, and ValueError naming the file
    when it cannot be parsed."""
    path = tokenizer_file(checkpoint)
    if path is None:
        if required:
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {os.fspath(checkpoint)}: text prompts need one "
                                    f"(give token ids with --prompt-ids instead)")
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(f"{path} needs the 'tokenizers' package: pip install 'glm-dsa[text]' "
                          f"(or pip install tokenizers)") from None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception for malformed files
        raise ValueError(f"{path} is not a valid tokenizer.json ({e})") from None
    return TextTokenizer(tok, path, vocab_size)
