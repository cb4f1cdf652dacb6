"""Token sampling on the device: greedy, temperature and nucleus (top-p)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits, key, temperature: float, top_p: float, row_ids):
    """Next token per row of float32 `logits` [N, V]. Greedy (argmax, lowest id on ties) at temperature 0;
    otherwise softmax(logits / temperature) restricted to the smallest set of top tokens whose probability
    reaches `top_p`. Row i draws from `fold_in(key, row_ids[i])`, so a row's draw does not depend on the
    other rows of the batch."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1, stable=True)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        scaled = jnp.full_like(scaled, -jnp.inf).at[jnp.arange(scaled.shape[0])[:, None], order].set(sorted_logits)
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(row_ids)
    return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
