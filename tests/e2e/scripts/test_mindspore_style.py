"""examples/mindspore_style/: MindSpore tutorial-style scripts (issue 41), each equal to one device.

Each script's ``main(parallel)`` trains with MindSpore's idiom; run with its strategies on 8 devices and again
stand-alone on one device (the same script: mshard ignores strategies there and runs plain JAX), every loss and
every parameter must agree."""

import importlib.util

import numpy as np
import pytest
from helpers import ROOT

from mshard.errors import StrategyIgnoredWarning

# float32 SGD over 4 steps of a 784-512-512-10 MLP: the sharded matmuls sum 784/512-term dot products in another
# order (relative rounding ~1e-6 each); the loss and the updated weights agree to ~1e-5 relative
TOL = dict(rtol=2e-5, atol=2e-6)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "mindspore_style" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("name", ["operator_parallel"])
def test_mindspore_style_script_equals_one_device(name):
    mod = _script(name)
    losses, params = mod.main(parallel=True, verbose=False)
    with pytest.warns(StrategyIgnoredWarning):        # stand-alone ignores the strategies, and says so
        ref_losses, ref_params = mod.main(parallel=False, verbose=False)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert params.keys() == ref_params.keys() and len(params) > 0
    for k in params:
        np.testing.assert_allclose(params[k], ref_params[k], err_msg=k, **TOL)
    assert losses[-1] != losses[0]            # it trained
