"""2 processes x 4 CPU devices on 127.0.0.1 (gloo): a semi_auto region spans both processes' devices."""


import pytest
from helpers import MP, run_workers

pytestmark = pytest.mark.slow


def test_megatron_region_across_two_processes():
    run_workers(MP / "worker_megatron.py", 2, timeout=240)
