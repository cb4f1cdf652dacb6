"""The projection area (benchmarks/bench_projection.py), its collective cost model (benchmarks/collective_model.py)
and `bench --shard-of` on CPU: what they compute from what they measure, never the speed itself."""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import collective_model as cm
from benchmarks.bench_projection import MTP_ACCEPTANCE, SGLANG, main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
