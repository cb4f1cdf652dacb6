"""`python -m glm_dsa convert --from HF_DIR --to ORBAX_DIR`: FP8 and bf16 releases to orbax, loadable by
`glm_dsa.load` onto any mesh, with the tokenizer carried along; errors as messages."""

import os

import numpy as np
import pytest

import glm_dsa
from jax.sharding import NamedSharding

from checkpoints import committed_checkpoint, load_hf_params, load_orbax_params, read_orbax_metadata
from checkpoints.fp8_blocks import write_fp8_release
from checkpoints.random import write_random_checkpoint
from glm_dsa.cli import main
from sharding import ParallelConfig, make_mesh, param_spec

CFG = glm_dsa.configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"))


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    write_random_checkpoint(CFG, root / "hf", seed=4, dtype="float32", progress=False)
    write_fp8_release(root / "hf", root / "fp8")
    (root / "fp8" / "tokenizer.json").write_text("{}")  # carried along verbatim (not parsed by convert)
    return root / "fp8"


def test_convert_fp8_release_then_load_on_another_mesh(fp8_release, tmp_path, capsys):
    out = tmp_path / "orbax"
    # --quantization none: dequantised (by default an FP8 release stays FP8: tests/model/test_info_fp8.py)
    assert main(["convert", "--from", str(fp8_release), "--to", str(out), "--dtype", "float32", "-tp", "2",
                 "--quantization", "none"]) == 0
    captured = capsys.readouterr()
    assert "converted" in captured.out and "tokenizer.json" in captured.out
    assert "loading" in captured.err and "saving checkpoint-000001" in captured.err  # the progress bars
    meta = read_orbax_metadata(out)
    assert meta["dtype"] == "float32" and meta["source"] == os.path.abspath(fp8_release)
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "config.json").exists()

    # the converted parameters are the device-dequantised ones, bit for bit, restored onto another mesh
    # (engine logits from orbax on DCP meshes: tests/checkpoints/test_orbax_io.py)
    want = load_hf_params(fp8_release, CFG, dtype="float32", progress=False, quantization="none")
    par = ParallelConfig(4, 2, dcp_q_replicate=True)
    mesh = make_mesh(par)
    got = load_orbax_params(out, CFG, dtype="float32", progress=False,
                            sharding_for=lambda p, s: NamedSharding(mesh, param_spec(p, True)))
    for p, a in want.items():
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(a), err_msg=p)

    # converting again (orbax -> orbax, bfloat16) commits a new version in place of the old one
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "bf16"), "--no-progress"]) == 0
    assert main(["convert", "--from", str(tmp_path / "bf16"), "--to", str(out), "--no-progress"]) == 0
    assert committed_checkpoint(out).endswith("checkpoint-000002")
    assert read_orbax_metadata(out)["dtype"] == "bfloat16"
    assert main(["info", "--checkpoint", str(out), "--json"]) == 0


def test_convert_errors_are_messages(fp8_release, tmp_path, capsys):
    assert main(["convert", "--from", str(tmp_path / "nope"), "--to", str(tmp_path / "o")]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err
    assert main(["convert", "--from", str(fp8_release), "--to", str(fp8_release.parent / "hf"),
                 "--no-progress"]) == 2
    assert "holds an HF safetensors checkpoint" in capsys.readouterr().err
    assert main(["convert", "--from", str(fp8_release), "--to", str(fp8_release)]) == 2
    assert "same directory" in capsys.readouterr().err
