"""The command line: info without weights, random checkpoints, generate, errors as messages."""

import json

import pytest

from glm_dsa.cli import main


def test_info_preset_reports_qrep_memory(capsys):
    assert main(["info", "--preset", "glm52", "-tp", "4", "-dcp", "4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] > 7e11 and len(info["full_indexer_layers"]) == 21
    assert info["dcp_q_replicate"] is True and info["dcp_comm_backend"] == "a2a"  # GLM-5.x model defaults
    assert info["param_bytes_per_device_with_qrep"] != info["param_bytes_per_device_without_qrep"]
    assert main(["info", "--preset", "glm52", "-tp", "4", "-dcp", "4", "--no-dcp-q-replicate",
                 "--dcp-comm-backend", "ag_rs", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dcp_q_replicate"] is False and info["dcp_comm_backend"] == "ag_rs"


def test_env_overrides_flag(capsys, monkeypatch):
    monkeypatch.setenv("GLM_DSA_DCP_Q_REPLICATE", "1")
    assert main(["info", "--preset", "tiny", "-tp", "2", "-dcp", "2", "--no-dcp-q-replicate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dcp_q_replicate"] is True


def test_random_checkpoint_info_and_generate(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["random-checkpoint", "--preset", "tiny", "--out", str(out), "--dtype", "float32"]) == 0
    assert main(["info", "--checkpoint", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["layers"] == 4
    assert main(["generate", "--checkpoint", str(out), "--prompt-ids", "5,6,7", "--prompt-ids", "8 9",
                 "--max-new-tokens", "4", "--ignore-eos", "--dtype", "float32", "-tp", "2", "-dcp", "2"]) == 0
    text = capsys.readouterr().out
    assert "generated 4" in text and "tokens/s" in text


def test_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert main(["info", "--checkpoint", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "a,b"])
