import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The fused element-wise kernels (funcpar.nn.pointwise, FUSE="auto") compile at a process's first step where a
# tensor reaches MIN_NUMEL: llama-micro's default batch does, and the compile took ~8 s of every rank of every
# `funcpar train` the suite starts. tests/test_pointwise.py sets FUSE itself and holds the kernels (and a sharded
# step with them) to the composable formulas the other tests run, so the rest of the suite runs those.
os.environ.setdefault("FUNCPAR_FUSE", "off")
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` (tests/test_cuda.py) run where a GPU is visible (scripts/gpu_check.sh), or on the CPU
    when FUNCPAR_CUDA_TIER_DEVICE=cpu asks for a check of the tier's own logic; elsewhere they are skipped."""
    import pytest
    import torch

    if torch.cuda.is_available() or os.environ.get("FUNCPAR_CUDA_TIER_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: scripts/gpu_check.sh runs this tier on one")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
