"""docs/design.md §4 errors touched by the foundation: raised early, as mshard.errors subclasses, naming op, value and fix."""

import jax.numpy as jnp
import pytest
from flax import nnx

import mshard as ms
from mshard import Layout, nn, ops
from mshard.errors import (
    DatasetStrategyError,
    LayoutError,
    MshardError,
    ParameterPlanError,
    StrategyError,
    StrategyTypeError,
)

SEMI = dict(parallel_mode="semi_auto_parallel", device_num=8)


def run(op, *args):
    return ms.jit(lambda *a: op(*a))(*args)


@pytest.mark.parametrize("strategy, shapes, words", [
    (((2, 3), (3, 1)), [(16, 48), (48, 8)], ["MatMul input 0", "(2, 3)", "does not divide device_num=8"]),
    (((2, 1), (1, 4)), [(16, 48), (48, 9)], ["split 4 on dim 1 does not divide its size 9"]),
    (((4, 4), (4, 1)), [(16, 48), (48, 8)], ["(4, 4)", "exceeds device_num=8"]),
    (((2, 2), (2, 4)), [(16, 48), (48, 8)], ["uses 16 devices in all", "exceeds device_num=8"]),
    (((2, 2), (4, 1)), [(16, 48), (48, 8)], ["inputs disagree on a shared dim", "split 2", "split 4"]),
    (((2, 1, 1), (1, 1)), [(16, 48), (48, 8)], ["has 3 entries but the tensor has rank 2"]),
    (((2, 1),), [(16, 48), (48, 8)], ["strategy has 1 entries but the op takes 2"]),
])
def test_matmul_strategy_errors(strategy, shapes, words):
    ms.set_auto_parallel_context(**SEMI)
    mm = ops.MatMul().shard(strategy)
    with pytest.raises(StrategyError) as info:
        run(mm, *[jnp.ones(s) for s in shapes])
    for w in words:
        assert w in str(info.value)


def test_strategy_type_errors():
    with pytest.raises(StrategyTypeError, match="looks like one tensor's strategy"):
        ops.MatMul().shard((2, 1))
    with pytest.raises(StrategyTypeError, match="is not a tuple of split counts"):
        ops.MatMul().shard((("a", 1), (1, 1)))
    with pytest.raises(StrategyError, match="split count < 1"):
        ops.MatMul().shard(((0, 1), (1, 1)))
    ms.set_auto_parallel_context(**SEMI)
    with pytest.raises(StrategyError, match="strategy has 2 entries but the op takes 1 tensor input"):
        run(ops.ReLU().shard(((2, 1), (2, 1))), jnp.ones((8, 8)))


@pytest.mark.parametrize("make, op", [
    (lambda: ops.Conv2D(4, 3, data_format="NHWC"), "Conv2D"), (lambda: ops.MaxPool(2, 2, data_format="NHWC"), "MaxPool"),
    (lambda: ops.BatchNorm(data_format="NHWC"), "BatchNorm"), (lambda: ops.BiasAdd("NWC"), "BiasAdd"),
])
def test_a_data_format_the_op_does_not_compute_is_refused_when_it_is_made(make, op):
    """mshard's convolution, pooling and batch norm compute NCHW: an "NHWC" they would silently read as NCHW is
    refused, naming the op, the value and the fix."""
    with pytest.raises(StrategyError, match=f"{op}: data_format='N[HW]*C'.*not supported.*transpose the input to NCHW"):
        make()


def test_unsplittable_and_broadcast_dims():
    ms.set_auto_parallel_context(**SEMI)
    with pytest.raises(StrategyError, match="Softmax cannot split dim 1"):
        run(ops.Softmax(axis=-1).shard(((2, 4),)), jnp.ones((8, 8)))
    with pytest.raises(StrategyError, match="Add input 1: split 2 on dim 0 does not divide its size 1"):
        run(ops.Add().shard(((2, 4), (2, 1))), jnp.ones((8, 8)), jnp.ones((1, 8)))
    # the halves of each row of [8, 6] are no block of the 48 (a device would hold 0-2, 6-8, ...)
    with pytest.raises(StrategyError, match=r"input dim 1 \(size 6\) split 2 ways in \(1, 2\) is no block split of the "
                                            r"new shape \(48,\)"):
        run(ops.Reshape().shard(((1, 2),)), jnp.ones((8, 6)), (48,))


