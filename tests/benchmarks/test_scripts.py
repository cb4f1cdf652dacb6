"""Every benchmarks/*.py module imports without starting work, and every script answers --help from main(argv)."""

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "benchmarks", "*.py")))
SCRIPTS = [m for m in MODULES if m not in ("__init__", "harness")]

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
    assert {"harness", "bench_engine", "bench_dcp", "bench_sparse_mla", "bench_indexer", "bench_moe"} <= set(MODULES)


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
