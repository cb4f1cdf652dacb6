"""Token sampling on the device (greedy, temperature and nucleus top-p) and the checked per-request parameters.

Temperature and top-p are traced per row, so requests with different values share one compiled sampler (one
compile per row-count bucket, not per value).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

#: Temperatures below this sample greedily: logits / 1e-40 overflow float32, and the distribution such a
#: temperature asks for is the argmax anyway.
GREEDY_BELOW = 1e-5

#: The smallest top_p that samples: float32's smallest normal number (2**-126). The sampler compares top_p in
#: float32 on the device, which flushes subnormal values to 0, and a cut at 0 keeps no token at all (every
#: logit -inf, so the draw is always token 0).
TOP_P_MIN = float(np.finfo(np.float32).tiny)

#: The most alternatives a request may ask logprobs for (OpenAI's top_logprobs bound, vLLM's default). The
#: serving step computes this many whenever any request of the step asks, so one compiled variant serves every N.
MAX_LOGPROBS = 20


def _real(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def check_token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """`ids` (a sequence of integers) as a list of ints in [0, vocab_size); TypeError for non-integers (floats,
    strings, bools are not token ids), ValueError for ids outside the vocabulary. `name` heads the messages."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a list of integer token ids, got {ids!r}")
    if isinstance(ids, list) and all(type(tok) is int for tok in ids):  # the usual case, without a per-id ABC check
        if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
            return list(ids)
    out = []
    for j, tok in enumerate(ids):
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, numbers.Integral):
            raise TypeError(f"{name}, position {j}: token id {tok!r} ({type(tok).__name__}) is not an integer")
        if not 0 <= int(tok) < vocab_size:
            raise ValueError(f"{name}, position {j}: token id {int(tok)} is outside the vocabulary [0, {vocab_size})")
        out.append(int(tok))
    return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples, checked on construction (TypeError / ValueError naming the argument).

    temperature: >= 0 and finite; below GREEDY_BELOW (and at 0) the request is greedy. top_p: in [TOP_P_MIN, 1].
    seed: any integer in [0, 2**64). max_tokens: new tokens, >= 0. stop_token_ids: None (the model's EOS ids)
    or a list of token ids; [] never stops early. logprobs: None (none reported) or N in [0, MAX_LOGPROBS]:
    each sampled token's logprob and the N most likely tokens' ones are reported (see `token_logprobs` for
    which distribution).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None

    def __post_init__(self):
        t = _real("temperature", self.temperature)
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if np.float32(p) < TOP_P_MIN:
            raise ValueError(f"top_p must be at least {TOP_P_MIN:.8g} (float32's smallest normal number: the "
                             f"device flushes smaller values to 0, which keeps no token), got {self.top_p!r}")
        seed = _int("seed", self.seed)
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed}")
        n = _int("max_tokens", self.max_tokens)
        if n < 0:
            raise ValueError(f"max_tokens must be >= 0, got {n}")
        stop = self.stop_token_ids
        if stop is not None:
            if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
                raise TypeError(f"stop_token_ids must be None or a list of integer token ids, got {stop!r}")
            stop = tuple(_int(f"stop_token_ids[{j}]", s) for j, s in enumerate(stop))
            if any(s < 0 for s in stop):
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {list(stop)}")
        lp = self.logprobs
        if lp is not None:
            lp = _int("logprobs", lp)
            if not 0 <= lp <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp}")
        for name, v in (("temperature", t), ("top_p", p), ("seed", seed), ("max_tokens", n),
                        ("stop_token_ids", stop), ("logprobs", lp)):
            object.__setattr__(self, name, v)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def key(self) -> jax.Array:
        """The request's PRNG key (64-bit seeds are split into two 32-bit words, so every seed is distinct)."""
        return jax.random.wrap_key_data(np.asarray([self.seed >> 32, self.seed & 0xFFFFFFFF], np.uint32))


def _sample_rows(logits, keys, temperature, top_p):
    """Rows with temperature >= GREEDY_BELOW: softmax(logits / t) restricted to the smallest set of top tokens
    whose probability reaches top_p (rows with top_p = 1 skip the cut, so no rounding of the cumulative sum can
    drop a token), drawn with each row's own key."""
    greedy = temperature < GREEDY_BELOW
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    sorted_logits = jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)
    cut = jnp.full_like(scaled, -jnp.inf).at[jnp.arange(scaled.shape[0])[:, None], order].set(sorted_logits)
    scaled = jnp.where((top_p < 1.0)[:, None], cut, scaled)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def token_logprobs(logits, ids, k: int = MAX_LOGPROBS):
    """The logprobs of sampled `ids` [N] and the `k` most likely tokens of each row of `logits` [N, V].

    The distribution is the model's own: log_softmax(logits) in float32, before temperature and top_p (vLLM's
    default, "raw_logprobs"; for a greedy request it is also the distribution the argmax was taken from). So a
    request's logprobs do not depend on how it samples, and equal a float64 log-softmax of `Engine.logits` up to
    float32 rounding. Returns (sampled float32 [N], top ids int32 [N, k], top logprobs float32 [N, k]); the top
    ids are in decreasing logprob order, ties by lower token id (`lax.top_k`'s order)."""
    logits = logits.astype(jnp.float32)
    # max-shifted logsumexp per row: each row's arithmetic reads that row only (nothing across rows)
    m = jnp.max(logits, axis=-1, keepdims=True)
    lse = m[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1))
    picked = jnp.take_along_axis(logits, ids[:, None].astype(jnp.int32), axis=-1)[:, 0] - lse
    top_vals, top_ids = jax.lax.top_k(logits, k)
    return picked, top_ids.astype(jnp.int32), top_vals - lse[:, None]


def _all_greedy(temperature) -> bool | None:
    """Whether every row is greedy, when the temperatures are known on the host (None while tracing)."""
    if isinstance(temperature, jax.core.Tracer):
        return None
    return bool(np.all(np.asarray(temperature, np.float32) < GREEDY_BELOW))


@functools.partial(jax.jit, static_argnames=("all_greedy",))
def _sample(logits, keys, temperature, top_p, all_greedy):
    logits = logits.astype(jnp.float32)
    if all_greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _sample_rows(logits, keys, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32))


def sample(logits, keys, temperature, top_p, *, all_greedy: bool | None = None):
    """Next token per row of `logits` [N, V] (float32).

    keys: one PRNG key per row [N] (a row's draw depends only on its key, not on the other rows); temperature,
    top_p: float32 [N], traced (no recompile per value). Greedy rows (temperature < GREEDY_BELOW) take the argmax
    (lowest id on ties). `all_greedy` (static) says every row is greedy, so nothing else is computed; None decides
    it from host temperatures, or (inside a trace) samples every row with its greedy rows taking the argmax. The
    choice is never a `lax.cond` on device values: a GPU reads a conditional's predicate back to the host, which
    would stall the dispatch of the step that samples."""
    if all_greedy is None:
        all_greedy = _all_greedy(temperature)
    return _sample(logits, keys, temperature, top_p, bool(all_greedy))
