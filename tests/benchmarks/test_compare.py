"""`python -m benchmarks compare`: rows paired by what they measure, device-timed only, ratios after / before."""

import json

import pytest

from benchmarks import compare, render


def _rec(commit, rows):
    return {"date": "2026-12-06T00:00:00+00:00", "commit": commit, "device": "GPU", "jax": "0.11.2",
            "command": f"bench at {commit}", "rows": rows}


def _row(op, impl, device_us, B=1, **kw):
    return {"op": op, "cache": "bf16", "B": B, "impl": impl, "device_us": device_us, **kw}


def test_pairs_by_measurement_and_summarises_per_op(tmp_path):
    before_a = _rec("old", [_row("sparse_mla", "mosaic", 10.0), _row("sparse_mla", "mosaic", 20.0)])
    before_b = _rec("old", [_row("indexer", "triton", 100.0), _row("indexer", "xla", 50.0, B=32),
                            _row("indexer", "triton", None, B=128, us=7.0)])  # wall-timed: left out
    after = _rec("new", [_row("sparse_mla", "mosaic", 11.0), _row("sparse_mla", "mosaic", 19.0),
                         _row("indexer", "triton", 100.0), _row("indexer", "xla", 75.0, B=1),  # B differs: no pair
                         _row("indexer", "triton", 7.0, B=128), _row("fused_norm_rope", "triton", 3.0)])
    paths = []
    for name, rec in (("a", before_a), ("b", before_b), ("after", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rec))
    out = tmp_path / "cmp.json"
    assert compare.main([str(paths[0]), str(paths[1]), "--after", str(paths[2]), "--out", str(out),
                         "--commit-after", "abc1234"]) == 0
    rec = json.loads(out.read_text())
    assert [s["commit"] for s in rec["sources"]] == ["old", "old", "abc1234"] and rec["commit"] == "abc1234"
    summary = {r["op"]: r for r in rec["rows"] if r["check"] == "compare"}
    assert set(summary) == {"sparse_mla", "indexer"}
    s = summary["sparse_mla"]
    assert s["pairs"] == 2 and s["source"] == [0, 2]
    assert s["min_ratio"] == pytest.approx(0.95) and s["max_ratio"] == pytest.approx(1.1)  # 19/20, 11/10 in order
    assert s["median_ratio"] == pytest.approx((0.95 + 1.1) / 2)
    assert "10.0 -> 11.0" in s["largest_change"]
    i = summary["indexer"]
    assert i["pairs"] == 1 and i["median_ratio"] == 1.0 and i["source"] == [1, 2]
    pairs = [r for r in rec["rows"] if r["check"] == "compare_pair"]
    assert len(pairs) == 3 and all(p["source"] == 2 for p in pairs)


def test_no_pair_is_an_error(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_rec("old", [_row("sparse_mla", "mosaic", 10.0)])))
    b = tmp_path / "b.json"
    b.write_text(json.dumps(_rec("new", [_row("sparse_mla", "triton", 10.0)])))
    with pytest.raises(SystemExit, match="no row of the run after"):
        compare.main([str(a), "--after", str(b), "--out", str(tmp_path / "o.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="bad.json is not a results file"):
        compare.main([str(bad), "--after", str(b), "--out", str(tmp_path / "o.json")])


def test_the_committed_move_check_renders_each_run():
    text = render.render_table("attention_move")
    assert text.count("- run ") == 3 and "| sparse_mla |" in text


def test_the_readme_command_runs_from_a_fresh_interpreter(tmp_path):
    """`python -m benchmarks compare BEFORE.json --after AFTER.json --out FILE` as the README gives it: a new
    process in a folder of its own, relative paths; the record names the command with them."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (tmp_path / "before.json").write_text(json.dumps(_rec("old", [_row("sparse_mla", "mosaic", 10.0)])))
    (tmp_path / "after.json").write_text(json.dumps(_rec("new", [_row("sparse_mla", "mosaic", 12.0)])))
    env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "benchmarks", "compare", "before.json", "--after", "after.json", "--out", "c.json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "sparse_mla: 1 rows, after / before median 1.200" in proc.stdout
    rec = json.loads((tmp_path / "c.json").read_text())
    assert rec["command"] == "python -m benchmarks compare before.json --after after.json --out c.json"
    bad = subprocess.run(cmd[:4] + ["missing.json", "--after", "after.json", "--out", "c.json"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "compare: cannot read missing.json" in bad.stderr
    assert "Traceback" not in bad.stderr
