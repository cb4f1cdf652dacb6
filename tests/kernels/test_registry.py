"""One dispatch rule (kernels/registry.py): every op registers the same impls; an unknown impl or an impl that
does not support the inputs raises, naming the op and what is available or the constraint; "triton_interpret"
is the "triton" function with interpret=True; the xla path imports no Triton module; kernels/ has no import
cycle and no module imports a sibling's private names. Per op, the shapes a kernel refuses are tested in its
module (test_moe's narrow widths also show the MoE kernel runs where it used to fall back to xla)."""

import ast
import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import kernels
from kernels import fused_norm_rope, indexer, moe, registry, sparse_mla
from kernels.indexer.config import TopkConfig

OPS = ("fused_norm_rope", "indexer", "sparse_mla", "moe")
KERNELS_DIR = pathlib.Path(kernels.__file__).parent


def _calls():
    """Each op's public entry point on tiny valid inputs, as a function of impl."""
    z = functools.partial(jnp.zeros, dtype=jnp.float32)
    return {
        "sparse_mla": lambda impl: sparse_mla.sparse_mla(z((2, 4, 48)), z((8, 48)), jnp.zeros((2, 4), jnp.int32),
                                                         scale=0.1, kv_lora_rank=32, impl=impl),
        "indexer": lambda impl: indexer.indexer_topk(z((2, 16, 16)), z((2, 16)), z((32, 16)),
                                                     jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32),
                                                     jnp.zeros((1, 2), jnp.int32), block_size=16, topk=4, impl=impl),
        "moe": lambda impl: moe.routed_experts(z((2, 16)), jnp.zeros((2, 1), jnp.int32), z((2, 1)), z((2, 16, 16)),
                                               z((2, 16, 16)), z((2, 16, 16)), impl=impl),
        "fused_norm_rope": lambda impl: fused_norm_rope.fused_norm_rope_cache(
            z((2, 16)), z((2, 48)), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), z((16,)), z((32,)),
            z((8, 48)), rope_theta=1e4, impl=impl),
    }


MOSAIC_OPS = ("sparse_mla", "indexer", "moe")  # ops with a Pallas Mosaic GPU kernel


def test_every_op_registers_the_same_impls():
    """Every op takes kernels.IMPLS (so a step can name one impl for all of them); an op with a Mosaic GPU kernel
    adds "mosaic" and "mosaic_interpret", and nothing else."""
    assert set(OPS) <= set(registry.ops())
    for op in OPS:
        extra = ("mosaic", "mosaic_interpret") if op in MOSAIC_OPS else ()
        assert registry.impls(op) == kernels.IMPLS + extra, op
    assert kernels.default_impl() in kernels.IMPLS


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", ["cuda", "Triton", "interpret"])
def test_unknown_impl_raises_naming_op_and_impls(op, bad):
    with pytest.raises(ValueError, match=f"{op}: unknown impl '{bad}' \\(available: 'xla', 'triton', "
                                         "'triton_interpret', 'auto'"):
        _calls()[op](bad)


@pytest.mark.parametrize("op", OPS)
def test_auto_is_the_xla_oracle_off_the_gpu(op):
    """Off the GPU, "auto" resolves to "xla" for every op, and dispatching it gives the xla result."""
    assert kernels.default_impl() == "xla"
    out_auto, out_xla = _calls()[op]("auto"), _calls()[op]("xla")
    for a, b in zip(jax.tree.leaves(out_auto), jax.tree.leaves(out_xla)):
        assert jnp.array_equal(a, b), op


def test_auto_rule_must_name_a_registered_impl(monkeypatch):
    monkeypatch.setitem(registry._OPS, "toy", {})
    registry.register("toy", "xla", lambda x: x)
    monkeypatch.setitem(registry._RULES, "toy.auto", registry.Rule("toy.auto", "toy", lambda platform, x: "fast"))
    registry.register("toy", "auto", registry._auto_placeholder)
    with pytest.raises(AssertionError, match="toy: the rule 'toy.auto' chose 'fast', which is not one of 'xla'"):
        registry.dispatch("toy", "auto", 1)
    monkeypatch.setitem(registry._RULES, "toy.auto", registry.Rule("toy.auto", "toy", lambda platform, x: "xla"))
    assert registry.dispatch("toy", "auto", 3) == 3


