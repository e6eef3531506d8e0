"""Shared fixtures: fresh random inputs every run, the required packages, and the GPU tier's
skip rule.

Every package the suite needs must import, or the run stops before collecting anything, naming
the package and how to install it: a missing dependency is an error, never a reason to skip.
Only the GPU tier skips, and only for want of a GPU.
"""

import importlib
import os

import pytest

INSTALL = "pip install -e '.[torch,jax,test]' (or run: bash scripts/test.sh)"
TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"

# import name -> what to install (the distribution, and the command)
REQUIRED = {
    "numpy": f"numpy: {INSTALL}",
    "triton": f"triton: {INSTALL}",
    "cuda.bindings": f"cuda-bindings: {INSTALL}",
    "safetensors": f"safetensors: {INSTALL}",
    "torch": f"torch: {TORCH_CPU} on a machine without a GPU, then {INSTALL}",
    "jax": f"jax: {INSTALL}",
    "hypothesis": f"hypothesis: {INSTALL}",
    "transformers": f"transformers: {INSTALL}",
}


def _require_packages() -> None:
    missing = []
    for name, how in REQUIRED.items():
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a broken install failing at import
            missing.append(f"  {name} does not import ({type(exc).__name__}: {exc}); install {how}")
    if missing:
        raise pytest.UsageError(
            "the test suite needs packages that do not import (a missing dependency fails the run; "
            "only the GPU tier skips):\n" + "\n".join(missing)
        )


_require_packages()  # before the helpers below import the library (which imports triton and numpy)

import numpy as np  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

# ``--hypothesis-profile=mutants`` (tests/mutants/run.py): a failing example is reported as found,
# without shrinking it, since a planted fault only needs to be caught.
settings.register_profile("mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate])
from helpers.staging_doubles import fake_cuda, make_table  # noqa: E402, F401 (fixtures shared by the staging tests)


def _cuda_available() -> tuple:
    import torch  # required: checked above

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
