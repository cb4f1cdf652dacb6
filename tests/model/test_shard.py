"""One device's share of a layout run alone (glm_dsa.model.shard, `bench --shard-of`) against the real mesh's device,
for GLM-5.2 FP8 at TP = 8 with DCP 1 and 8, at abstract shapes on 8 simulated CPU devices (nothing of GLM-5.2 is
allocated): the parameter and cache shapes against jax's own shard shapes of the partition specs, the collectives
each stage issues, and each stage's FLOPs and bytes (XLA's count) with the collectives' own counts taken out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm_dsa.model import presets
from glm_dsa.model.layers import StepContext
from glm_dsa.model.options import StepOptions
from glm_dsa.model.paged_cache import cache_shapes
from glm_dsa.model.placement import partition_specs
from glm_dsa.model.random_init import init_params
from glm_dsa.model.shard import init_shard_params, parse_shard_of, shard_parallel, stand_in
from glm_dsa.serving import shard_benchmark as sbm
from sharding import Collectives, cache_spec, mesh_for, path_str

BLOCK, ROWS, CONTEXT = 64, 16, 8192


def _is_shape(s):
    return isinstance(s, tuple) and bool(s) and isinstance(s[0], int)


def _caches(cfg, pages, dcp, local: bool):
    shapes = cache_shapes(cfg, pages, BLOCK, "fp8_ds_mla")
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s if local else (s[0] * dcp,) + s[1:], jnp.uint8), shapes,
                        is_leaf=_is_shape)


@pytest.mark.parametrize("dcp", [1, 8])
def test_shard_shapes_are_one_device_of_the_mesh(dcp):
    """Every parameter leaf (FP8 weights, K-major expert stacks, scale grids, QREP's q_b / kv_b) and cache of the
    share has the shape jax gives one device's shard of the real mesh's leaf under its partition spec."""
    cfg = presets.glm52
    par = shard_parallel(f"8,{dcp}", cfg)
    local = jax.eval_shape(lambda: init_shard_params(cfg, par, quantization="fp8"))
    full = jax.eval_shape(lambda: init_params(cfg, parallel=par, quantization="fp8"))
    mesh = mesh_for(par)
    specs = partition_specs(full, cfg, par)
    want = jax.tree.map(lambda leaf, spec: (NamedSharding(mesh, spec).shard_shape(leaf.shape), leaf.dtype), full,
                        specs)
    got = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), local)
    pair = lambda x: isinstance(x, tuple)  # noqa: E731  (a (shape, dtype) leaf)
    flat_w = {path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(want, is_leaf=pair)}
    flat_g = {path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(got, is_leaf=pair)}
    assert flat_g == flat_w
    assert flat_g["layers.10.moe.experts_gate"][0] == (256, 2048 // 8, 6144)  # K-major FP8 stack, width split 8 ways
    qrep = dcp > 1  # GLM-5.x's default: query replication under DCP (each rank holds its group's heads)
    assert flat_g["layers.0.attn.q_b_proj"][0][1] == (64 // (8 // dcp) if qrep else 64 // 8)
    pages = 33
    for lc, gc in zip(jax.tree.leaves(_caches(cfg, pages, dcp, True)),
                      jax.tree.leaves(_caches(cfg, pages, dcp, False))):
        assert NamedSharding(mesh, cache_spec()).shard_shape(gc.shape) == lc.shape


def _replayed_cost(call, comm, mesh=None):
    """XLA's (flops, bytes) of `call` made alone through `comm` (under shard_map on `mesh` for the real one)."""
    x = jax.ShapeDtypeStruct(call.shape, jnp.dtype(call.dtype))
    f = lambda a: call.replay(comm, a)  # noqa: E731
    if mesh is not None:
        f = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    ca = jax.jit(f).lower(x).cost_analysis()
    return ca.get("flops", 0.0), ca.get("bytes accessed", 0.0)


@pytest.mark.parametrize("dcp", [1, 8])
def test_stage_compute_and_collectives_equal_the_meshs(dcp):
    """Per stage at 16 decode rows of an 8K context: the collectives the share records are the mesh device's, call
    for call; and its FLOPs and bytes, less those of its collectives made alone, equal the mesh program's less its
    collectives made alone (the compute is the same program; only the collectives differ)."""
    cfg = presets.glm52.with_depth(sbm.representative_depth(presets.glm52))
    par = shard_parallel(f"8,{dcp}", cfg)
    mesh = mesh_for(par)
    pages = ROWS * CONTEXT // BLOCK // dcp + 1
    batch = sbm.step_batch(ROWS, 1, CONTEXT, BLOCK, cfg.vocab_size, np.random.default_rng(0), dcp)
    local = jax.eval_shape(lambda: init_shard_params(cfg, par, quantization="fp8"))
    shard = sbm.stage_costs(cfg, par, batch, CONTEXT, params=local, caches=_caches(cfg, pages, dcp, True))
    full = jax.eval_shape(lambda: init_params(cfg, parallel=par, quantization="fp8"))
    ctx = StepContext(cfg, block_size=BLOCK, parallel=par, options=StepOptions(impl="xla", moe_mode="ragged"))
    gcaches = _caches(cfg, pages, dcp, False)
    x = jax.ShapeDtypeStruct((ROWS, cfg.hidden_size), jnp.bfloat16)
    topk = jax.ShapeDtypeStruct((ROWS, cfg.index_topk), jnp.int32)
    standin = stand_in(par)
    for stage in sbm.STAGES:
        f = jax.shard_map(sbm.stage_body(stage, cfg, ctx), mesh=mesh,
                          in_specs=(partition_specs(full, cfg, par), jax.tree.map(lambda _: cache_spec(), gcaches),
                                    P(), P(), P()), out_specs=P(), check_vma=False)
        with ctx.comm.record() as calls:
            ca = jax.jit(f).lower(full, gcaches, x, topk, batch).cost_analysis()
        assert calls == shard[stage]["collectives"], stage
        mesh_c = np.sum([_replayed_cost(c, Collectives(), mesh) for c in calls], axis=0)
        local_c = np.sum([_replayed_cost(c, standin) for c in calls], axis=0)
        # to 1e-5 (bytes 1e-4): XLA counts a collective made alone a few units off its count inside the program, and
        # the stand-in's rank is a constant (a few index ops of the global top-k fold away); a head or a width off
        # would be >= 1e-2
        assert ca["flops"] - mesh_c[0] == pytest.approx(shard[stage]["flops"] - local_c[0], rel=1e-5), stage
        want_bytes = pytest.approx(shard[stage]["bytes"] - local_c[1], rel=1e-4)
        assert ca["bytes accessed"] - mesh_c[1] == want_bytes, stage


def test_collectives_of_a_layer_by_hand():
    """DCP = 8 with QREP and the a2a merge (GLM-5.2's defaults), 16 decode rows: a full layer's attention gathers
    the local top-k scores and positions over the group, exchanges [o | lse] of the group's 64 heads and sums
    o_proj's output over the 8 devices; the MoE sums once; the head gathers the vocab shards."""
    cfg = presets.glm52.with_depth(7)
    par = shard_parallel("8,8", cfg)
    pages = ROWS * CONTEXT // BLOCK // 8 + 1
    batch = sbm.step_batch(ROWS, 1, CONTEXT, BLOCK, cfg.vocab_size, np.random.default_rng(0), 8)
    local = jax.eval_shape(lambda: init_shard_params(cfg, par, quantization="fp8"))
    costs = sbm.stage_costs(cfg, par, batch, CONTEXT, params=local, caches=_caches(cfg, pages, 8, True))
    got = {s: [(c.kind, c.axes, c.group, c.shape, c.in_bytes, c.out_bytes) for c in v["collectives"]]
           for s, v in costs.items()}
    k = min(cfg.index_topk, CONTEXT // 8)  # each rank holds 1024 of the 8K tokens: its local top-k is all of them
    assert got["attention_full"] == [
        ("all_gather", ("dcp",), 8, (ROWS, k), ROWS * k * 4, ROWS * 8 * k * 4),
        ("all_gather", ("dcp",), 8, (ROWS, k), ROWS * k * 4, ROWS * 8 * k * 4),
        ("all_to_all", ("dcp",), 8, (ROWS, 8, 8, 513), ROWS * 64 * 513 * 4, ROWS * 64 * 513 * 4),
        ("psum", ("tp", "dcp"), 8, (ROWS, 6144), ROWS * 6144 * 2, ROWS * 6144 * 2)]
    assert got["attention_shared"] == got["attention_full"][2:]
    assert got["moe"] == [("psum", ("tp", "dcp"), 8, (ROWS, 6144), ROWS * 6144 * 2, ROWS * 6144 * 2)]
    vocab_shard = cfg.padded_vocab_size // 8
    assert got["head"] == [("all_gather", ("tp", "dcp"), 8, (ROWS, vocab_shard), ROWS * vocab_shard * 4,
                            ROWS * vocab_shard * 32)]


def test_moe_full_width_is_tp_times_the_share():
    """`--num-layers 8` at full width (TP = 1) against one device's share at TP = 8: the MoE layer's weights (routed
    and shared experts with their FP8 scale grids) are exactly 8 times the share's bytes, its products' FLOPs less
    the replicated router exactly 8 times the share's, and XLA's FLOPs less the router 8 times the share's to 1%
    (the per-row work of the routed pairs, gathering, weighting and summing [T k, D] rows, is every device's: 0.4%
    of a share's FLOPs here). XLA's bytes of the xla form count its float32 temporaries, which do not all split:
    they are printed by the GPU command, not asserted."""
    cfg = presets.glm52.with_depth(8)
    check = sbm.moe_width_check(cfg, shard_parallel("8", cfg), ROWS)
    assert check["full"]["router"] == check["shard"]["router"]
    assert check["split_weight_bytes"] == 8
    assert check["full"]["weights"]["bytes"] == 256 * 3 * (6144 * 2048 + 4 * 48 * 16) + 3 * (6144 * 2048 + 4 * 48 * 16)
    assert check["full"]["router_weights"] == check["shard"]["router_weights"]
    assert check["split_flops"] == pytest.approx(8, rel=1e-2)
    # the products' own FLOPs split exactly: 16 rows x 8 routed pairs and 16 shared rows, each gate+up (6144 x 4096)
    # and down (2048 x 6144), plus the replicated router (6144 x 256)
    expert = 2 * 6144 * 4096 + 2 * 2048 * 6144
    assert check["full"]["moe"]["matmul_flops"] == ROWS * 8 * expert + ROWS * expert + 2 * ROWS * 6144 * 256
    assert check["full"]["router"]["matmul_flops"] == 2 * ROWS * 6144 * 256
    assert check["split_matmul_flops"] == 8


def test_matmul_flops_by_hand():
    """`matmul_flops` counts a dot's 2 M N K, a scan body's products once per trip, and a ragged dot's rows against
    their own group only (not XLA's masked product over every group)."""
    def f(a, b, w, sizes):
        z, _ = jax.lax.scan(lambda c, _: (c @ w, None), a @ b, None, length=3)
        return z, jax.lax.ragged_dot(a, jnp.ones((4, 8, 5)), sizes)
    traced = jax.jit(f).trace(jnp.ones((6, 8)), jnp.ones((8, 7)), jnp.ones((7, 7)), jnp.array([1, 2, 0, 3], jnp.int32))
    assert sbm.matmul_flops(traced.jaxpr.jaxpr) == 2 * 6 * 8 * 7 + 3 * (2 * 6 * 7 * 7) + 2 * 6 * 8 * 5


def _small_share(impl, max_requests, rows):
    """The demo model's share of TP = 2 (every stage in its first 4 layers), bf16 caches of `max_requests` 2K-token
    sequences, and a decode batch of `rows` requests at context 2048."""
    cfg = presets.demo
    par = shard_parallel("2", cfg)
    sb = sbm.build(cfg, par, depth=sbm.representative_depth(cfg), max_requests=max_requests, max_len=2049,
                   dtype="bfloat16", impl=impl)
    batch = sbm.step_batch(rows, 1, 2048, sb.block_size, cfg.vocab_size, np.random.default_rng(0), par.dcp,
                           par.interleave)
    return sb, batch


@pytest.mark.parametrize("impl", ["xla", "triton_interpret"])
def test_stage_loop_writes_the_caches_in_place(impl):
    """The attention stages write this step's rows into the layer's caches. The stage timer's executable carries the
    caches donated (every cache leaf aliased input -> output) and its temporaries hold no copy of a layer cache: an
    iteration that copies the cache it writes times a copy the step never makes (its caches are donated too), which
    made every attention stage cost a pass over the whole cache. Both the xla form and the GPU's kernel form (the
    Triton kernel aliases its cache input to its output; interpreted here) are compiled, not run."""
    sb, batch = _small_share(impl, 32, 4)
    x, topk = sbm._stage_args(sb, batch, 2048)
    cache_bytes = sum(c.nbytes for c in jax.tree.leaves(sb.caches))
    layer_bytes = sb.caches["mla"][0].nbytes
    for stage in ("attention_full", "attention_shared"):
        run = sbm.stage_loop(stage, sb)
        mem = run.lower(jnp.int32(9), (x, sb.caches), sb.params, topk, batch).compile().memory_analysis()
        assert mem.alias_size_in_bytes >= cache_bytes, stage
        assert mem.temp_size_in_bytes < layer_bytes / 2, (stage, mem.temp_size_in_bytes, layer_bytes)


@pytest.mark.parametrize("value, needle", [
    ("3", "num_attention_heads (64) is not divisible by tensor_parallel_size (3)"),
    ("8,3", "DCP (3) must divide TP (8)"),
    ("8,x", "give TP or TP,DCP as integers"),
    ("0", "integers >= 1"),
    ("8,1,2", "give TP or TP,DCP"),
])
def test_shard_of_errors_name_the_flag(value, needle):
    with pytest.raises(ValueError, match="--shard-of") as e:
        shard_parallel(value, presets.glm52)
    assert needle in str(e.value)


def test_parse_shard_of():
    assert parse_shard_of("8") == (8, 1)
    assert parse_shard_of(" 8, 8") == (8, 8)
