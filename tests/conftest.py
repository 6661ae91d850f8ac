"""Simulate 8 CPU devices before JAX is imported (DESIGN §6) and reset mshard's global state per test."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture(autouse=True)
def _fresh_mshard_context():
    try:
        import mshard as ms
    except Exception:  # the package is being built; searchers tests do not need it
        yield
        return
    ms.reset_auto_parallel_context()
    ms.reset_algo_parameters()
    ms.reset_cost_model_context()
    yield
    ms.reset_auto_parallel_context()
    ms.reset_algo_parameters()
    ms.reset_cost_model_context()
