"""`python -m benchmarks suite` and `render`: the flags' errors name what is wrong, the suite runs each area as a
process under its timeout and goes on past failures, `--out` writes one tarball, a smoke run of a real area writes a
results file in the schema, and BENCHMARKS.md / README.md are rendered from the committed results."""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from benchmarks import render, suite
from benchmarks.__main__ import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the row keys DESIGN.md (Benchmarks) gives each results file
ROW_KEYS = {
    "attention": {"op", "cache", "impl", "device_us", "us", "xla_device_us", "tb_s"},
    "moe": {"op", "weights", "rows", "tp", "impl", "device_us", "tflops", "hbm_fraction"},
    "e2e": {"preset", "weights", "batch_invariant", "prefill_s", "prefill_mfu", "decode_ms"},
}


def check_schema(rec: dict, area: str) -> None:
    """A results file as DESIGN.md writes it: the head keys first, then rows with the area's keys."""
    assert list(rec)[:6] == ["date", "commit", "device", "jax", "command", "rows"], list(rec)
    assert all(isinstance(rec[k], str) for k in ("date", "device", "jax", "command"))
    assert rec["rows"], f"{area}: no rows"
    for row in rec["rows"]:
        assert ROW_KEYS.get(area, set()) <= set(row), (area, sorted(ROW_KEYS[area] - set(row)))
        assert area != "attention" or row["op"] in ("sparse_mla", "indexer", "fused_norm_rope")
        assert area != "moe" or row["op"] in ("moe_prefill", "moe_decode", "fp8_linear")
        assert area != "moe" or row["weights"] in ("bf16", "fp8")
    sources = rec.get("sources")
    if sources:  # a file put together from several runs: each row names its run
        assert all(0 <= i < len(sources) for r in rec["rows"]  # an index, or a list of them (a row of several runs)
                   for i in (r["source"] if isinstance(r["source"], list) else [r["source"]]))
        assert all({"date", "commit", "device", "jax", "command"} <= set(s) for s in sources)


# ---------------------------------------------------------------------------------------------------------------
# flags


def test_unknown_area_is_named(capsys):
    with pytest.raises(SystemExit, match=r"unknown area 'bogus' \(areas: attention, moe, e2e, serving, mtp, dcp"):
        main(["suite", "--only", "e2e,bogus"])
    with pytest.raises(SystemExit, match="--only: unknown area"):
        main(["suite", "--only", ","])


def test_a_bad_timeout_names_its_flag(capsys):
    with pytest.raises(SystemExit, match="--timeout-moe must be a number of seconds > 0, got 0.0"):
        main(["suite", "--only", "moe", "--timeout-moe", "0"])
    with pytest.raises(SystemExit):
        main(["suite", "--timeout-e2e", "soon"])
    assert "--timeout-e2e: invalid float value: 'soon'" in capsys.readouterr().err


def test_every_area_has_a_timeout_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["suite", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"--timeout-{name}" in out for name in suite.AREAS)


# ---------------------------------------------------------------------------------------------------------------
# the suite's loop, on stand-in areas

_FAKE_AREA = """
import json, os, sys, time
name, results = sys.argv[1], sys.argv[3]
print("area", name, "smoke" if "--smoke" in sys.argv else "full", flush=True)
if name == "slow":
    time.sleep(60)
if name == "broken":
    sys.exit(3)
if name == "needs2":
    print("needs2: skipped: needs 2 devices, found 1", flush=True)
    sys.exit(75)
os.makedirs(results, exist_ok=True)
json.dump({"date": "2026-12-06", "commit": "abc", "device": "cpu", "jax": "0", "command": "x", "rows": [{"a": 1}]},
          open(os.path.join(results, name + ".json"), "w"))
"""


@pytest.fixture
def fake_areas(tmp_path, monkeypatch):
    script = tmp_path / "fake_area.py"
    script.write_text(_FAKE_AREA)
    monkeypatch.setattr(suite, "AREA_COMMAND", (sys.executable, str(script)))
    names = ("good", "broken", "slow", "needs2", "good2")
    monkeypatch.setattr(suite, "AREAS", {n: suite.Area(n, f"stand-in {n}", 30, None) for n in names})
    return names


