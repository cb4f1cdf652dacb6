"""Kernel tests: the impls this platform runs, said once for every test module.

`impl` parametrises a test over every impl available here: "xla" always, and the Pallas Triton kernel as
"triton" on an NVIDIA GPU or "triton_interpret" (the same kernel under the Pallas interpreter) elsewhere.
`kernel_impl` is that kernel impl alone (kernel-vs-oracle tests), `interpret` whether it is interpreted
(for tests that call a `*_triton` function directly), `on_gpu` whether the tests run on a GPU. `mosaic_races`
runs Pallas Mosaic GPU kernels under the GPU interpreter's race detector.
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


@pytest.fixture(scope="session")
def mosaic_races():
    """`mosaic_races(f)`: (f()'s result, whether a race was reported), f run with every Pallas Mosaic GPU kernel it
    traces interpreted (the GPU interpreter) with the interpreter's race detector on. The detector orders accesses
    by happens-before through barriers and copy completions, and keeps shared memory's generic proxy (loads,
    stores) apart from its async proxy (TMA copies), which `commit_smem` (fence.proxy.async) joins; jax 0.11.2's
    interpreter checks no wgmma operand reads. The answer is the last interpreted kernel's (the detector's state is
    reset at each launch): f should launch one."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # jax 0.11.2 has no public accessor
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(f):
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
            out = jax.block_until_ready(f())
        return out, interpret_pallas_call.get_races().races_found
    return run