def test_rules_take_the_platform_and_are_recorded():
    """A rule decides for the platform `deciding_for` names (not the backend it runs on), and `record` keeps every
    decision with the shapes it was asked about."""
    sds = jax.ShapeDtypeStruct  # rules read shapes and dtypes only
    q, cache, idx = sds((4, 64, 576), jnp.bfloat16), sds((64, 576), jnp.bfloat16), sds((4, 2048), jnp.int32)
    with registry.record() as log:
        assert registry.resolve("sparse_mla", "auto", q, cache, idx, scale=0.1, kv_lora_rank=512) == "xla"
        with registry.deciding_for("gpu"):
            assert kernels.default_impl() == "auto"
            assert registry.resolve("sparse_mla", "auto", q, cache, idx, scale=0.1, kv_lora_rank=512) == "mosaic"
            assert registry.resolve("sparse_mla", "auto", q, cache, idx, scale=0.1, kv_lora_rank=512,
                                    block_k=32) == "triton"  # Triton launch options name the Triton kernel
    assert [(d.rule, d.choice, d.platform) for d in log] == [
        ("sparse_mla.auto", "xla", "cpu"), ("sparse_mla.auto", "mosaic", "gpu"), ("sparse_mla.auto", "triton", "gpu")]
    assert log[0].shapes == (((4, 64, 576), "bfloat16"), ((64, 576), "bfloat16"), ((4, 2048), "int32"))
    with pytest.raises(ValueError, match="platform 'tpu' must be 'gpu' or 'cpu'"):
        with registry.deciding_for("tpu"):
            pass
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        registry.decide("nope")


def test_every_choice_is_a_registered_rule():
    """The rules the package registers, one per choice (a new choice made elsewhere is a new rule here)."""
    assert {r.name for r in registry.rules()} == {
        "cache_offsets", "fp8_linear.auto", "fp8_linear.model_form", "fp8_linear.mosaic_layout",
        "fused_norm_rope.auto", "indexer.auto", "indexer.scores_form", "launch_rows", "lse_merge.auto", "moe.auto",
        "moe.fp8_form", "moe.mosaic_layout", "moe.xla_form", "sparse_mla.auto", "topk.auto"}
    assert all(r.summary for r in registry.rules())  # each says what it picks (info --kernels prints it)
    with registry.deciding_for("gpu"):
        assert registry.decide("cache_offsets", impl="auto") == "int32"
    assert registry.decide("cache_offsets", impl="auto") == "int64"  # "auto" is xla off the GPU
    assert registry.decide("cache_offsets", impl="triton") == "int32"


GLM_MOE = (8, 256, 6144, 2048, 0)  # GLM-5.2's k, experts, hidden and expert width (TP = 1), offset 0


def _rule_choices(invariant: bool, step_rows: int | None, op_rows, requests=(1, 4, 32, 256, 1024)) -> dict:
    """{rule: set of choices} over ops of `op_rows` rows (and block tables of `requests` rows), decided for a GPU
    in a step of `step_rows` rows (batch-invariant when `invariant`)."""
    out = {}
    k, n_exp, d, i, off = GLM_MOE
    with registry.deciding_for("gpu"), registry.batch_invariant(invariant, rows=step_rows):
        for t in op_rows:
            out.setdefault("moe.xla_form", set()).add(registry.decide("moe.xla_form", t, k, n_exp))
            out.setdefault("moe.fp8_form", set()).add(registry.decide("moe.fp8_form", t, k, n_exp, d, i, off,
                                                                      w_layout="nk"))
            out.setdefault("moe.mosaic_layout", set()).add(registry.decide("moe.mosaic_layout", t, k, n_exp))
            for r in requests:
                out.setdefault("indexer.scores_form", set()).add(registry.decide("indexer.scores_form", t, r, False))
            x = jax.ShapeDtypeStruct((t, 7168), jnp.bfloat16)
            out.setdefault("fp8_linear.model_form", set()).add(registry.decide("fp8_linear.model_form", x,
                                                                               impl="auto"))
            scores = jax.ShapeDtypeStruct((t, 32768), jnp.float32)  # as the indexer asks: one-pass config
            out.setdefault("topk.auto", set()).add(registry.decide("topk.auto", scores, None, 2048, 32768,
                                                                   config=TopkConfig(chunks=1)))
            o, lse = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, t, 64, 512), (2, t, 64)))
            out.setdefault("lse_merge.auto", set()).add(registry.decide("lse_merge.auto", o, lse))
            out.setdefault("fp8_linear.mosaic_layout", set()).add(registry.decide("fp8_linear.mosaic_layout", t))
            out.setdefault("config_rows", set()).add(registry.config_rows(t))
    return out


