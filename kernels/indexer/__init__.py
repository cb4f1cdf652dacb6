"""Lightning indexer scores and top-k (docs/math.md §2): which cached tokens each query row attends to.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the keys of the row's own request, read from the
paged indexer cache through the block table. Row t sees the first `kv_lens[t]` cached positions of its
request (pos(t) + 1 on one device; under DCP, the rank's local tokens at or before pos(t)), so the op
knows nothing of how positions are spread over ranks. The softmax scale 128^-0.5 and 32^-0.5 are folded
into `w` by the caller (both positive, so they commute with relu).
Top-k keeps min(topk, kv_lens[t]) positions: higher score first, then smaller position; the rest are -1.
"""

from __future__ import annotations

from .. import registry
from .reference import (ROW_CHUNK, indexer_scores_xla, indexer_topk_xla, prepare_queries,  # noqa: F401
                        request_slots, topk_positions)
from .config import ROW_BLOCK, ROW_BLOCK_MIN_T, SELECT_MIN_ROWS, TopkConfig

SELECT_MAX_S = 65536  # widest row the select kernel (indexer/topk_triton.py) holds in registers: 64 keys a thread


def select_topk(scores, kv_lens, topk: int, width: int | None = None, *, impl: str = "xla", **kernel_options):
    """`topk_positions` as an op of its own (`kernels.registry` op "topk"): impl "xla" is `topk_positions`
    (`lax.top_k`), "triton" / "triton_interpret" the select kernel (`kernels.indexer.topk_triton.topk_select`, its
    `kernel_options`: config, num_warps, sort), which returns the same positions and scores, "auto" the rule
    "topk.auto" (`_choose_topk`)."""
    return registry.dispatch("topk", impl, scores, kv_lens, topk, width, **kernel_options)


def select_width_supported(s: int) -> str | None:
    """Why the select kernel cannot take rows of `s` scores (None: it can)."""
    return None if s <= SELECT_MAX_S else f"top-k rows of {s} scores exceed SELECT_MAX_S {SELECT_MAX_S}"


def _topk_width(scores, width: int | None) -> int:
    """The scores per row a top-k selects from: the first `width` columns of `scores` (all of them for None)."""
    return scores.shape[-1] if width is None else min(width, scores.shape[-1])


def select_supports(scores, kv_lens, topk: int, width: int | None = None, **_) -> str | None:
    """The select kernel's `supports` check: rows of at most SELECT_MAX_S scores (the first `width` columns)."""
    return select_width_supported(_topk_width(scores, width))


def indexer_topk(q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int, topk: int,
                 return_scores: bool = False, ordered: bool = True, impl: str = "xla", **kernel_options):
    """Top-k positions [T, min(topk, S)] (int32, -1 padded) for indexer queries `q` [T, H, Di] (roped),
    head weights `weights` [T, H] (scales folded in), the paged key cache `k_cache` [slots, Di], each row's
    request `token_req` [T], its number of visible keys `kv_lens` [T] and `block_tables` [R, pages].
    With `return_scores`, also their float32 scores (-inf where -1): the DCP global top-k merges these.
    `ordered` (default): each row's entries by score descending, then position ascending; False: the same entries
    in whatever order the impl makes cheapest (the select kernel's position order), still followed by the -1s —
    for callers that use them as a set (sparse attention, the DCP global top-k, which sorts them anyway).
    `k_cache` is bf16 [slots, Di] or FP8 uint8 [slots, Di + 4] (queries are then quantised per (t, h)).
    impl (`kernels.registry`): "xla" (oracle, CPU default), "triton" (Pallas Triton scores, then the select
    top-k kernel or `topk_positions` per shape, row chunks), "triton_interpret" (the same kernels under the Pallas
    interpreter, for CPU tests), "mosaic" (the Mosaic GPU scores kernel, `kernels.indexer.mosaic`: FP8 caches with
    pages of a multiple of 64 keys, GPU only; then the same top-k), "auto" (`_choose_indexer`: "mosaic" for decode
    rows on a GPU where it takes them, "triton" for the rest on a GPU, "xla" elsewhere); `kernel_options` go
    to `triton.indexer_topk_triton` (config, block_s, block_t, num_warps, num_stages, block_n, fp8_dot,
    row_chunk, topk_impl, topk_config) or `mosaic.indexer_topk_mosaic` (config, row_chunk, topk_impl,
    topk_config); the xla form takes `row_chunk`."""
    return registry.dispatch("indexer", impl, q, weights, k_cache, token_req, kv_lens, block_tables,
                             block_size=block_size, topk=topk, return_scores=return_scores, ordered=ordered,
                             **kernel_options)


def takes_row_blocks(t: int, requests: int) -> bool:
    """Whether `triton.indexer_scores_triton` (block_t None) scores T rows of `requests` requests with the
    row-block kernel: from ROW_BLOCK_MIN_T rows, when they leave runs of ROW_BLOCK rows of one request on average
    (prefill chunks); decode rows (one a request) take the per-row kernel."""
    return t >= ROW_BLOCK_MIN_T and (requests - 1) * ROW_BLOCK <= t


def _scores_form(platform: str, t: int, requests: int, float32_cache: bool) -> str:
    """The Triton scores kernel: "row_block" for prefill chunks, "per_row" for decode rows and float32 caches.

    `takes_row_blocks` says which rows are prefill chunks (runs of ROW_BLOCK rows of one request on average)."""
    del platform  # a form of the Triton kernel, which runs where it was asked for
    return "row_block" if not float32_cache and takes_row_blocks(t, requests) else "per_row"


