"""Shared fixtures of the model and engine tests: a tiny random float32 checkpoint and an engine over it."""

import pytest

import glm_dsa
from checkpoints.random import write_random_checkpoint
from glm_dsa import configs


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random `configs.tiny` checkpoint (float32, HF layout, seed 0), written once per session."""
    path = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(configs.tiny, path, seed=0, dtype="float32", progress=False)
    return path


@pytest.fixture(scope="module")
def eng(ckpt):
    """An engine over `ckpt` (float32, max_model_len 64), one per test module."""
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False)