def test_batch_invariant_decode_steps_choose_alike_for_every_row_count():
    """In batch-invariant mode a decode step (fewer rows than the prompt steps', or no step rows given) takes one
    choice per rule whatever the rows an op is asked about (1 to 8192, on a GPU, where the default rules switch by
    rows) and whatever the requests, with the kernels' launch configs chosen for one row count; outside the mode
    the default rules do switch (the comparison can fail)."""
    rows = (1, 16, 64, 512, 8192)
    for step_rows in (None, 1, registry.INVARIANT_STEP_ROWS, registry.INVARIANT_PROMPT_ROWS - 1):
        got = _rule_choices(True, step_rows, rows)
        assert {r: c for r, c in got.items() if r != "config_rows"} == {
            "moe.xla_form": {"gather"}, "moe.fp8_form": {"w8a8"}, "moe.mosaic_layout": {"swap_ab"},
            "indexer.scores_form": {"per_row"}, "fp8_linear.model_form": {"fp8_linear"},
            "fp8_linear.mosaic_layout": {"swap_ab"}, "topk.auto": {"triton"},
            "lse_merge.auto": {"xla"}}, step_rows
        assert got["config_rows"] == {registry.INVARIANT_CONFIG_ROWS}
    default = _rule_choices(False, None, rows)
    assert all(len(v) > 1 for r, v in default.items() if r != "lse_merge.auto"), default
    assert not registry.batch_invariant_mode()  # the mode ends with its block
    with pytest.raises(ValueError, match="invariant"):
        registry.register_rule("test.unsaid", "test", lambda platform: "a", ("a",), invariant="sometimes")
    with pytest.raises(ValueError, match="must say what batch-invariant mode runs"):
        registry.register_auto("test_op_unsaid", lambda platform: "xla")
    with pytest.raises(ValueError, match="ROW_FREE rule decides alike"):
        registry.register_rule("test.free", "test", lambda platform: "a", ("a",), invariant=registry.ROW_FREE,
                               invariant_prompt=registry.DEFAULT)
    with pytest.raises(ValueError, match="invariant_prompt must be"):
        registry.register_rule("test.prompt", "test", lambda platform: "a", ("a",), invariant=lambda p: "a",
                               invariant_prompt="sometimes")


