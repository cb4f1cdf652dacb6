"""The README's per-device weight figures are `info`'s: computed from the preset, so a change of the parameter
layout that moves them fails here instead of leaving the README wrong."""

import json
import os
import re

from glm_dsa.cli import main

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _info(capsys, *argv) -> dict:
    assert main(["info", "--preset", "glm52", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _gib(text: str) -> float:
    value, unit = text.split()
    assert unit == "GiB", text
    return float(value)


def test_readme_weights_per_device_are_infos(capsys):
    with open(README) as f:
        readme = " ".join(f.read().split())
    # "... 177.4 GiB per device in bf16 (...) and 90.1 GiB in FP8 (94.1 GiB with QREP at DCP=8)" and the figures
    # section's "177.4 GiB in bf16, 90.1 GiB with `--quantization fp8` (94.1 GiB with QREP at DCP = 8)"
    quoted = re.findall(r"([\d.]+) GiB (?:per device )?in bf16.*? ([\d.]+) GiB (?:in FP8|with `--quantization fp8`)"
                        r" \(([\d.]+) GiB with QREP at DCP ?= ?8\)", readme)
    assert len(quoted) == 2, quoted
    bf16 = _gib(_info(capsys, "-tp", "8")["param_bytes_per_device"])
    fp8 = _info(capsys, "-tp", "8", "-dcp", "8", "--quantization", "fp8")
    want = (bf16, _gib(fp8["param_bytes_per_device_without_qrep"]), _gib(fp8["param_bytes_per_device_with_qrep"]))
    for figures in quoted:
        assert tuple(float(x) for x in figures) == tuple(round(w, 1) for w in want), (figures, want)
