"""benchmarks/diagnostics: the timing-only forms of the Mosaic sparse MLA kernel (`sparse_mla_forms`, through the
kernel's `Hooks`) lower for CUDA on CPU and leave out what they say they leave out; they are refused where they do
not apply; every diagnostics script imports without starting work and answers --help."""

import dataclasses
import functools
import glob
import os

import jax
import jax.numpy as jnp
import pytest

from benchmarks.diagnostics import sparse_mla_forms
from kernels.sparse_mla import mosaic

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "benchmarks", "diagnostics", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "sparse_mla_forms.py"))

# what each timing-only form leaves in the fp8 producer: (e4m3 conversion, cache row loads)
FP8_FORMS = {"none": (True, True), "no_convert": (False, True), "no_load": (True, False),
             "compute_only": (False, False), "gather_only_no_convert": (False, True),
             "gather_only_no_load": (True, False)}


@pytest.mark.parametrize("form", list(FP8_FORMS))
def test_fp8_timing_forms_lower(form):
    """Each timing-only form of the fp8 producer lowers for CUDA on CPU and leaves out what it says it leaves out:
    the e4m3 conversion (`cvt.rn.f16x2.e4m3x2`) and the 16-byte cache row loads (`ld.global.nc.v4.u32`). Without
    this, a form that still did the work would time the whole kernel under another name."""
    from kernels.common.triton_common import lower_for_gpu
    sd = jax.ShapeDtypeStruct
    share_p = not form.startswith("gather_only")
    text = lower_for_gpu(functools.partial(mosaic.sparse_mla_mosaic, scale=0.0625, kv_lora_rank=512,
                                           hooks=sparse_mla_forms.form(form), share_p=share_p),
                         sd((32, 64, 576), jnp.bfloat16), sd((4096, 656), jnp.uint8), sd((32, 2048), jnp.int32))
    converts, loads = FP8_FORMS[form]
    assert ("cvt.rn.f16x2.e4m3x2" in text) == converts
    assert ("ld.global.nc.v4.u32" in text) == loads


def test_forms_are_refused_where_they_do_not_apply():
    z = jnp.zeros
    bf16 = (z((2, 64, 576), jnp.bfloat16), z((64, 576), jnp.bfloat16), z((2, 64), jnp.int32))
    for name in ("no_load", "compute_only"):
        with pytest.raises(ValueError, match=f"hooks fp8_producer '{sparse_mla_forms.form(name).fp8_producer}' "
                                             "leaves out part of the fp8_ds_mla producer; this cache is bfloat16"):
            mosaic.sparse_mla_mosaic(*bf16, scale=0.1, kv_lora_rank=512, hooks=sparse_mla_forms.form(name))
    for name in ("gather_only", "gather_only_no_load", "gather_only_no_convert"):
        with pytest.raises(ValueError, match="consumers 'idle' needs share_p=False"):
            mosaic.sparse_mla_mosaic(*bf16[:1], z((64, 656), jnp.uint8), bf16[2], scale=0.1, kv_lora_rank=512,
                                     hooks=sparse_mla_forms.form(name), share_p=True)
    with pytest.raises(ValueError, match="Hooks.consumers must be 'full', 'no_mask' or 'idle', got 'fast'"):
        mosaic.Hooks(consumers="fast")
    with pytest.raises(ValueError, match="Hooks.fp8_producer must be"):
        mosaic.Hooks(fp8_producer="half")
    with pytest.raises(ValueError, match="sparse MLA form 'fast' is not one of 'none', 'no_mask'"):
        sparse_mla_forms.form("fast")
    assert mosaic.Hooks() == sparse_mla_forms.form("none")  # the default leaves out nothing


def test_scripts_are_there():
    assert set(SCRIPTS) == {"diag_indexer_parts", "diag_launch_gap", "fp8_gemm_configs", "invariant_xla_audit",
                            "multi_turn_schedule", "probe_indexer_mosaic", "probe_moe_fp8", "probe_sparse_mla_mosaic",
                            "profile_kernels", "row_invariance", "padding_rows_mla"}


