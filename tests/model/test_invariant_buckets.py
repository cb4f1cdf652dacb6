"""Batch-invariant decode steps in row buckets (8 to the decode rows, `kernels.registry.decode_buckets`): a decode
row must be computed alike at every bucket. On the CPU shapes do not move numbers, so this is checked by tracing a
GLM-5.2-width decode step (the bench preset: FP8 weights, fp8_ds_mla cache) for a GPU at every bucket:
- every rule's decision (`registry.record`) and every kernel launch config (`registry.record_launches`: tiles,
  split counts, split-K) is the same at each bucket, so a row's reduction order in the kernels is the kind's;
- every XLA product outside the kernels (dot_general, top_k) has the same operand shapes at each bucket: those
  over the step's rows run at the decode rows (`glm_dsa.model.linear.at_decode_rows`), since XLA picks their
  algorithm by shape.
The default mode is the negative control for both (its choices and products follow the rows). A launch config
chosen from the bucket's rows again (e.g. the FP8 linear's split-K from its own rows) or a product left at the
bucket's rows fails here."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_dsa import configs
from glm_dsa.model import linear
from glm_dsa.model.kernel_table import _abstract_step_inputs, _trimmed, step_decisions
from glm_dsa.model.options import StepOptions
from glm_dsa.model.step import resolve_parallel, step
from kernels import registry

CFG = configs.bench
BUCKETS = registry.decode_buckets()  # 8 .. 256
STEP = dict(requests=32, context=32768, block_size=64, kv_cache_dtype="fp8_ds_mla", quantization="fp8",
            dtype="bfloat16")


def _decided(rows: int, invariant: bool = True):
    """([(rule, choice, step kind)], [(kernel, launch config)]) of one decode step of `rows` rows, for a GPU."""
    with registry.record_launches() as launches:
        log = step_decisions(CFG, rows=rows, batch_invariant=invariant, **STEP)
    return [(d.rule, d.choice, d.step_kind) for d in log], launches


def test_buckets():
    assert BUCKETS == (8, 16, 32, 64, 128, 256)
    assert registry.decode_buckets(16) == (8, 16) and registry.decode_buckets(48) == (8, 16, 32, 48)
    assert registry.decode_buckets(4) == (4,)
    assert [registry.decode_step_rows(n) for n in (1, 8, 9, 33, 129, 256)] == [8, 8, 16, 64, 256, 256]
    assert registry.decode_step_rows(40, 48) == 48
    with pytest.raises(ValueError, match="over the kind's 256"):
        registry.decode_step_rows(257)


def test_rule_decisions_and_launch_configs_are_the_same_at_every_decode_bucket():
    ref_rules, ref_launches = _decided(BUCKETS[0])
    assert {kind for _, _, kind in ref_rules} == {"decode"}
    kernels = {name for name, _ in ref_launches}
    assert {"fp8_linear", "moe", "indexer_scores", "topk_select", "fused_norm_rope"} <= kernels, kernels
    assert kernels & {"sparse_mla", "sparse_mla_mosaic"}
    for rows in BUCKETS[1:]:
        rules, launches = _decided(rows)
        assert rules == ref_rules, rows
        assert launches == ref_launches, rows
    # the negative control: the default mode's decode steps choose by their rows
    assert _decided(8, invariant=False)[1] != _decided(256, invariant=False)[1]


def _products(jaxpr, out: list) -> list:
    """(primitive, operand shapes) of every dot_general and top_k in `jaxpr` and the jaxprs it holds, outside the
    Pallas kernels (whose bodies are the kernels' own products, fixed by their launch configs)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            continue
        if name in ("dot_general", "top_k"):
            out.append((name, tuple(tuple(v.aval.shape) for v in eqn.invars)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _products(inner, out)
    return out


def _step_products(rows: int, invariant: bool = True) -> list:
    cfg = _trimmed(CFG)
    parallel = resolve_parallel(None, cfg)
    with registry.deciding_for("gpu"):
        args = _abstract_step_inputs(cfg, parallel, rows=rows, **STEP)
        options = StepOptions(impl="auto", batch_invariant=invariant)
        jaxpr = jax.make_jaxpr(functools.partial(step, config=cfg, parallel=parallel, options=options))(*args)
    return sorted(_products(jaxpr.jaxpr, []))


def test_xla_products_run_at_the_decode_rows_at_every_bucket():
    ref = _step_products(BUCKETS[0])
    rows = registry.INVARIANT_STEP_ROWS
    # the products over the step's rows: the router (and its top-k), the indexer's head weights, the absorbed
    # query and value products; the LM head's rows are the logits rows (the requests), fixed by the runner
    assert any(name == "top_k" and shapes == ((rows, CFG.n_routed_experts),) for name, shapes in ref), ref
    assert sum(1 for name, shapes in ref if name == "dot_general" and rows in shapes[0]) >= 4, ref
    assert not any(BUCKETS[0] in shapes[0] for _, shapes in ref), ref
    for t in (16, 64, 256):
        assert _step_products(t) == ref, t
    assert _step_products(8, invariant=False) != _step_products(16, invariant=False)  # the negative control


def test_at_decode_rows():
    x = jnp.arange(12.0).reshape(3, 4)
    w = jnp.ones((4, 2))
    seen = []

    def f(x_):
        seen.append(x_.shape)
        return x_ @ w, x_[:, :1]

    want = (x @ w, x[:, :1])
    for on, rows, most, shape in ((False, None, 16, (3, 4)), (True, 8192, 16, (3, 4)), (True, 3, 16, (16, 4)),
                                  (True, 3, 3, (3, 4))):
        seen.clear()
        with registry.batch_invariant(on, rows=rows, decode_rows=most):
            got = linear.at_decode_rows(f, x)
            assert registry.invariant_decode_rows() == (most if on and rows == 3 else None)
        assert seen == [shape]
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert registry.invariant_decode_rows() is None
    # the same equations whether the step is of the kind's most rows or fewer (padded): two barriers, a pad, a cut
    for most in (3, 16):
        with registry.batch_invariant(True, rows=3, decode_rows=most):
            eqns = [e.primitive.name for e in jax.make_jaxpr(lambda x_: linear.at_decode_rows(f, x_))(x).eqns]
        assert eqns == ["pad", "optimization_barrier", "dot_general", "slice", "optimization_barrier", "slice",
                        "slice"], eqns
    with registry.batch_invariant(True, rows=3, decode_rows=2), pytest.raises(ValueError, match="over the kind's 2"):
        linear.at_decode_rows(f, x)
