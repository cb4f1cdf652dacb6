"""Shared fixtures for the checkpoint tests: small configs and random parameters in our layout."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints.layout import param_specs
from glm_dsa import configs


@pytest.fixture(scope="session")
def cfg2():
    """Two layers: 0 dense with an indexer, 1 MoE sharing layer 0's indexer."""
    return configs.tiny.replace(num_hidden_layers=2, indexer_types=("full", "shared"))


def random_params(cfg, dtype=np.float32, seed=0) -> dict[str, np.ndarray]:
    """Random parameters {path: array} in our layout; fp32 parameters stay float32."""
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s.shape, dtype=np.float32).astype(np.float32 if s.fp32 else dtype)
            for p, s in param_specs(cfg).items()}


@pytest.fixture(scope="session")
def make_params():
    """`random_params` as a fixture (test modules do not import conftest)."""
    return random_params
