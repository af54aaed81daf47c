import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Device-parametrized tests: "cpu" always runs; "cuda" runs where torch sees a GPU (skipped in CPU-only CI).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA GPU"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each device the test runs on: ``cpu``, and ``cuda:<current GPU>`` where there is one."""
    if request.param == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only where a ``-m`` expression names them (``-m slow``)."""
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
