"""Every benchmarks/*.py module imports without starting work, and every script answers --help from main(argv)."""

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "benchmarks", "*.py")))
#: the modules with a `main(argv)` command line (harness, suite and render are helpers; the suite's and render's
#: command line is `python -m benchmarks`, __main__); benchmarks/diagnostics/ has its own test (test_diagnostics.py)
SCRIPTS = [m for m in MODULES if m not in ("__init__", "harness", "suite", "render")]

_PROBE = """
import contextlib, importlib, io, json, sys
from jax._src import xla_bridge
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    for name in sys.argv[1:]:
        importlib.import_module("benchmarks" if name == "__init__" else "benchmarks." + name)
print(json.dumps({"backends": xla_bridge.backends_are_initialized(), "output": out.getvalue()}))
"""


def test_the_scripts_are_all_there():
    assert {"harness", "suite", "render", "__main__", "bench_engine", "bench_dcp", "bench_sparse_mla", "bench_indexer",
            "bench_moe"} <= set(MODULES)


def test_import_starts_no_work(tmp_path):
    """In a fresh process from an empty directory: no device backend started, nothing printed, nothing written."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _PROBE, *MODULES], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"backends": False, "output": ""}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_from_main(name, capsys):
    mod = __import__(f"benchmarks.{name}", fromlist=["main"])
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


_FAKE_OP = """
import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--tag", default="a")
a = ap.parse_args()
rows = {ROWS}
json.dump({{"rows": rows}}, open(a.out, "w"))
"""


def test_bench_attention_merges_halves_and_the_probe_rows(tmp_path, monkeypatch):
    """bench_attention: each op's rows keep the KEEP fields and their source; the Mosaic probe's timing rows become
    sparse_mla rows with the probe's own xla time (wall, kernels, device span) of the same (cache, B); --merge
    keeps the rows and failures of ops not run now and replaces those that are; an op that fails is named in
    "failed"."""
    from benchmarks import bench_attention as ba

    probe_rows = [{"step": "correct_bf16_x", "ok": True},
                  {"step": "time", "cache": "fp8", "B": 32, "impl": "xla", "us": 100.0, "tb_s": 0.2,
                   "kernel_us": 30.0, "device_us": 31.0},
                  {"step": "time", "cache": "fp8", "B": 32, "impl": "mosaic_cp_async_s4", "us": 40.0, "tb_s": 0.5,
                   "kernel_us": 12.0, "device_us": 13.0}]
    fused_rows = [{"op": "fused_norm_rope", "cache": "bfloat16", "T": 64, "impl": "triton", "us": 3.0,
                   "xla_us": 9.0, "tb_s": 1.0, "mismatch": 0.0}]
    (tmp_path / "probe.py").write_text(_FAKE_OP.format(ROWS=repr(probe_rows)))
    (tmp_path / "fused.py").write_text(_FAKE_OP.format(ROWS=repr(fused_rows)))
    (tmp_path / "bad.py").write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(ba, "HERE", str(tmp_path))
    monkeypatch.setattr(ba, "OPS", {"sparse_mla_mosaic": ("probe.py", [], "sparse_mla"),
                                    "fused_norm_rope": ("fused.py", [], "fused_norm_rope"),
                                    "indexer": ("bad.py", [], "indexer")})
    out = tmp_path / "attention.json"
    assert ba.main(["--ops", "sparse_mla_mosaic", "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    assert first["rows"] == [{"op": "sparse_mla", "cache": "fp8_ds_mla", "B": 32, "impl": "mosaic_cp_async_s4",
                              "us": 40.0, "xla_us": 100.0, "tb_s": 0.5, "kernel_us": 12.0, "xla_kernel_us": 30.0,
                              "device_us": 13.0, "xla_device_us": 31.0, "source": "sparse_mla_mosaic"}]
    assert ba.main(["--ops", "fused_norm_rope,indexer", "--merge", "--out", str(out)]) == 1
    merged = json.loads(out.read_text())
    assert [r["source"] for r in merged["rows"]] == ["sparse_mla_mosaic", "fused_norm_rope"]
    assert "mismatch" not in merged["rows"][1] and merged["rows"][1]["T"] == 64
    assert set(merged["commands"]) == {"sparse_mla_mosaic", "fused_norm_rope", "indexer"}
    assert merged["failed"] == ["indexer"]
    assert ba.main(["--ops", "sparse_mla_mosaic", "--merge", "--out", str(out)]) == 0  # replaced, not doubled
    again = json.loads(out.read_text())
    assert [r["source"] for r in again["rows"]] == ["fused_norm_rope", "sparse_mla_mosaic"]
    assert again["failed"] == ["indexer"]  # the earlier call's failure is kept with its command
