"""Inputs shared by the multi-process workers and the single-process reference (tests/multihost)."""

LOGIT_IDS = [[5, 9, 33, 7, 100, 42, 250, 3, 17, 64, 128, 200], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
GEN_PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 6

#: prefix caching (prefix_worker.py): a shared 16-token prefix, two turns
PREFIX_BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
PREFIX_NEW_TOKENS = 4


def prefix_turns(eng, new_tokens: int) -> list[list[int]]:
    """Two chat turns through `eng.generate`: two prompts sharing PREFIX_BASE in one call, then each prompt with
    its answer and two more tokens. Returns the four answers."""
    first = [PREFIX_BASE + [1, 2, 3], PREFIX_BASE + [4, 5]]
    out = eng.generate(first, max_new_tokens=new_tokens, stop_token_ids=[])
    second = [p + a + [7, 7] for p, a in zip(first, out)]
    return out + eng.generate(second, max_new_tokens=new_tokens, stop_token_ids=[])
