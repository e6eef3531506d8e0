"""Shared fixtures: fresh random inputs every run, and the GPU tier's skip rule."""

import os

import numpy as np
import pytest
from helpers.staging_doubles import fake_cuda, make_table  # noqa: F401 (fixtures shared by the staging tests)


def _cuda_available() -> tuple:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible (the GPU tier runs on a machine with one)"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = _cuda_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"GPU tier: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A numpy Generator seeded freshly each run; the seed is printed on failure."""
    seed = int(os.environ.get("TRACE_REPLAY_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed} (rerun with TRACE_REPLAY_TEST_SEED={seed})")
    return np.random.default_rng(seed)
