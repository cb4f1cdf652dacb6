"""The projection area (benchmarks/bench_projection.py), its collective cost model (benchmarks/collective_model.py)
and `bench --shard-of` on CPU: what they compute from what they measure, never the speed itself."""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import collective_model as cm
from benchmarks import bench_projection as bp
from benchmarks.bench_projection import MTP_ACCEPTANCE, SGLANG, main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMITTED = os.path.join(REPO, "benchmarks", "results", "projection.json")


def test_collective_model_by_hand():
    """latency + ring factor x bytes / bus bandwidth, from the inputs table (every input with a source URL)."""
    inputs = cm.load_inputs()
    v = inputs["values"]
    assert all(src.startswith("https://") for src in inputs["sources"].values())
    lat, bw, ar = v["latency_us"], v["busbw_gb_s"] * 1e9, v["allreduce_busbw_gb_s"] * 1e9
    b = 16 * 6144 * 2  # the psum after o_proj at 16 rows, bf16
    assert cm.collective_us("psum", 8, b, b, inputs) == pytest.approx(lat + 2 * 7 / 8 * b / ar * 1e6)
    assert cm.collective_us("all_gather", 8, b, 8 * b, inputs) == pytest.approx(lat + 7 / 8 * 8 * b / bw * 1e6)
    assert cm.collective_us("psum_scatter", 8, b, b // 8, inputs) == pytest.approx(lat + 7 / 8 * b / bw * 1e6)
    assert cm.collective_us("all_to_all", 4, b, b, inputs) == pytest.approx(lat + 3 / 4 * b / bw * 1e6)
    assert cm.collective_us("psum", 1, b, b, inputs) == 0.0  # a group of one is no collective
    with pytest.raises(ValueError, match="collective kind 'bcast'"):
        cm.collective_us("bcast", 8, b, b, inputs)


def test_measured_points_replace_the_model():
    """A measured point of the same kind and group is used as is; between two, log-log interpolation; other kinds
    keep the model."""
    inputs = dict(cm.load_inputs(), measured=[{"kind": "psum", "group": 8, "bytes": 1000, "us": 10.0},
                                              {"kind": "psum", "group": 8, "bytes": 100000, "us": 40.0}])
    assert cm.collective_us("psum", 8, 1000, 1000, inputs) == 10.0
    assert cm.collective_us("psum", 8, 10000, 10000, inputs) == pytest.approx(math.sqrt(10.0 * 40.0))
    assert cm.collective_us("psum", 8, 10, 10, inputs) == 10.0  # below the smallest: its latency floor
    assert cm.collective_us("psum", 8, 200000, 200000, inputs) == pytest.approx(80.0)  # its bandwidth beyond
    assert cm.collective_us("psum", 4, 1000, 1000, inputs) == cm.collective_us("psum", 4, 1000, 1000)


def test_projection_cpu_smoke(tmp_path):
    """Tiny model, TP = 4, DCP 1 and 2: every row's step is its compute plus its collectives, tok/s per GPU follows
    from the step (2.99 tokens per request per speculative step with MTP), the collectives of DCP = 2 cost more
    than DCP = 1's (its merge and top-k exchange), and SGLang's published rows stand beside with their sources."""
    out = tmp_path / "projection.json"
    assert main(["--preset", "tiny", "--tp", "4", "--dcp", "1,2", "--concurrency", "2", "--input-len", "32",
                 "--output-len", "8", "--dtype", "float32", "--quantization", "none", "--kv-cache-dtype", "auto",
                 "--iters", "1", "--no-prefill", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert {"date", "commit", "device", "jax", "command", "rows"} <= set(rec)
    ours = [r for r in rec["rows"] if r["system"] == "glm-dsa (projected)"]
    assert [(r["dcp"], r["concurrency"], r["mtp"]) for r in ours] == [(1, 2, False), (1, 2, True), (2, 2, False),
                                                                       (2, 2, True)]
    for r in ours:
        assert r["step_ms"] == pytest.approx(r["compute_ms"] + r["collective_ms"])
        per_step = 2 * (MTP_ACCEPTANCE if r["mtp"] else 1)
        assert r["tok_s_per_gpu"] == pytest.approx(per_step / (r["step_ms"] * 1e-3) / 4)
        assert any("collective_model.json" not in s and s.startswith("busbw_gb_s") for s in r["sources"])
        assert r["largest_cost"]
    assert ours[2]["collective_ms"] > ours[0]["collective_ms"]
    assert [r for r in rec["rows"] if r["system"].startswith("SGLang")] == json.loads(json.dumps(SGLANG))
    check = rec["moe_width_check"]
    assert check["split_weight_bytes"] == 4
    # every plain step has its own whole-step figure; the verify step (8 rows) borrows the plain step's (2 rows)
    for r in ours:
        plain = rec["runs"][str(r["dcp"])]["2"]["plain"]
        factor = plain["built_step_ms"] / plain["built_stages_sum_ms"]
        if not r["mtp"]:
            assert r["whole_step"]["how"] == "own" and r["compute_scale"] == pytest.approx(factor)
            assert r["compute_ms"] == pytest.approx(r["stage_sum_ms"] * factor)
        else:
            assert r["whole_step"]["verify"]["how"] == "nearest" and r["compute_scale"] == pytest.approx(factor)
        assert r["notes"] and all("compute" in n for n in r["notes"])
    # the rows are a function of the record's runs: reprojecting the file gives them back
    again = tmp_path / "again.json"
    assert main(["--reproject", str(out), "--out", str(again)]) == 0
    re_rec = json.loads(again.read_text())
    assert re_rec["rows"] == rec["rows"]
    assert {k: re_rec[k] for k in ("date", "commit", "device", "command")} == {k: rec[k] for k in
                                                                                ("date", "commit", "device", "command")}
    assert "--reproject" in re_rec["reprojected"]["command"]


def _measurement(rows: int, stages: dict, layers: dict, whole: tuple[float, float] | None) -> dict:
    """A recorded shard measurement (`shard_benchmark.measure`'s keys) without collectives: `whole` = (built step
    ms, built stage-sum ms) or None (no whole-step figure)."""
    m = {"rows": rows, "context": 64, "stages_ms": dict(stages), "collectives": [],
         "compute_ms": sum(ms * layers[s] for s, ms in stages.items())}
    if whole is not None:
        m.update(built_layers=2, built_step_ms=whole[0], built_stages_sum_ms=whole[1])
    return m


#: 3 layers run attention, 3 the MoE; the built 2 layers (one of each) run 2 ms of attention and 4 of MoE (the head
#: costs nothing here, so that the hand figures stay small)
LAYERS = {"attention_full": 3, "moe": 3, "head": 1}
STAGES = {"attention_full": 2.0, "moe": 4.0, "head": 0.0}


def _project(runs: dict, **kw) -> list[dict]:
    return bp.project(runs, layers=LAYERS, tp=1, inputs=cm.load_inputs(), model_sources=[], device="dev", **kw)


def test_stages_are_scaled_to_the_whole_step_by_hand():
    """Stages of 2 and 4 ms whose whole step takes 3 ms: each stage x 3 / 6, so 1 and 2 ms, over the full depth
    (3 layers each) 9 ms of compute instead of 18; the largest cost is named from the scaled stages; the MTP step
    (verify over 4 rows + first draft, then 2 chained drafts, each a full layer and the head) scales the same way."""
    runs = {"1": {"q_replicate": False,
                  "1": {"plain": _measurement(1, STAGES, LAYERS, (3.0, 6.0)),
                        "verify": _measurement(4, STAGES, LAYERS, None)}}}
    plain, spec = _project(runs)
    assert plain["compute_ms"] == pytest.approx(9.0) and plain["stage_sum_ms"] == pytest.approx(18.0)
    assert plain["compute_scale"] == pytest.approx(0.5) and plain["step_ms"] == pytest.approx(9.0)
    assert plain["tok_s_per_gpu"] == pytest.approx(1 / 9e-3)
    assert plain["whole_step"] == {"factor": 0.5, "how": "own", "rows": 1, "concurrency": 1, "built_layers": 2,
                                   "built_step_ms": 3.0, "built_stages_sum_ms": 6.0}
    assert plain["largest_cost"] == "moe compute (6.000 ms of the step)"  # 3 layers x 2 ms, not x 4 ms
    assert "x 0.5000" in plain["notes"][0] and "its own" in plain["notes"][0]
    assert bp.scaled(runs["1"]["1"]["plain"], 0.5)["stages_ms"] == {"attention_full": 1.0, "moe": 2.0, "head": 0.0}
    # verify 18 + first draft 6 + 2 chained drafts of 6: 36 ms of stages, 18 scaled
    assert spec["stage_sum_ms"] == pytest.approx(36.0) and spec["compute_ms"] == pytest.approx(18.0)
    assert spec["whole_step"]["verify"]["how"] == "nearest"
    assert spec["scaled_by"] == "verify c=1 (nearest); drafts own (c=1)"


def test_a_step_without_its_own_whole_step_borrows_the_nearest_or_stays_unscaled():
    """An older record with the whole step at c = 1 and c = 16 only: c = 4 (4x the rows of c = 1) and c = 64 (4x
    c = 16's) borrow the nearest one's factor; c = 256 (16x c = 16's rows) has none within reach and stays as timed,
    and says so; with reach 0 nothing is borrowed."""
    runs = {"8": {"q_replicate": True}}
    for c, whole in ((1, (3.0, 6.0)), (4, None), (16, (4.0, 5.0)), (64, None), (256, None)):
        runs["8"][str(c)] = {"plain": _measurement(c, STAGES, LAYERS, whole),
                             "verify": _measurement(4 * c, STAGES, LAYERS, None)}
    rows = {(r["concurrency"], r["mtp"]): r for r in _project(runs)}
    got = {c: (rows[c, False]["whole_step"]["how"], rows[c, False]["whole_step"]["concurrency"],
               rows[c, False]["compute_scale"]) for c in (1, 4, 16, 64, 256)}
    assert got == {1: ("own", 1, 0.5), 4: ("nearest", 1, 0.5), 16: ("own", 16, 0.8), 64: ("nearest", 16, 0.8),
                   256: ("none", 256, 1.0)}
    assert rows[4, False]["compute_ms"] == pytest.approx(9.0) and rows[256, False]["compute_ms"] == pytest.approx(18.0)
    assert "borrowed from the plain step at c = 1" in rows[4, False]["notes"][0]
    assert "unscaled (an upper bound)" in rows[256, False]["notes"][0]
    assert rows[256, False]["scaled_by"] == "none"
    # the verify steps: 4 rows -> c = 1 (and c = 4, which has no figure); 64 -> c = 16; 1024 -> none within 4x
    assert [rows[c, True]["whole_step"]["verify"]["concurrency"] for c in (1, 16, 256)] == [1, 16, 256]
    assert rows[256, True]["whole_step"]["verify"]["how"] == "none"
    unscaled = {(r["concurrency"], r["mtp"]): r["compute_ms"] for r in _project(runs, reach=0)}
    assert unscaled[4, False] == pytest.approx(18.0) and unscaled[1, False] == pytest.approx(9.0)


def test_the_committed_projection_is_its_runs_reprojected():
    """benchmarks/results/projection.json's rows are what `--reproject` makes of its own runs (CPU, no device), and
    every projected row keeps the stage sum, the factor and the whole step it came from."""
    with open(COMMITTED) as f:
        rec = json.load(f)
    assert rec["workload"]["stage_layers"]  # checked against every recorded compute when it was written
    again = bp.reproject(rec, reach=rec["scale_reach"], command="c", commit="x")
    assert json.loads(json.dumps(again["rows"])) == rec["rows"]
    for r in (r for r in rec["rows"] if r["system"] == "glm-dsa (projected)"):
        assert r["compute_ms"] == pytest.approx(r["stage_sum_ms"] * r["compute_scale"])
        assert r["compute_scale"] <= 1.0 and r["notes"]
    # a record without its layer counts takes them from the caller, checked against every recorded compute
    bare = {**rec, "workload": {k: v for k, v in rec["workload"].items() if k != "stage_layers"}}
    with pytest.raises(ValueError, match="pass the run's --preset/--num-layers"):
        bp.reproject(bare, layers={**rec["workload"]["stage_layers"], "moe": 74})
    assert bp.reproject(bare, layers=rec["workload"]["stage_layers"], reach=rec["scale_reach"])["rows"] == again["rows"]


def test_bench_shard_of_in_a_subprocess(tmp_path):
    """`python -m glm_dsa bench --shard-of 4,2`: a record of the stages, the compute over the preset's layers and
    the collectives per step; a layout the model does not divide is one error line naming the flag."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "glm_dsa", "bench", "--preset", "tiny", "--shard-of", "4,2", "--input-len", "40",
           "--decode-batches", "2", "--dtype", "float32", "--no-end-to-end", "--json-out", "s.json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "s.json").read_text())
    assert (rec["tp"], rec["dcp"], rec["layers"], rec["built_layers"]) == (4, 2, 4, 3)
    (row,) = rec["rows"]
    assert set(row["stages_ms"]) == {"attention_full", "attention_shared", "mlp_dense", "moe", "head"}
    # tiny: layers 0, 1 full, 2, 3 shared; layer 0 dense, 1-3 MoE
    want = (2 * row["stages_ms"]["attention_full"] + 2 * row["stages_ms"]["attention_shared"]
            + row["stages_ms"]["mlp_dense"] + 3 * row["stages_ms"]["moe"] + row["stages_ms"]["head"])
    assert row["compute_ms"] == pytest.approx(want)
    kinds = sorted({(c["stage"], c["kind"], c["group"], c["layers"]) for c in row["collectives"]})
    assert ("moe", "psum", 4, 3) in kinds and ("attention_shared", "all_to_all", 2, 2) in kinds
    assert "collectives per step" in proc.stdout
    bad = subprocess.run(cmd[:7] + ["3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--shard-of '3'" in bad.stderr and "num_attention_heads (4)" in bad.stderr