def _choose_topk(platform: str, scores, kv_lens, topk: int, width: int | None = None, *, config=None, **_) -> str:
    """The select kernel on a GPU from SELECT_MIN_ROWS rows, or from one row in two passes; else lax.top_k.

    The select kernel takes rows of at most SELECT_MAX_S scores; it runs in two passes where a row splits into the
    config's chunks of at least k scores. `lax.top_k` ("xla") runs otherwise and off the GPU; both give the same
    positions and scores bit for bit."""
    del kv_lens
    if platform != "gpu":
        return "xla"
    s = _topk_width(scores, width)
    if select_width_supported(s):
        return "xla"
    two_pass = (config or TopkConfig()).two_pass(s, topk)
    return "triton" if two_pass or scores.shape[0] >= SELECT_MIN_ROWS else "xla"


def _choose_indexer(platform: str, q, weights, k_cache, token_req, kv_lens, block_tables, **kwargs) -> str:
    """Mosaic for decode rows it takes (no Triton launch options given), else Triton; xla off the GPU.

    For decode rows (the per-row scores) the Mosaic kernel's asynchronous copies beat the Triton kernel's
    gathers (BENCHMARKS.md, indexer); prefill rows take Triton's row-block kernel, which reads each key tile once
    for 16 rows."""
    if platform != "gpu":
        return "xla"
    triton_options = set(kwargs) - {"block_size", "topk", "return_scores", "ordered", "row_chunk", "topk_impl",
                                     "topk_config"}
    if (not triton_options and not takes_row_blocks(q.shape[0], block_tables.shape[0])
            and registry.takes("indexer", "mosaic", q, weights, k_cache, token_req, kv_lens, block_tables, **kwargs)):
        return "mosaic"
    return "triton"


registry.register("indexer", "xla", indexer_topk_xla)
registry.register_triton("indexer", "kernels.indexer.triton:indexer_topk_triton",
                         supports="kernels.indexer.triton:supports")


def _choose_indexer_invariant(platform: str, *args, **kwargs) -> str:
    """Batch-invariant mode: Triton on a GPU for every row count (per-row scores in decode steps, the row-block
    kernel in prompt steps: `_scores_form_invariant`, `_scores_form_prompt`), never the Mosaic kernel that the
    rows' and requests' counts pick; xla off the GPU. Prompt steps too (no `invariant_prompt`): the default's
    prefill choice is this Triton kernel, and its Mosaic choice for many requests (a function of static shapes
    too) would leave the row-block kernel."""
    del args, kwargs
    return "triton" if platform == "gpu" else "xla"


def _choose_topk_invariant(platform: str, scores, kv_lens, topk: int, width: int | None = None, *, config=None,
                           **_) -> str:
    """Batch-invariant decode steps: on a GPU the select kernel for every row count where it holds the row (at
    most SELECT_MAX_S scores), else `lax.top_k` (ties by lower position either way). The two give the same
    positions and scores bit for bit (tests/kernels/indexer/test_indexer_topk.py), so the choice changes no number,
    only the cost: XLA's top-k of 256 rows of a 32K context (a segmented radix sort) took 1.45 ms of a
    bench-preset decode step on an H100, the select kernel 0.04 ms for the default mode's 32 rows.

    Prompt steps take the default (`registry.DEFAULT`: the select kernel for rows of at most SELECT_MAX_S scores
    from SELECT_MIN_ROWS rows, the rows being a static chunk of the step's padded rows): both are a selection, no
    arithmetic, one program per row in the select kernel (its two passes split a row into chunks fixed by the
    width and k), and give the same positions and scores (ties by lower position), in position order where the
    caller takes a set (`ordered=False`): a function of the row's own scores whatever the other rows."""
    del config
    return "triton" if platform == "gpu" and not select_supports(scores, kv_lens, topk, width) else "xla"


def _scores_form_invariant(platform: str, t: int, requests: int, float32_cache: bool) -> str:
    """Batch-invariant decode steps: the per-row scores kernel, whatever mix of prefill and decode rows the step
    holds."""
    del platform, t, requests, float32_cache
    return "per_row"


def _scores_form_prompt(platform: str, t: int, requests: int, float32_cache: bool) -> str:
    """Batch-invariant prompt steps: "row_block" from ROW_BLOCK_MIN_T rows (`t`: the static row chunk of the
    step's padded rows the scores kernel runs on), whatever the requests (the step's block table has max_num_seqs'
    rows in the mode, which the default's `takes_row_blocks` would read as decode rows); "per_row" below and for
    float32 caches, as the default.

    The row-block kernel is batch-independent at a fixed shape: its blocks of ROW_BLOCK rows hold whichever rows
    (of one request or several) the batch puts there, but each row r of a block is scored by the same unrolled
    `_row_scores(q[r], w[r], k_tile)`, one [H, Di] x [Di, block_s] dot and a sum over the heads per key, against
    the same key values at the positions it sees (one tile gathered for the block's longest row when its rows share
    a request, else per row: keys past the row's own kv_len are masked to -inf either way), in the key tiles fixed
    by block_s. A row's scores are a function of its query, head weights and visible keys only."""
    del platform, requests
    return "row_block" if not float32_cache and t >= ROW_BLOCK_MIN_T else "per_row"


registry.register_auto("indexer", _choose_indexer, invariant=_choose_indexer_invariant)
registry.register_mosaic("indexer", "kernels.indexer.mosaic:indexer_topk_mosaic",
                         supports="kernels.indexer.mosaic:supports")
registry.register("topk", "xla", topk_positions)
registry.register_triton("topk", "kernels.indexer.topk_triton:topk_select", supports=select_supports)
registry.register_auto("topk", _choose_topk, invariant=_choose_topk_invariant, invariant_prompt=registry.DEFAULT)
registry.register_rule("indexer.scores_form", "indexer", _scores_form, ("row_block", "per_row"),
                       invariant=_scores_form_invariant, invariant_prompt=_scores_form_prompt)