def test_shard_function_errors():
    ms.set_auto_parallel_context(**SEMI)
    f = ms.shard(lambda x, y: x + y, in_strategy=((2, 1),))
    with pytest.raises(StrategyError, match="in_strategy has 1 entries but the function is called with 2"):
        f(jnp.ones((4, 4)), jnp.ones((4, 4)))
    g = ms.shard(lambda x: x, in_strategy=((8, 1),))
    with pytest.raises(StrategyError, match="split 8 on dim 0 does not divide its size 12"):
        g(jnp.ones((12, 4)))
    with pytest.raises(StrategyError, match="in_strategy is required"):
        ms.shard(lambda x: x)


def test_layout_errors():
    with pytest.raises(LayoutError, match="alias_names .* must be 2 strings"):
        Layout((2, 4), ("dp",))
    with pytest.raises(LayoutError, match="must be distinct"):
        Layout((2, 4), ("dp", "dp"))
    lay = Layout((2, 4), ("dp", "mp"))
    with pytest.raises(LayoutError, match="unknown alias 'tp'"):
        lay("tp", "None")
    with pytest.raises(LayoutError, match="alias 'dp' is used twice"):
        lay("dp", "dp")
    ms.set_auto_parallel_context(**SEMI)
    other = Layout((4, 2), ("a", "b"))
    m1 = ops.MatMul().shard((lay("dp", "None"), lay("None", "mp")))
    m2 = ops.MatMul().shard((other("a", "None"), other("None", "b")))
    with pytest.raises(LayoutError, match="one mesh per region"):
        ms.jit(lambda x, w, v: m2(m1(x, w), v))(jnp.ones((8, 8)), jnp.ones((8, 8)), jnp.ones((8, 8)))
    small = Layout((2, 2), ("a", "b"))
    m3 = ops.MatMul().shard((small("a", "None"), small("None", "b")))
    with pytest.raises(LayoutError, match="covers 4 devices but device_num=8"):
        run(m3, jnp.ones((8, 8)), jnp.ones((8, 8)))


def test_layout_inputs_disagree():
    ms.set_auto_parallel_context(**SEMI)
    lay = Layout((2, 4), ("dp", "mp"))
    mm = ops.MatMul().shard((lay("dp", "mp"), lay("None", "None")))
    with pytest.raises(StrategyError, match="inputs disagree on a shared dim"):
        run(mm, jnp.ones((8, 8)), jnp.ones((8, 8)))


class Net(nn.Cell):
    def __init__(self, rngs):
        self.dense1 = nn.Dense(8, 16, rngs=rngs)

    def __call__(self, x):
        return self.dense1(x)


def test_parameter_plan_key_matching_nothing():
    ms.set_auto_parallel_context(**SEMI)
    net = Net(nnx.Rngs(0))
    with pytest.raises(ParameterPlanError, match="'dense2.weight' matches no parameter") as info:
        net.shard(in_strategy=((8, 1),), parameter_plan={"dense2.weight": (1, 8)})
    assert "dense1.weight" in str(info.value)
    # ('dense1.kernel', flax's name, finds dense1.weight: tests/e2e/training/test_plain_modules.py)
    with pytest.raises(ParameterPlanError, match="'dense1.wieght' matches no parameter"):
        f = ms.shard(lambda n, x: n(x), in_strategy=(None, (8, 1)), parameter_plan={"dense1.wieght": (1, 8)})
        ms.jit(f)(net, jnp.ones((8, 8)))
    with pytest.raises(StrategyError, match=r"parameter_plan\['dense1.weight'\].*split 3 on dim 1 does not divide"):
        f = ms.shard(lambda n, x: n(x), in_strategy=(None, (8, 1)), parameter_plan={"dense1.weight": (1, 3)})
        ms.jit(f)(net, jnp.ones((8, 8)))


def test_dataset_batch_not_divisible():
    ms.set_auto_parallel_context(parallel_mode="data_parallel")
    with pytest.raises(DatasetStrategyError, match="data input arg0: .*size is 12.*divisible by 8"):
        ms.jit(lambda x: x * 2)(jnp.ones((12, 3)))


def test_partition_spec_with_unknown_axis():
    ms.set_auto_parallel_context(**SEMI)
    from jax.sharding import PartitionSpec as P
    f = ms.shard(lambda x: x * 2, in_strategy=(P("dp", None),))
    with pytest.raises(LayoutError, match="axis 'dp' is not an axis of the region mesh"):
        f(jnp.ones((8, 8)))


def test_every_error_is_an_mshard_value_or_type_error():
    for cls in vars(ms.errors).values():
        if isinstance(cls, type) and issubclass(cls, MshardError) and cls is not MshardError:
            assert issubclass(cls, (ValueError, TypeError)), cls