def test_batch_invariant_prompt_steps_take_the_prefill_forms():
    """A step of at least the prompt rows (`registry.INVARIANT_PROMPT_ROWS` or the `prompt_rows` given: the step's
    static padded rows name its kind, never its data) takes the default mode's prefill choices at the same shapes
    (GLM-5.2's MoE at 8192 rows on a GPU: 128-row tiles, "w8a8_mosaic"; the FP8 linears "w8a8_mosaic" too; the
    select top-k; launch
    configs for the op's rows), except the xla MoE form (always "gather") and the indexer's scores, which take the
    row-block kernel from ROW_BLOCK_MIN_T rows whatever the requests (the mode's block tables have max_num_seqs'
    rows). Each rule's choice in a prompt step is a function of the shapes it is asked about only."""
    t = registry.INVARIANT_PROMPT_ROWS
    prompt = _rule_choices(True, t, (t,))
    assert prompt == {
        "moe.xla_form": {"gather"}, "moe.fp8_form": {"w8a8_mosaic"}, "moe.mosaic_layout": {"grouped"},
        "indexer.scores_form": {"row_block"}, "fp8_linear.model_form": {"w8a8_mosaic"},
        "fp8_linear.mosaic_layout": {"grouped"}, "topk.auto": {"triton"}, "lse_merge.auto": {"triton"},
        "config_rows": {t}}
    # the default mode at 8192 rows: the same, but its xla form and its scores form for many requests
    default = _rule_choices(False, None, (t,))
    assert {r: c for r, c in default.items() if r not in ("moe.xla_form", "indexer.scores_form")} == {
        r: c for r, c in prompt.items() if r not in ("moe.xla_form", "indexer.scores_form")}
    assert default["moe.xla_form"] == {"tiles"} and default["indexer.scores_form"] == {"row_block", "per_row"}
    # the indexer's scores run on static row chunks of the step: the chunk's rows decide, the requests never
    chunks = _rule_choices(True, t, (16, 63, 64, 1024))
    assert chunks["indexer.scores_form"] == {"per_row", "row_block"}
    for rows, form in ((63, "per_row"), (64, "row_block"), (1024, "row_block")):
        assert _rule_choices(True, t, (rows,))["indexer.scores_form"] == {form}
    with registry.deciding_for("gpu"), registry.batch_invariant(rows=t):
        assert registry.decide("indexer.scores_form", 1024, 256, True) == "per_row"  # float32 caches, as default
    # the kind is the step's rows against the prompt rows: a tiny engine's prompt steps of 64 rows take the same
    with registry.deciding_for("gpu"), registry.batch_invariant(rows=64, prompt_rows=64), registry.record() as log:
        assert registry.invariant_step_kind() == "prompt"
        assert registry.decide("moe.fp8_form", 8192, *GLM_MOE, w_layout="nk") == "w8a8_mosaic"
        assert registry.config_rows(100) == 100
    with registry.batch_invariant(rows=63, prompt_rows=64):
        assert registry.invariant_step_kind() == "decode"
        assert registry.config_rows(100) == registry.INVARIANT_CONFIG_ROWS
    assert [(d.rule, d.choice, d.batch_invariant, d.step_kind) for d in log] == [
        ("moe.fp8_form", "w8a8_mosaic", True, "prompt"), ("launch_rows", "rows", True, "prompt")]
    assert registry.invariant_step_kind() is None
    assert [registry.step_kind(r) for r in (None, 256, 8191, 8192, 65536)] == [
        "decode", "decode", "decode", "prompt", "prompt"]
    # every rule that reads the rows says what prompt steps take: DEFAULT, a function, or None (the decode choice)
    said = {r.name: r.invariant_prompt for r in registry.rules() if r.invariant != registry.ROW_FREE}
    assert {n for n, v in said.items() if v == registry.DEFAULT} == {
        "launch_rows", "moe.fp8_form", "moe.mosaic_layout", "fp8_linear.model_form", "fp8_linear.mosaic_layout",
        "topk.auto", "lse_merge.auto"}
    assert {n for n, v in said.items() if v is None} == {"moe.xla_form", "indexer.auto"}
    assert callable(said["indexer.scores_form"])


def test_unknown_impl_raises_even_when_moe_mode_forces_xla():
    x = jnp.zeros((2, 16))
    with pytest.raises(ValueError, match="moe: unknown impl 'cutlass'"):
        moe.routed_experts(x, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)), jnp.zeros((2, 16, 16)),
                           jnp.zeros((2, 16, 16)), jnp.zeros((2, 16, 16)), impl="cutlass", mode="dense")


def test_unknown_op_raises():
    with pytest.raises(ValueError, match="registry: unknown op 'attention'"):
        registry.dispatch("attention", "xla")


def test_interpret_means_the_same_function_interpreted():
    pairs = ([(op, "triton") for op in OPS] + [(op, "mosaic") for op in MOSAIC_OPS]
             + [("fp8_linear", "triton"), ("fp8_linear", "mosaic"), ("fp8_swiglu", "mosaic")])
    for op, kind in pairs:
        native, interp = registry.get(op, kind).function(), registry.get(op, f"{kind}_interpret").function()
        assert isinstance(native, functools.partial) and isinstance(interp, functools.partial)
        assert native.func is interp.func, op  # the same kernel function
        assert native.keywords == {"interpret": False} and interp.keywords == {"interpret": True}, op
        assert registry.get(op, "xla").interpret is None


