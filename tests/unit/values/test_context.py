import re

import jax
import pytest

import mshard as ms
from mshard.errors import ContextError, ContextTypeError, MshardError


def test_parallel_mode_constants_equal_strings():
    assert ms.ParallelMode.STAND_ALONE == "stand_alone"
    assert ms.ParallelMode.DATA_PARALLEL == "data_parallel"
    assert ms.ParallelMode.SEMI_AUTO_PARALLEL == "semi_auto_parallel"
    assert ms.ParallelMode.AUTO_PARALLEL == "auto_parallel"
    assert ms.ParallelMode.HYBRID_PARALLEL == "hybrid_parallel"


def test_defaults_and_set_get_reset():
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert ms.get_auto_parallel_context("device_num") == jax.device_count() == 8
    assert ms.get_auto_parallel_context("search_mode") == "recursive_programming"
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4, search_mode="sharding_propagation",
                                 dataset_strategy=((2, 1), (4,)), gradients_mean=True, pipeline_stages=2,
                                 enable_parallel_optimizer=True,
                                 parallel_optimizer_config={"parallel_optimizer_threshold": 32},
                                 comm_fusion={"allreduce": {"mode": "size", "config": 32}},
                                 all_reduce_fusion_config=[20, 35],
                                 strategy_ckpt_config={"save_file": "/tmp/s.json"})
    assert ms.get_auto_parallel_context("device_num") == 4
    assert ms.get_auto_parallel_context("dataset_strategy") == ((2, 1), (4,))
    assert ms.get_auto_parallel_context("parallel_optimizer_config") == {
        "optimizer_weight_shard_size": -1, "parallel_optimizer_threshold": 32, "optimizer_level": "level1"}
    assert ms.get_auto_parallel_context("all_reduce_fusion_config") == [20, 35]
    assert ms.get_auto_parallel_context("strategy_ckpt_config")["save_file"] == "/tmp/s.json"
    # returned values are copies
    ms.get_auto_parallel_context("comm_fusion")["allreduce"]["mode"] = "index"
    assert ms.get_auto_parallel_context("comm_fusion")["allreduce"]["mode"] == "size"
    ms.reset_auto_parallel_context()
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert ms.get_auto_parallel_context("pipeline_stages") == 1


@pytest.mark.parametrize("kwargs, err, words", [
    ({"parallel_modes": "data_parallel"}, ContextError, ["unknown key 'parallel_modes'", "parallel_mode"]),
    ({"parallel_mode": "semi_auto"}, ContextError, ["unknown parallel_mode 'semi_auto'", "semi_auto_parallel"]),
    ({"search_mode": "greedy"}, ContextError, ["unknown search_mode 'greedy'", "sharding_propagation"]),
    ({"device_num": 0}, ContextError, ["device_num=0", "1 <= device_num <= 8"]),
    ({"device_num": 16}, ContextError, ["device_num=16", "sees 8"]),
    ({"device_num": "8"}, ContextTypeError, ["device_num", "'8'"]),
    ({"device_num": 8, "pipeline_stages": 3}, ContextError, ["pipeline_stages=3", "does not divide device_num=8"]),
    ({"dataset_strategy": "model_parallel"}, ContextError, ["dataset_strategy", "'full_batch'"]),
    ({"dataset_strategy": ((3, 1),)}, ContextError, ["(3, 1)", "does not divide device_num=8"]),
    ({"dataset_strategy": ((0, 1),)}, ContextError, ["split < 1"]),
    ({"dataset_strategy": 5}, ContextTypeError, ["dataset_strategy"]),
    ({"gradients_mean": 1}, ContextTypeError, ["gradients_mean", "True or False"]),
    ({"comm_fusion": {"allreduce": {"mode": "fast"}}}, ContextError, ["mode", "'fast'"]),
    ({"comm_fusion": {"allgather": {"mode": "index", "config": [2]}}}, ContextError, ["only for 'allreduce'"]),
    ({"comm_fusion": {"broadcast": {"mode": "auto"}}}, ContextError, ["'broadcast'"]),
    ({"all_reduce_fusion_config": [35, 20]}, ContextError, ["strictly increasing"]),
    ({"parallel_optimizer_config": {"weight_shard": 2}}, ContextError, ["'weight_shard'"]),
    ({"parallel_optimizer_config": {"optimizer_weight_shard_size": 3}}, ContextError, ["does not divide"]),
    ({"parallel_optimizer_config": {"optimizer_level": "level4"}}, ContextError, ["optimizer_level", "'level4'"]),
    ({"parallel_optimizer_config": {"optimizer_level": 3}}, ContextTypeError, ["'level1', 'level2' or 'level3'"]),
    ({"strategy_ckpt_config": {"save": "x"}}, ContextError, ["'save'"]),
])
def test_bad_values_raise_early_and_change_nothing(kwargs, err, words):
    ms.set_auto_parallel_context(parallel_mode="data_parallel")
    with pytest.raises(err) as info:
        ms.set_auto_parallel_context(**kwargs)
    assert isinstance(info.value, MshardError) and isinstance(info.value, (ValueError, TypeError))
    for w in words:
        assert w in str(info.value)
    assert ms.get_auto_parallel_context("parallel_mode") == "data_parallel"
    assert ms.get_auto_parallel_context("pipeline_stages") == 1


