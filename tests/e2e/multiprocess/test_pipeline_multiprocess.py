"""Pipeline parallel over 2 processes x 4 CPU devices (gloo), one stage per process, vs one device (issue 15)."""


import pytest
from helpers import MP, run_workers

pytestmark = pytest.mark.slow


def test_one_stage_per_process_trains_as_on_one_device():
    run_workers(MP / "worker_pipeline.py", 2, timeout=300)
