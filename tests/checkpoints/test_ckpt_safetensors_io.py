"""The single-file reader and streaming writer on their own."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import CheckpointError, SafetensorsFile, SafetensorsWriter, write_hf_tensors


def test_reads_files_of_the_safetensors_package(tmp_path):
    tensors = {"b": np.arange(6, dtype=np.int32).reshape(2, 3), "a": np.ones((4,), np.float16),
               "empty": np.zeros((0, 5), np.float32)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert set(f.keys()) == set(tensors) and f.metadata == {"format": "pt"}
    for k, t in tensors.items():
        assert f.shape(k) == t.shape and f.dtype(k) == t.dtype
        np.testing.assert_array_equal(f.get(k), t)
    assert not f.get("b").flags.writeable  # a view of the read-only map, not a copy


def test_writer_checks_order_and_completeness(tmp_path):
    path = tmp_path / "x.safetensors"
    entries = [("a", np.float32, (2,)), ("b", np.float32, (3,))]
    with pytest.raises(CheckpointError, match="expected tensor 'a'"):
        with SafetensorsWriter(path, entries) as w:
            w.write("b", np.zeros(3, np.float32))
    with pytest.raises(CheckpointError, match="'b' was never written"):
        with SafetensorsWriter(path, entries) as w:
            w.write("a", np.zeros(2, np.float32))
    assert os.listdir(tmp_path) == []  # neither the final name nor a temporary file
    with SafetensorsWriter(path, entries) as w:
        w.write("a", np.ones(2, np.float32))
        w.write("b", np.arange(3, dtype=np.float32))
    got = load_file(path)
    np.testing.assert_array_equal(got["b"], np.arange(3, dtype=np.float32))
    assert os.path.getsize(path) == w.nbytes


def test_write_hf_tensors_rejects_extra_tensors(tmp_path):
    with pytest.raises(CheckpointError, match="'c'"):
        write_hf_tensors(tmp_path, [("a", np.float32, (1,))],
                         iter([("a", np.zeros(1, np.float32)), ("c", np.zeros(1, np.float32))]))