def test_get_unknown_key():
    with pytest.raises(ContextError, match="unknown key 'mode'"):
        ms.get_auto_parallel_context("mode")


def test_scoped_context_restores_also_on_error():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=4)
    with ms.parallel_context(parallel_mode="auto_parallel", device_num=8) as ctx:
        assert ctx.parallel_mode == "auto_parallel"
        assert ms.get_auto_parallel_context("device_num") == 8
    assert ms.get_auto_parallel_context("parallel_mode") == "data_parallel"
    with pytest.raises(RuntimeError):
        with ms.parallel_context(parallel_mode="semi_auto_parallel"):
            raise RuntimeError("boom")
    assert ms.get_auto_parallel_context("parallel_mode") == "data_parallel"
    assert ms.get_auto_parallel_context("device_num") == 4
    with pytest.raises(ContextError):
        with ms.parallel_context(parallel_mode="nope"):
            pass
    assert ms.get_auto_parallel_context("parallel_mode") == "data_parallel"


def test_algo_and_cost_model_context():
    ms.set_algo_parameters(fully_use_devices=False, elementwise_op_strategy_follow=True)
    assert ms.get_algo_parameters("fully_use_devices") is False
    ms.reset_algo_parameters()
    assert ms.get_algo_parameters("fully_use_devices") is True
    with pytest.raises(ContextError, match="unknown key 'fully_use'"):
        ms.set_algo_parameters(fully_use=True)
    with pytest.raises(ContextTypeError, match="fully_use_devices must be True or False"):
        ms.set_algo_parameters(fully_use_devices="yes")
    ms.set_cost_model_context(costmodel_beta=100.0, axis_bandwidth=[1e11, 1e10, 1e10])
    assert ms.get_cost_model_context("costmodel_beta") == 100.0
    assert ms.get_cost_model_context("axis_bandwidth") == (1e11, 1e10, 1e10)
    with pytest.raises(ContextError, match="device_memory_capacity=0 must be positive"):
        ms.set_cost_model_context(device_memory_capacity=0)
    with pytest.raises(ContextError, match="axis_bandwidth"):
        ms.set_cost_model_context(axis_bandwidth=[-1])
    ms.reset_cost_model_context()
    assert ms.get_cost_model_context("costmodel_beta") == 400.0


@pytest.mark.parametrize("call,want", [
    (lambda: ms.set_auto_parallel_context(parallel_mode="semi_auto"), "Did you mean 'semi_auto_parallel'?"),
    (lambda: ms.set_auto_parallel_context(search_mode="sharding_propogation"), "Did you mean 'sharding_propagation'?"),
    (lambda: ms.set_auto_parallel_context(devce_num=8), "Did you mean 'device_num'?"),
    (lambda: ms.get_auto_parallel_context("parallel_mod"), "Did you mean 'parallel_mode'?"),
    (lambda: ms.set_algo_parameters(fully_use_device=True), "Did you mean 'fully_use_devices'?"),
])
def test_typos_get_a_did_you_mean(call, want):
    with pytest.raises(ms.errors.ContextError, match=re.escape(want)):
        call()


def test_setting_the_context_never_starts_the_backend_and_regions_check_the_device_count():
    """MindSpore's scripts set the context before ``communication.init()``; ``jax.distributed.initialize`` refuses to
    run once JAX's backend is up, so the setters must not start it. The device-count checks then run when a region
    is built."""
    script = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax.numpy as jnp
import mshard as ms
from jax._src import xla_bridge
ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2,
                             dataset_strategy=((4, 1),), gradients_mean=True)
with ms.parallel_context(parallel_mode="data_parallel"):
    pass
ms.set_auto_parallel_context(device_num=16)             # more than the 8 devices: known only from the backend
print("backend up:", xla_bridge.backends_are_initialized(), flush=True)
try:
    ms.jit(lambda x: x + 1)(jnp.ones((16, 4)))
except ms.errors.ContextError as e:
    print("region:", e)
"""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "backend up: False" in r.stdout, r.stdout
    assert "region: set_auto_parallel_context: device_num=16 but this process sees 8 device(s)" in r.stdout, r.stdout
