"""Test set-up: 8 simulated CPU devices (before jax is imported), one XLA compilation cache for the run, the gpu
marker, shared fixtures (a tiny random checkpoint and an engine over it)."""

import atexit
import os
import shutil
import tempfile

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("GLM_DSA_TEST_GPU") != "1" else "")

# JAX's persistent compilation cache in a directory made for this run (removed at its end): many tests build the
# same engine over the same checkpoint (each Engine jits its own step, and a new jit compiles again), in this
# process, in the pytest-xdist workers and in the subprocesses they start (all inherit the variable), and XLA
# compiles most of the suite's CPU time. An entry is keyed by the whole program, the compile options, the XLA
# flags and the jax/XLA versions, so a hit is the executable that compile would have built: what the tests check
# is unchanged. Compiles of any length are kept (the default skips those under 1 s, most of a tiny model's).
# GLM_DSA_TEST_COMPILE_CACHE=0 turns it off (then every program is compiled where it runs, as before).
if os.environ.get("GLM_DSA_TEST_COMPILE_CACHE", "1") != "0" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _cache_dir = tempfile.mkdtemp(prefix="glm_dsa_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)  # in the process that made it (xdist: the main)

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with GLM_DSA_TEST_GPU=1 on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rewrite_checkpoint():
    """`rewrite(src, dst, edit)`: copy the single-file safetensors checkpoint directory `src` to `dst` with its
    tensors passed through `edit({key: array}) -> {key: array}` (config.json copied): hostile checkpoints."""
    import numpy as np

    from checkpoints.safetensors_io import SafetensorsFile, SafetensorsWriter

    def rewrite(src, dst, edit):
        f = SafetensorsFile(src / "model.safetensors")
        tensors = edit({k: np.array(f.get(k)) for k in f.keys()})
        dst.mkdir()
        with SafetensorsWriter(dst / "model.safetensors", [(k, a.dtype, a.shape) for k, a in tensors.items()]) as w:
            for k, a in tensors.items():
                w.write(k, a)
        (dst / "config.json").write_text((src / "config.json").read_text())
    return rewrite


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random `configs.tiny` checkpoint (float32, HF layout, seed 0), written once per test run (tests/serving
    overrides it with one that carries tokenizer files)."""
    from checkpoints.random import write_random_checkpoint
    from glm_dsa import configs
    path = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(configs.tiny, path, seed=0, dtype="float32", progress=False)
    return path


@pytest.fixture(scope="module")
def eng(ckpt):
    """An engine over `ckpt` (float32, max_model_len 64), one per test module."""
    import glm_dsa
    return glm_dsa.load(ckpt, dtype="float32", max_model_len=64, progress=False)
