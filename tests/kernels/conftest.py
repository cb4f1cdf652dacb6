"""Kernel tests: the impls this platform runs, said once for every test module.

`impl` parametrises a test over every impl available here: "xla" always, and the Pallas Triton kernel as
"triton" on an NVIDIA GPU or "triton_interpret" (the same kernel under the Pallas interpreter) elsewhere.
`kernel_impl` is that kernel impl alone (kernel-vs-oracle tests), `interpret` whether it is interpreted
(for tests that call a `*_triton` function directly), `on_gpu` whether the tests run on a GPU.
"""

import jax
import pytest

_ON_GPU = jax.default_backend() == "gpu"
_KERNEL_IMPL = "triton" if _ON_GPU else "triton_interpret"


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    return _ON_GPU


@pytest.fixture(scope="session")
def kernel_impl() -> str:
    return _KERNEL_IMPL


@pytest.fixture(scope="session")
def interpret() -> bool:
    return not _ON_GPU


@pytest.fixture(params=["xla", _KERNEL_IMPL])
def impl(request) -> str:
    return request.param
