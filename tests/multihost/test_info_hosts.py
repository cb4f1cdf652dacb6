"""`info --num-hosts`: devices and bytes per host, and which mesh axes cross hosts (hand-worked layouts: the
mesh is (TP // DCP, DCP) row-major over the devices in process order, 8 per host)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sharding import ParallelConfig
from sharding.mesh import axes_across_hosts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tp, dcp, per_host, want", [
    (16, 1, 8, ["tp"]),    # one TP group of 16: every psum crosses
    (16, 8, 8, ["tp"]),    # (2, 8): each host is one DCP group; the 2-way TP psums cross
    (16, 16, 8, ["dcp"]),  # (1, 16): the DCP gathers and merges cross
    (16, 2, 8, ["tp"]),    # (8, 2): DCP pairs are neighbours, on one host
    (8, 4, 8, []),         # one host
    (16, 2, 1, ["tp", "dcp"]),
])
def test_axes_across_hosts(tp, dcp, per_host, want):
    assert axes_across_hosts(ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
                             per_host) == want


def test_info_num_hosts():
    def info(*flags):
        out = subprocess.run([sys.executable, "-m", "glm_dsa", "info", "--preset", "glm52", "--json", *flags],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    two = info("-tp", "16", "--num-hosts", "2")
    assert (two["hosts"], two["devices_per_host"], two["mesh_axes_across_hosts"]) == (2, 8, ["tp"])
    per_device = float(two["param_bytes_per_device"].split()[0])
    assert float(two["param_bytes_per_host"].split()[0]) == pytest.approx(8 * per_device, abs=0.01)
    bad = subprocess.run([sys.executable, "-m", "glm_dsa", "info", "--preset", "glm52", "-tp", "16", "--num-hosts",
                          "3"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--num-hosts 3 must divide the 16 devices" in bad.stderr
