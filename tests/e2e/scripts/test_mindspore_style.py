"""examples/mindspore_style/: MindSpore tutorial-style scripts (issue 41), each equal to one device.

Each script's ``main(parallel)`` trains with MindSpore's idiom; run with its strategies on 8 devices and again
stand-alone on one device (the same script: mshard ignores strategies there and runs plain JAX), every loss and
every parameter must agree."""

import importlib.util
import sys
import warnings

import numpy as np
import pytest
from helpers import ROOT

from mshard.errors import StrategyIgnoredWarning

# float32 SGD over 4 steps of a 784-512-512-10 MLP: the sharded matmuls sum 784/512-term dot products in another
# order (relative rounding ~1e-6 each); the loss and the updated weights agree to ~1e-5 relative
SCRIPTS = ROOT / "examples" / "mindspore_style"
TOL = dict(rtol=2e-5, atol=2e-6)


def _script(name):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))              # the scripts' shared _common.py, as when run as scripts
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("name", ["operator_parallel", "operator_parallel_layout", "data_parallel", "model_train",
                                  "sharding_propagation", "gradient_accumulation", "optimizer_parallel",
                                  "multiple_copy", "recompute", "pipeline", "checkpoint"])
def test_mindspore_style_script_equals_one_device(name):
    """``main`` returns (losses or the trained model's logits, {parameter: value})."""
    mod = _script(name)
    out, params = mod.main(parallel=True, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StrategyIgnoredWarning)     # stand-alone ignores the strategies, and says so
        ref_out, ref_params = mod.main(parallel=False, verbose=False)
        _, init = _fresh(mod)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), **TOL)
    assert params.keys() == ref_params.keys() and len(params) > 0
    for k in params:
        np.testing.assert_allclose(params[k], ref_params[k], err_msg=k, **TOL)
    assert any(not np.array_equal(params[k], init[k]) for k in params)       # it trained


def _fresh(mod):
    """The script's parameters before training (its seed, no step run)."""
    return mod.main(parallel=False, verbose=False, **{"epochs" if "epochs" in mod.main.__code__.co_varnames
                                                      else "steps": 0})


@pytest.mark.slow
def test_the_functional_pipeline_step_runs_its_schedule_between_stage_groups():
    """pipeline.py's ``@ms.jit`` step (value_and_grad over a ``Pipeline`` cell, ``optimizer(grads)``) under
    ``AutoParallel(...).pipeline(stages=2)`` is compiled as a pipeline: stage 0's devices send their activations
    to stage 1's and receive their gradients back, ``collective-permute``s in the HLO. A data-parallel step has
    none (its gradient sum is an all-reduce), and the same step without the pipeline is refused (ContextError)."""
    import jax.numpy as jnp

    import mshard as ms

    mod = _script("pipeline")
    parallel_net, net = mod.build(parallel=True)
    image, label = jnp.zeros((32, 1, 28, 28)), jnp.zeros((32,), jnp.int32)
    with ms.parallel_context(**parallel_net.settings):
        hlo = parallel_net.network.lower(image, label).compile().as_text()
    parallel_net(image, label)
    ms.reset_auto_parallel_context()
    sends = [ln for ln in hlo.splitlines() if "collective-permute" in ln and "=" in ln]
    assert len(sends) >= 2, hlo[-3000:]
    # every parameter belongs to one stage, so it is stored split over the 2 stage groups on dim 0 (each device
    # holds half), as TrainOneStepCell(PipelineCell) stores it; stand-alone, each is whole
    for p in net.trainable_params():
        a = p[...]
        assert a.sharding.shard_shape(a.shape) == (a.shape[0] // 2, *a.shape[1:]), (p.name, a.sharding)


@pytest.mark.slow
def test_the_functional_optimizer_parallel_step_keeps_an_eighth_of_momentums_state_per_device():
    """optimizer_parallel.py's ``@ms.jit`` step under ``enable_parallel_optimizer=True``: after a step, every weight
    of at least 64 KB and its Momentum state are stored with dim 0 split 8 ways (each device holds 1/8), as
    MindSpore's optimizer parallel stores parameter slices; the forward gathers each such weight whole (one
    all-gather per weight in the HLO). Without optimizer parallel the state is whole on every device."""
    import jax.numpy as jnp

    mod = _script("optimizer_parallel")
    step, _, optimizer = mod.build(parallel=True)
    x, y = jnp.zeros((32, 1, 28, 28)), jnp.zeros((32,), jnp.int32)
    step(x, y)
    big = [v for v in optimizer.state_variables() if v[...].size * 4 >= 64 * 1024]
    assert len(big) == 4           # layer1's and layer2's weights ([512, 784], [512, 512]) and their momenta
    for v in big:
        a = v[...]
        assert a.sharding.shard_shape(a.shape) == (a.shape[0] // 8, *a.shape[1:]), (a.shape, a.sharding)
    hlo = step.lower(x, y).compile().as_text()
    gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln and "=" in ln]
    assert sorted(ln.split("=")[1].split("all-gather")[0].strip().split("{")[0] for ln in gathers) == \
        ["f32[512,512]", "f32[512,784]"]
    import mshard as ms
    ms.reset_auto_parallel_context()
