import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's CPU interpreter. The variable is read when a
# kernel is defined, and the kernel modules are imported lazily, so setting it here is in time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["helpers.dot_scaled"]  # the sm100 fixture (a CPU stand-in for tl.dot_scaled)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> str:
    """Where the Triton kernels run: the GPU, or the CPU through the Triton interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_launch_setups():
    """The planner caches split-K launches per size and layout; tests that patch the plan or the
    tile tables must not see another test's cached choices."""
    from nvfp4_inductor.kernels import plan

    yield
    plan.splitk_launch.cache_clear()
