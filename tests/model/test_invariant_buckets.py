"""Batch-invariant decode steps in row buckets (8 to the decode rows, `kernels.registry.decode_buckets`): a decode
row must be computed alike at every bucket. On the CPU shapes do not move numbers, so this is checked by tracing
decode steps for a GPU at every bucket:
- every rule's decision (`registry.record`) and every kernel launch config (`registry.record_launches`: tiles,
  split counts, split-K) is the same at each bucket, at GLM-5.2's widths (the bench preset: FP8 weights,
  fp8_ds_mla cache), so a row's reduction order in the kernels is the kind's;
- the serving decode step (`glm_dsa.serving.invariant_audit`, the heads preset) is one program at each two
  neighbouring buckets: the same kernel bodies, the same XLA program around them (as many optimisation barriers),
  no product or reduction across rows, and no order-dependent reduction of a row (an RMSNorm's sum), at the
  bucket's rows outside the kernels (those run at the decode rows, `glm_dsa.model.linear.at_decode_rows`, since XLA
  compiles them by shape: on an H100 the RMSNorms at the bucket's rows parted a row between buckets).
The default mode is the negative control for both (its choices and products follow the rows). A launch config
chosen from the bucket's rows again (e.g. the FP8 linear's split-K from its own rows), a kernel body that changes
with the rows (the FP8 linear's row mask) or a product left at the bucket's rows fails here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_dsa import configs
from glm_dsa.serving import invariant_audit
from glm_dsa.model import linear
from glm_dsa.model.kernel_table import step_decisions
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


@pytest.fixture(scope="module")
def serving_steps():
    """The serving decode step (FP8 weights, fp8_ds_mla cache, the `heads` preset: GLM-5.2's attention geometry at
    hidden 1024) traced for a GPU at every bucket (`glm_dsa.serving.invariant_audit`)."""
    return {t: invariant_audit.trace_decode_step(configs.heads, t) for t in BUCKETS}


def test_serving_decode_step_is_one_program_at_every_bucket(serving_steps):
    """At each two neighbouring buckets the serving decode step is one program for a row
    (`invariant_audit.differences`): the same rule decisions and launch configs, the same kernels with the same
    bodies (numbers aside that count rows: a ref's, a row mask's bound), the same XLA program around them with as
    many optimisation barriers, and no product or reduction across rows outside the kernels at the bucket's rows.
    Fails at 32 -> 64 with the FP8 linear kernel's row mask taken from its rows (its plain body from 64 rows on),
    at 128 -> 256 with `at_decode_rows` leaving out its barriers at the kind's most rows, and at 8 -> 16 with the
    decoder's RMSNorms at the bucket's rows (`layers._row_norm` as plain `rms_norm`)."""
    first = serving_steps[BUCKETS[0]]
    xla, kernels = first.parts
    names = {invariant_audit.kernel_name(e) for e in kernels}
    assert {"pallas_call:fp8_linear_w8a16_split_k", "pallas_call:moe_up", "pallas_call:indexer_topk_select",
            "pallas_call:fused_norm_rope_cache"} <= names, names
    assert "mpmd_map:anonymous" in names  # the Mosaic sparse MLA kernel
    # the products over the step's rows run at the decode kind's rows, between barriers: the router's top-k, the
    # indexer's head weights, the absorbed query and value products
    rows = registry.INVARIANT_STEP_ROWS
    assert any(e.primitive.name == "top_k" and e.invars[0].aval.shape == (rows, configs.heads.n_routed_experts)
               for e in xla)
    assert sum(e.primitive.name == "dot_general" and e.invars[0].aval.shape[0] == rows for e in xla) >= 4
    assert invariant_audit.barriers(first) >= 8
    failed = {(a, b): invariant_audit.differences(serving_steps[a], serving_steps[b])
              for a, b in zip(BUCKETS, BUCKETS[1:])}
    assert not any(failed.values()), "\n".join(f"{a} -> {b}: {line}" for (a, b), lines in failed.items()
                                               for line in lines)


def test_default_mode_decode_steps_differ_by_rows(serving_steps):
    """The negative control: the default mode's decode steps of 8 and 16 rows are not one program (launch configs
    and XLA products by their rows), which `differences` sees."""
    default = [invariant_audit.trace_decode_step(configs.heads, t, batch_invariant=False) for t in (8, 16)]
    assert invariant_audit.differences(*default)


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