def test_fp8_gemm_configs_reads_back_a_printed_log():
    """The launch-config sweep's printed lines become the rows it writes (figures as printed); an invalid config's
    error and estimate come from Fp8GemmConfig and must match the printed ones; --start writes beside --out."""
    from benchmarks.diagnostics import fp8_gemm_configs as fc
    from kernels.fp8_gemm import Fp8GemmConfig
    dims = dict(experts=256, topk=8, hidden=6144, width=2048, tokens=8192)
    log = (f"device NVIDIA H100 80GB HBM3 jax 0.11.2 dims {dims} configs 3\n"
           "[ 1/3] up_fused    tm128 tn256 s3 wgs2 msub1        wall   7.853 ms  420.0 TF/s dev   7.631 gemm   "
           "7.595 ms  434.3 TF/s err rel_fro 1.7e-03 rel_max 2.0e-03 (compile and first run 1.35 s)\n"
           "[ 2/3] up_fused    tm128 tn256 s4 wgs2 msub1        INVALID: repo smem 233536 (over by 1088), mosaic "
           "233536 (over by 1088); Fp8GemmConfig Fp8GemmConfig(tile_m=128, tile_n=256, stages=4, compute_wgs=2, "
           "swap_ab=False, m_sub=1, swiglu=True): 23353\n"
           "[ 3/3] e2e_unfused tm128 tn128 s4 wgs2 msub1        wall   5.199 ms  634.5 TF/s dev   5.248 gemm   "
           "4.485 ms  735.4 TF/s (compile and first run 0.86 s)\n")
    head, rows = fc.rows_from_log(log)
    assert (head["device"], head["jax"], head["dims"]) == ("NVIDIA H100 80GB HBM3", "0.11.2", dims)
    assert [r["status"] for r in rows] == ["ok", "invalid", "ok"]
    assert rows[0]["config"]["swiglu"] and not rows[2]["config"]["swiglu"]
    assert (rows[0]["gemm_ms"], rows[0]["tflops_gemm"], rows[0]["check"]["rel_fro"]) == (7.595, 434.3, 1.7e-3)
    assert (rows[1]["over_repo"], rows[1]["over_mosaic"]) == (1088, 1088)
    assert rows[1]["error"].endswith("233536 bytes of shared memory, over 232448")
    assert "check" not in rows[2] and rows[2]["N"] == 4096
    assert not any(r["config"]["chain"] for r in rows)
    _, chained = fc.rows_from_log(log.replace("tm128 tn128 s4 wgs2 msub1       ", "tm128 tn128 s4 wgs2 msub1 chain"))
    assert [r["config"]["chain"] for r in chained] == [False, False, True]
    assert fc.short(Fp8GemmConfig(chain=True)).endswith(" chain")
    with pytest.raises(ValueError, match="not this commit's"):
        fc.rows_from_log(log.replace("repo smem 233536", "repo smem 233472"))
    assert fc.output_path("r/x.json", 1) == "r/x.json" and fc.output_path("r/x.json", 12) == "r/x_from12.json"


def test_row_invariance_names_the_first_op_a_changed_row_reaches(monkeypatch):
    """The row-count diagnostic on the tiny preset: the same T twice is bitwise equal everywhere; a target row whose
    token differs at one T (as a row-count-dependent op would make it differ) is reported there, its logits unequal
    and every layer's first difference the first traced op (layer 0: the q latent, computed from the token)."""
    import jax

    from benchmarks.diagnostics import row_invariance as ri
    from glm_dsa import configs
    from glm_dsa.model.options import StepOptions
    from glm_dsa.model.paged_cache import allocate_caches, cache_dtype, pages_needed
    from glm_dsa.model.random_init import init_params
    from glm_dsa.serving.benchmark import random_caches
    cfg = configs.tiny
    params = init_params(cfg, seed=0, dtype="float32")
    caches = allocate_caches(cfg, 1 + 16 * pages_needed(48, 16, 1), 16, cache_dtype("auto", jax.numpy.float32))
    caches = random_caches(cfg, caches, jax.random.key(1))
    kw = dict(cfg=cfg, params=params, caches=caches, block_size=16, context=48,
              options=StepOptions(impl="xla", batch_invariant=True), log=lambda *_: None)
    same = ri.compare([8, 8], **kw)
    assert [(r["logits_equal"], r["first_difference"]) for r in same] == [(True, {}), (True, {})]
    target = ri.target_batch

    def other_token_at_16(t, *a):
        b = target(t, *a)
        return b if t != 16 else dataclasses.replace(b, token_ids=b.token_ids.at[0].set(2))
    monkeypatch.setattr(ri, "target_batch", other_token_at_16)
    got = ri.compare([8, 16], **kw)
    assert got[0]["logits_equal"] and not got[1]["logits_equal"] and got[1]["logits_max_abs_diff"] > 0
    assert got[1]["first_difference"]["0"] == "attn.q_norm"
    assert set(got[1]["first_difference"]) == {str(i) for i in range(cfg.num_hidden_layers)}


def test_multi_turn_schedule_hits_the_pages_a_turn_repeats():
    """The scheduler-only multi-turn run finds, by hand's page arithmetic, the shared system prompt's whole pages for
    every conversation but the first, and for each later turn the whole pages of the previous prompt and the answer
    tokens computed (the answer's last token is sampled, never fed back); no hits without caching; and under a cost
    that grows with a step's rows a hit's turn waits less."""
    from benchmarks.bench_serving import MultiTurnConfig
    from benchmarks.diagnostics.multi_turn_schedule import simulate
    n, turns, S, U, O, B = 6, 3, 256, 24, 40, 16
    mc = MultiTurnConfig(conversations=n, turns=turns, system_len=S, user_len=U, output_len=O, request_rate=50.0,
                         block_size=B, max_num_seqs=8, max_num_batched_tokens=512, num_pages=400)
    on, off = (simulate(mc, 1000, caching, 8.0, 4.0) for caching in (True, False))
    prompts = [S + U + k * (U + O) for k in range(turns)]
    want = (n - 1) * min((S + U - 1) // B, S // B) * B + n * sum((p + O - 1) // B * B for p in prompts[:-1])
    assert (on["prefix_cache_hits"], on["prefix_cache_queries"]) == (want, n * sum(prompts))
    assert (off["prefix_cache_hits"], off["prefix_cache_queries"]) == (0, 0)
    assert on["turns"] == off["turns"] == n * turns
    assert on["ttft_ms_p50"] < off["ttft_ms_p50"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_from_main(name, capsys):
    mod = __import__(f"benchmarks.diagnostics.{name}", fromlist=["main"])
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
