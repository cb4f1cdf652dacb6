"""The indexer op's composition, shared by its kernel impls (`kernels.indexer.triton`, `kernels.indexer.mosaic`):
queries in the cache's arithmetic, a scores kernel, then the top-k (the select kernel of
`kernels.indexer.topk_triton` or `lax.top_k`), over query rows in chunks so that a long prefill never holds [T, S]
float32 scores."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from .. import registry
from ..common.chunking import map_row_chunks
from . import prepare_queries, select_topk
from .config import SELECT_MIN_ROWS, TopkConfig

SCORE_BUDGET = 1 << 25  # float32 scores held at once by the top-k stage (128 MiB)


def topk_select_impl(s: int, topk: int, topk_impl: str | None, interpret: bool, rows: int | None = None,
                     config: TopkConfig | None = None) -> str:
    """The "topk" impl (`kernels.indexer.select_topk`) the indexer's kernel impls run over `rows` rows (None: many)
    of `s` scores: the select kernel ("triton", or "triton_interpret" when `interpret`) for `topk_impl` "select";
    "xla" (`lax.top_k`) for "lax". None: the registry's rule "topk.auto" for `rows` rows (None: many) of `s` scores
    with the select's `config` (None: a config of one pass); under the interpreter None keeps `lax.top_k` (the same
    positions and scores; the interpreted kernel is only slower, and the CPU tests check it on its own).
    "select" on shapes it does not take is the registry's ValueError naming the constraint."""
    if topk_impl not in (None, "select", "lax"):
        raise ValueError(f"indexer: topk_impl {topk_impl!r} must be 'select', 'lax' or None")
    kernel = "triton_interpret" if interpret else "triton"
    if topk_impl is None:
        if interpret:
            return "xla"
        # decided for a GPU: the caller's scores kernel runs natively (not interpreted), so on one
        scores = jax.ShapeDtypeStruct((SELECT_MIN_ROWS if rows is None else rows, s), jnp.float32)
        return kernel if registry.decide("topk.auto", scores, None, topk, s, platform="gpu",
                                         config=config or TopkConfig(chunks=1)) == "triton" else "xla"
    return kernel if topk_impl == "select" else "xla"


def scores_then_topk(scores: Callable, q, weights, k_cache, token_req, kv_lens, block_tables, *, block_size: int,
                     topk: int, return_scores: bool = False, ordered: bool = True, row_chunk: int | None = None,
                     interpret: bool = False, topk_impl: str | None = None, topk_config=None, name: str = "indexer"):
    """`kernels.indexer.indexer_topk` from a scores kernel: `scores(q, w, token_req, kv_lens)` of a chunk of rows,
    given queries and weights as `prepare_queries` makes them, returns float32 [rows, S'] (S' >= S, -inf at
    s >= kv_lens). Then the top-k (`topk_impl`: "select" the select kernel of `kernels.indexer.topk_triton` with launch
    config `topk_config`, "lax" `topk_positions` (`lax.top_k`), None as `topk_select_impl` says; both give the
    same positions and scores; with `ordered` False the select kernel leaves them in position order,
    `TopkConfig.sort` "none"), `row_chunk` query rows at a time (default: as many rows as keep the float32 scores
    under SCORE_BUDGET, rounded down to a power of two). `name` prefixes the errors."""
    q, weights = prepare_queries(q, weights, k_cache)
    s = block_tables.shape[1] * block_size
    if row_chunk is None:
        # a power of two: prefill chunks (powers of two) then split into whole row chunks, no padded rows
        row_chunk = 1 << max(0, (SCORE_BUDGET // max(s, 1)).bit_length() - 1)
    elif not (isinstance(row_chunk, int) and row_chunk >= 1):
        raise ValueError(f"indexer {name}: row_chunk {row_chunk!r} must be an int >= 1")
    topk_config = topk_config or TopkConfig()
    select = topk_select_impl(s, topk, topk_impl, interpret, rows=min(q.shape[0], row_chunk), config=topk_config)
    if not ordered:  # the selection's sort is a large share of the op at decode batch sizes
        topk_config = dataclasses.replace(topk_config, sort="none")
    topk_options = {} if select == "xla" else {"config": topk_config}

    def rows(q_, w_, r_, n_):
        return select_topk(scores(q_, w_, r_, n_), n_, topk, s, impl=select, **topk_options)

    pos, val = map_row_chunks(rows, (q, weights, token_req, kv_lens), row_chunk)
    return (pos, val) if return_scores else pos
