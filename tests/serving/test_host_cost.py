"""The serving loop's host work per decode step does not grow with the context: a step sends the rows, the
logits rows and the block-table entries that changed, never whole block tables (which grow with the pages a
request holds). Measured by what is built, not by the clock: the bytes of the host arrays each step hands to the
device, and the device-to-host reads (one per step: the previous step's ids)."""

import numpy as np

import glm_dsa
from glm_dsa import configs

CFG = configs.tiny


def _decode_step_bytes(eng, prompt_len: int, batch: int = 2) -> int:
    rng = np.random.default_rng(prompt_len)
    prompts = [rng.integers(0, CFG.vocab_size, prompt_len).tolist() for _ in range(batch)]
    syncs0, steps0 = eng.stats.syncs, eng.stats.steps
    eng.generate(prompts, max_new_tokens=3, stop_token_ids=[])
    assert eng.stats.syncs - syncs0 == eng.stats.steps - steps0  # one read per step, nothing else waits
    return eng.stats.last_h2d_bytes  # the last step decodes one row per prompt


def test_bytes_sent_per_decode_step_do_not_grow_with_the_context(ckpt):
    eng = glm_dsa.load(ckpt, dtype="float32", max_model_len=2048 + 8, block_size=16, max_num_seqs=2,
                       max_num_batched_tokens=4096, num_pages=2 * 130 + 1, progress=False)
    short = _decode_step_bytes(eng, 256)  # 16 pages per request
    long = _decode_step_bytes(eng, 2048)  # 128 pages per request: 8x the block-table entries
    assert eng.pages_per_seq >= 128
    assert 0 < long <= 2 * short, (short, long)