def test_unsupported_inputs_raise_naming_the_constraint(monkeypatch):
    """A toy op: the supports check runs before the impl, and its reason is in the error; no fallback runs."""
    monkeypatch.setitem(registry._OPS, "toy", {})
    ran = []
    registry.register("toy", "xla", lambda x: ran.append("xla") or x)
    registry.register("toy", "fast", lambda x: ran.append("fast") or x,
                      supports=lambda x: None if x % 16 == 0 else f"width {x} must be a multiple of 16")
    assert registry.dispatch("toy", "fast", 32) == 32 and ran == ["fast"]
    with pytest.raises(ValueError, match="toy: impl 'fast' does not support these inputs: width 8 must be a multiple"):
        registry.dispatch("toy", "fast", 8)
    assert ran == ["fast"]  # neither impl ran for the refused call
    with pytest.raises(ValueError, match="already has an impl 'fast'"):
        registry.register("toy", "fast", lambda x: x)


def test_xla_dispatch_imports_no_triton_module():
    """Dispatching to "xla" stays cheap: no kernels.*_triton module (nor Pallas Triton through them) is imported."""
    code = ("import sys, jax.numpy as jnp; from kernels import moe; "
            "moe.routed_experts(jnp.ones((2, 16)), jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)), "
            "jnp.ones((2, 16, 16)), jnp.ones((2, 16, 16)), jnp.ones((2, 16, 16)), impl='xla'); "
            "print(sorted(m for m in sys.modules if m.startswith('kernels.') and 'triton' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=KERNELS_DIR.parent, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(KERNELS_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _intra_imports():
    """{module: [(imported module, names)]} over every module under kernels/ (dotted names), every relative or
    `kernels.` import at any depth (function-level imports too); `from pkg import sub` counts as importing the
    module pkg.sub."""
    files = {_module_name(p): p for p in KERNELS_DIR.rglob("*.py")}
    edges = {m: [] for m in files}
    for m, path in files.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("kernels"):
                mod = node.module
            else:
                continue
            for a in node.names:
                if f"{mod}.{a.name}" in files:
                    edges[m].append((f"{mod}.{a.name}", []))
                else:
                    edges[m].append((mod, [a.name]))
    return edges


def test_no_private_imports_and_no_cycles():
    edges = _intra_imports()
    private = [(m, t, n) for m, es in edges.items() for t, names in es for n in names if n.startswith("_")]
    assert not private, private
    graph = {m: {t for t, _ in es if t in edges} for m, es in edges.items() if m != "kernels"}
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            visit(t, path + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])
    kernel_modules = [m for m in graph if m.endswith(".triton")]
    assert len(kernel_modules) == 6, kernel_modules
    for m in kernel_modules:  # a kernel module imports no other op's kernel module (shared helpers: kernels.common)
        assert not {t for t in graph[m] if t.endswith("triton") and t != m}, (m, graph[m])
    assert "kernels.moe.triton" not in graph["kernels.moe"]  # the op imports its kernel on first use only


def test_no_settings_in_module_globals():
    """The old top-k switch (a module global read at call time) is gone; the radix select with it."""
    assert not hasattr(indexer, "TOPK_IMPL")
    from kernels.indexer import triton as indexer_triton
    assert not hasattr(indexer_triton, "topk_triton")
    assert not hasattr(sparse_mla, "MOSAIC_MIN_ROWS")  # a threshold of one row: the rule says "from one row"


def test_takes_is_check_passing():
    """`registry.takes`: True where `check` passes, False where the impl's `supports` names a constraint or the
    impl does not exist (what the "auto" rules ask before picking a kernel)."""
    o, lse = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 4, 8, 16), (2, 4, 8)))
    assert registry.takes("lse_merge", "triton", o, lse)
    bad = jax.ShapeDtypeStruct((2, 4, 9), jnp.float32)  # lse's heads differ from o's
    assert not registry.takes("lse_merge", "triton", o, bad)
    with pytest.raises(ValueError, match="does not support"):
        registry.check("lse_merge", "triton", o, bad)
    assert not registry.takes("lse_merge", "no_such_impl", o, lse)
