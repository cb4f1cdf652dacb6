"""Every command in the README's ```bash blocks, run as a new user runs it: in order, each as a subprocess in a
fresh interpreter, from one temporary working directory (so relative paths), checking the exit code, that no
traceback is printed and, per subcommand, a line of the output. A README command that stops working fails here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Commands run elsewhere: the test suite cannot run itself.
NOT_HERE = {"bash scripts/test.sh": "this is the command that runs this test"}

#: What each kind of command must print (a regex searched in stdout).
EXPECT = {
    "scripts/demo.sh": r"tokens/s",
    "demo": r"generated \d+: \[",
    "random-checkpoint": r"wrote a random",
    "info": r"param_bytes_per_device",
    "info --kernels": r"decode B=1 .* sparse_mla\.auto ",
    "generate": r"generated \d+: \[",
    "bench": r"decode",
    "convert": r"converted .* -> ",
    "trace": r"wrote \d+ tensors",
    "diff": r"no divergence: every common tensor within tolerance",
    "checkpoints.fp8_blocks": r"FP8",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments dropped, in order."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def _kind(cmd: str) -> str:
    words = shlex.split(cmd)
    if words[:2] == ["python", "-m"]:
        if words[2:5] == ["glm_dsa", "info", "--kernels"]:  # the dispatch table, not the bytes
            return "info --kernels"
        return words[3] if words[2] == "glm_dsa" else words[2]
    return words[1] if words[0] == "bash" else words[0]


COMMANDS = [c for c in readme_commands((ROOT / "README.md").read_text()) if c not in NOT_HERE]


def test_readme_has_the_commands_this_test_knows():
    assert len(COMMANDS) >= 10
    unknown = sorted({_kind(c) for c in COMMANDS} - set(EXPECT))
    assert not unknown, f"README commands with no expected output here: {unknown}"
    for c in COMMANDS:
        assert not re.search(r"[A-Z]{3,}_DIR|\[--", c), f"README command is not runnable as written: {c}"


def test_readme_commands_in_order(tmp_path):
    """One test, so the commands run in order (later ones read what earlier ones wrote) under pytest-xdist too."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` is this venv's
    env.pop("PYTHONPATH", None)  # as installed, not from the source tree
    env.setdefault("JAX_PLATFORMS", "cpu")
    for cmd in COMMANDS:
        # setup scripts run from the repository root, as the README says; everything else from a temp directory
        cwd = ROOT if cmd.startswith("bash scripts/") else tmp_path
        proc = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
                              stdin=subprocess.DEVNULL)
        shown = f"$ {cmd}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, shown
        assert "Traceback" not in proc.stderr, shown
        assert re.search(EXPECT[_kind(cmd)], proc.stdout), shown
