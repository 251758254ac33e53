import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
