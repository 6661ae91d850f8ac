"""bench/step.py runs (issue 42), as tests/e2e/scripts/test_bench_smoke.py checks every benchmark: its smoke run (about 3.5 minutes
on 2 cores, some 35 compiles of small training steps) is a file of its own so that the suite's two shards
(tests/conftest.py deals whole files) can balance it against the other benchmarks' smoke runs."""

import pytest
from test_bench_smoke import check_smoke

pytestmark = pytest.mark.slow


def test_bench_step_smoke_writes_its_json(tmp_path):
    check_smoke("step", tmp_path)