def test_the_suite_goes_on_past_failures_and_timeouts(fake_areas, tmp_path, capsys):
    """Each area in its process: a failing and a timed-out area are reported and the next area still runs; a skip
    is a line, not a failure; the exit code is 1; --out holds every file the run wrote."""
    results, out = tmp_path / "results", tmp_path / "out"
    rc = main(["suite", "--results", str(results), "--out", str(out), "--timeout-slow", "2"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "suite: broken: failed" in text and "exit code 3" in text
    assert "suite: slow: timeout" in text and "--timeout-slow 2" in text
    assert "suite: needs2: skipped in" in text and "needs 2 devices, found 1" in text
    assert "suite: good2: ok" in text and "1 rows" in text
    assert sorted(p.name for p in results.iterdir()) == ["good.json", "good2.json"]
    (tar_path,) = out.iterdir()
    assert tar_path.name.endswith(".tar.gz")
    with tarfile.open(tar_path) as tar:
        names = sorted(tar.getnames())
    assert names == sorted(["results/good.json", "results/good2.json"] + [f"logs/{n}.log" for n in fake_areas])


def test_all_areas_ok_is_exit_0_and_smoke_is_passed_on(fake_areas, tmp_path, capsys):
    results = tmp_path / "r"
    assert main(["suite", "--only", "good,needs2", "--smoke", "--results", str(results)]) == 0
    assert "suite: good: ok" in capsys.readouterr().out
    assert json.loads((results / "good.json").read_text())["rows"] == [{"a": 1}]


def test_a_smoke_run_never_writes_the_committed_results(fake_areas, capsys):
    before = sorted(os.listdir(suite.RESULTS))
    assert main(["suite", "--only", "good", "--smoke"]) == 0
    assert "results in " in capsys.readouterr().out
    assert sorted(os.listdir(suite.RESULTS)) == before


# ---------------------------------------------------------------------------------------------------------------
# the area runners


def test_a_cpu_smoke_run_of_the_e2e_area(tmp_path):
    """The e2e area for real, tiny preset on CPU, through the suite's own process: a schema-valid e2e.json with a
    bf16 row and two FP8 rows, one per prompt-step form of the experts; the first two with their decode batches,
    the second FP8 run prefill alone. The kernel switch it sets for a run is gone after it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "suite", "--only", "e2e", "--smoke", "--results",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "e2e.json").read_text())
    check_schema(rec, "e2e")
    assert rec["command"] == "python -m benchmarks suite --only e2e --smoke"
    assert [(r["weights"], r.get("fp8_experts_prefill"), r.get("fp8_linears_prefill")) for r in rec["rows"]] == \
        [("bf16", None, None), ("fp8", "dequant", "dequant"), ("fp8", "w8a8_mosaic", "w8a8_mosaic")]
    for row in rec["rows"]:
        assert row["preset"] == "tiny" and row["prefill_s"] > 0
    # MFU of FP8-weight runs also against the FP8 peak (the H200's 1979 TFLOP/s, twice bf16's 989)
    assert "prefill_mfu_fp8_peak" not in rec["rows"][0]
    for row in rec["rows"][1:]:
        assert row["prefill_mfu_fp8_peak"] == pytest.approx(row["prefill_mfu"] * 989 / 1979)
    for row in rec["rows"][:2]:
        assert set(row["decode_ms"]) == {"1"} and all(ms > 0 for ms in row["decode_ms"].values())
    assert rec["rows"][2]["decode_ms"] == {}


def test_the_e2e_area_sets_the_experts_switch_for_each_fp8_run(monkeypatch):
    """Each FP8 run of the e2e area traces its steps under its own GLM_DSA_MOE_MOSAIC and GLM_DSA_FP8_LINEAR_MOSAIC
    values, and the variables are as before afterwards (set or unset)."""
    from kernels import fp8_linear, moe
    from glm_dsa.serving import benchmark
    seen = []
    monkeypatch.delenv(fp8_linear.MOSAIC_ENV, raising=False)

    def fake_run_bench(cfg):
        assert os.environ.get(fp8_linear.MOSAIC_ENV) == os.environ.get(moe.MOSAIC_ENV) or cfg.quantization is None
        seen.append((cfg.quantization, os.environ.get(moe.MOSAIC_ENV), cfg.decode_batches))
        return {"impls": {"auto": {"prefill_s": 1.0, "decode": {}}}, "layers": 2,
                "config": {"preset": "tiny", "kv_cache_dtype": "auto", "input_len": 16, "batch": 1,
                           "decode_context": None}}

    monkeypatch.setattr(benchmark, "run_bench", fake_run_bench)
    for before in (None, "decode"):
        if before is None:
            monkeypatch.delenv(moe.MOSAIC_ENV, raising=False)
        else:
            monkeypatch.setenv(moe.MOSAIC_ENV, before)
        seen.clear()
        rows, _ = suite.run_e2e(True, "")
        assert seen == [(None, before, (1,)), ("fp8", "none", (1,)), ("fp8", "prefill", ())]
        assert [r.get("fp8_experts_prefill") for r in rows] == [None, "dequant", "w8a8_mosaic"]
        assert [r.get("fp8_linears_prefill") for r in rows] == [None, "dequant", "w8a8_mosaic"]
        assert os.environ.get(moe.MOSAIC_ENV) == before and fp8_linear.MOSAIC_ENV not in os.environ


def test_the_e2e_area_runs_glm52_where_the_device_holds_it(monkeypatch):
    """Beyond the smoke run: the bench preset's three runs, then 8 full-width GLM-5.2 layers with FP8 weights and
    the fp8_ds_mla cache where the allocator has 95 GB free, else a line saying what was not run and why."""
    from glm_dsa.model import loading
    from glm_dsa.serving import benchmark
    from kernels import fp8_linear, moe
    monkeypatch.delenv(moe.MOSAIC_ENV, raising=False)
    monkeypatch.delenv(fp8_linear.MOSAIC_ENV, raising=False)
    seen = []

    def fake_run_bench(cfg):
        seen.append((cfg.preset, cfg.num_layers, cfg.quantization, cfg.kv_cache_dtype))
        return {"impls": {"auto": {"prefill_s": 1.0, "decode": {}}}, "layers": cfg.num_layers or 4,
                "config": {"preset": cfg.preset, "kv_cache_dtype": cfg.kv_cache_dtype, "input_len": cfg.input_len,
                           "batch": cfg.batch, "decode_context": cfg.decode_context}}

    monkeypatch.setattr(benchmark, "run_bench", fake_run_bench)
    bench = [("bench", None, None, "auto"), ("bench", None, "fp8", "auto"), ("bench", None, "fp8", "auto")]
    monkeypatch.setattr(loading, "device_free_bytes", lambda: 80e9)
    rows, extra = suite.run_e2e(False, "")
    assert seen == bench and len(rows) == 3
    assert extra["glm52_skipped"] == ("glm52, 8 layers, FP8: not run, it needs 95 GB of device memory and the "
                                      "allocator has 80 GB free")
    seen.clear()
    monkeypatch.setattr(loading, "device_free_bytes", lambda: 104e9)
    rows, extra = suite.run_e2e(False, "")
    assert seen == bench + [("glm52", 8, "fp8", "fp8_ds_mla")] and "glm52_skipped" not in extra
    assert (rows[-1]["preset"], rows[-1]["layers"], rows[-1]["weights"], rows[-1]["kv_cache"]) == \
        ("glm52", 8, "fp8", "fp8_ds_mla")
    assert rows[-1]["fp8_experts_prefill"] == rows[-1]["fp8_linears_prefill"] == "w8a8_mosaic"  # the defaults


def test_moe_rows_from_the_fp8_gemm_bench():
    """bench_fp8_gemm's rows (every form's figures in one row) become one moe.json row per (weights, form, impl)."""
    fig = lambda us, f: {"us": us, "tflops": f, "pct_hbm": 50.0, "tb_s": 2.4}  # noqa: E731
    linear = {"op": "linear", "name": "o_proj", "N": 6144, "K": 2048, "T": 32, "bf16_xla": fig(10.0, 1.0),
              "w8a16": {**fig(8.0, 2.0), "speedup_vs_bf16": 1.25, "config": "default"},
              "xla_fp8_w8a16": fig(30.0, 0.5)}
    experts = {"op": "moe", "T": 8192, "experts_used": 256, "dims": [64, 32, 8], "bf16": fig(100.0, 9.0),
               "w8a8": {**fig(80.0, 11.0), "speedup_vs_bf16": 1.25, "config": "default"}}
    rows = suite.moe_rows([linear, experts], impl="triton")
    got = [(r["op"], r["weights"], r.get("form"), r["rows"], r["tp"], r["impl"], r["device_us"]) for r in rows]
    assert got == [("fp8_linear", "bf16", None, 32, 8, "xla", 10.0), ("fp8_linear", "fp8", "w8a16", 32, 8, "triton", 8.0),
                   ("fp8_linear", "fp8", "w8a16", 32, 8, "xla", 30.0),
                   ("moe_prefill", "bf16", None, 8192, 1, "triton", 100.0),
                   ("moe_prefill", "fp8", "w8a8", 8192, 1, "triton", 80.0)]
    assert all(r["hbm_fraction"] == 0.5 for r in rows)
    check_schema({"date": "d", "commit": "c", "device": "x", "jax": "j", "command": "c", "rows": rows}, "moe")


# ---------------------------------------------------------------------------------------------------------------
def test_moe_rows_from_the_mosaic_bench():
    """bench_fp8_gemm_mosaic's rows go to moe.json as they are, the experts' (up, down) configs as one label; its
    grouped-GEMM detail rows become fp8_grouped_gemm rows named by GEMM; its other detail rows stay out."""
    up = {"tile_m": 128, "tile_n": 256, "stages": 2, "compute_wgs": 2, "swap_ab": False, "m_sub": 1, "swiglu": True}
    down = {"tile_m": 16, "tile_n": 128, "stages": 6, "compute_wgs": 2, "swap_ab": True, "m_sub": 1, "swiglu": False}
    rec = {"rows": [{"op": "moe_prefill", "weights": "fp8", "impl": "mosaic", "form": "w8a8_mosaic", "rows": 8192,
                     "tp": 1, "device_us": 13519.0, "tflops": 366.0, "hbm_fraction": 0.149, "config": [up, down]},
                    {"op": "moe_prefill", "weights": "fp8", "impl": "triton", "form": "dequant", "rows": 8192, "tp": 1,
                     "device_us": 24252.0, "tflops": 204.0, "hbm_fraction": 0.083}],
           "detail_rows": [{"op": "fp8_grouped_gemm", "stage": "prefill", "which": "down", "rows": 8192, "tp": 1,
                            "impl": "mosaic", "config": dict(down, tile_m=128, m_sub=2, compute_wgs=1, swap_ab=False),
                            "device_us": 2300.0, "tflops": 716.0, "hbm_fraction": 0.3},
                           {"op": "quantize_rows", "rows": 8192, "K": 6144, "impl": "xla", "device_us": 102.0}]}
    rows = suite.mosaic_moe_rows(rec)
    assert [r["config"] for r in rows if "config" in r] == [
        {"label": "up 128x256 s2 swiglu, down 16x128 s6 swap_ab"}, {"label": "128x128 s6 m_sub 2 1 WG"}]
    assert [(r["op"], r["form"], r["weights"], r["device_us"]) for r in rows] == [
        ("moe_prefill", "w8a8_mosaic", "fp8", 13519.0), ("moe_prefill", "dequant", "fp8", 24252.0),
        ("fp8_grouped_gemm", "down", "fp8", 2300.0)]
    assert rec["rows"][0]["config"] == [up, down]  # the record is not changed


# the committed results and their rendering


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(suite.RESULTS) if f.endswith(".json")))
def test_committed_results_follow_the_schema(name):
    with open(os.path.join(suite.RESULTS, name + ".json")) as f:
        check_schema(json.load(f), name)


def test_the_docs_are_rendered_from_the_committed_results(capsys):
    """BENCHMARKS.md and README.md hold exactly what `python -m benchmarks render` writes (run it after the suite)."""
    assert main(["render", "--check"]) == 0, capsys.readouterr().out


def test_render_check_fails_when_a_figure_changes(tmp_path):
    results, doc = tmp_path / "results", tmp_path / "BENCHMARKS.md"
    shutil.copytree(suite.RESULTS, results)
    shutil.copy(os.path.join(REPO, "BENCHMARKS.md"), doc)
    assert render.main(check=True, docs=(str(doc),), results=str(results)) == 0
    rec = json.loads((results / "mtp.json").read_text())
    rec["rows"][0]["plain_ms"] = 1234.0
    (results / "mtp.json").write_text(json.dumps(rec))
    before = doc.read_text()
    assert render.main(check=True, docs=(str(doc),), results=str(results)) == 1
    assert doc.read_text() == before  # --check writes nothing
    assert render.main(docs=(str(doc),), results=str(results)) == 0
    assert "| 0 | 1 | 1 | 1234 |" in doc.read_text()  # run 0, k = 1, B = 1: the new plain step


def test_render_names_an_unknown_table_and_a_missing_file(tmp_path):
    with pytest.raises(KeyError, match="unknown table 'nope'"):
        render.render_text("<!-- table:nope -->\nold\n<!-- /table -->\n")
    text = render.render_text("<!-- table:multihost -->\nold\n<!-- /table -->\n", results=str(tmp_path))
    assert "No figures yet: `python -m benchmarks suite --only multihost`" in text and "old" not in text
    (tmp_path / "serving.json").write_text(json.dumps({"command": "c", "rows": [{"check": "serving"}]}))
    text = render.render_text("<!-- table:serving_host -->\n<!-- /table -->\n", results=str(tmp_path))
    assert "No rows of this table in benchmarks/results/serving.json (`c`)" in text
