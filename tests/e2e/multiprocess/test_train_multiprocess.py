"""TrainOneStepCell over 2 processes x 4 CPU devices (gloo), fed by ms.dataset.shard_batch, vs one device: data parallel
with optimizer parallel, then Megatron (dp across the processes) with gradient fusion."""


import pytest
from helpers import MP, run_workers

pytestmark = pytest.mark.slow


def test_data_parallel_training_with_optimizer_parallel_across_two_processes():
    run_workers(MP / "worker_train.py", 2, timeout=300)
