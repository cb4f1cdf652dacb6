"""Numbers and strings on the command line checked before anything runs, by the real `python -m glm_dsa` (a
subprocess): ports 1-65535, memory > 0, an API key that is not empty, sizes and timeouts in range; and `serve`'s
port checked before the model loads, so a port in use fails at once. Each error is one line naming the flag,
exit status 2."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "glm_dsa", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


CASES = [
    (["serve", "--checkpoint", "x", "--port", "70000"], "--port"),
    (["serve", "--checkpoint", "x", "--port", "0"], "--port"),
    (["serve", "--checkpoint", "x", "--port", "-1"], "--port"),
    (["serve", "--checkpoint", "x", "--api-key", ""], "--api-key"),
    (["serve", "--checkpoint", "x", "--api-key", "  "], "--api-key"),
    (["serve", "--checkpoint", "x", "--max-request-bytes", "0"], "--max-request-bytes"),
    (["serve", "--checkpoint", "x", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["serve", "--checkpoint", "x", "--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["info", "--preset", "tiny", "--device-memory", "-5"], "--device-memory"),
    (["info", "--preset", "tiny", "--device-memory", "0"], "--device-memory"),
    (["info", "--preset", "tiny", "--device-memory", "inf"], "--device-memory"),
]


@pytest.mark.parametrize("args,flag", CASES, ids=[f"{a[0]}{a[-2]}={a[-1]!r}" for a, _ in CASES])
def test_an_out_of_range_flag_is_an_error_naming_it(args, flag, capsys):
    """In this process (the parser is the command line's own; a subprocess each would cost seconds apiece)."""
    from glm_dsa.cli import main
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr()
    assert e.value.code == 2, err
    assert flag in err.err.strip().splitlines()[-1], err.err
    assert "serving" not in err.out


def test_the_command_line_refuses_port_70000_as_a_process():
    r = _cli("serve", "--checkpoint", "x", "--port", "70000")
    assert r.returncode == 2 and "--port" in r.stderr.strip().splitlines()[-1], (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "serving" not in r.stdout


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    """The checkpoint does not exist: had the model been loaded first, that would be the error."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _cli("serve", "--checkpoint", str(tmp_path / "missing"), "--port", str(port))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"--port {port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "missing" not in r.stderr and "Traceback" not in r.stderr, r.stderr
