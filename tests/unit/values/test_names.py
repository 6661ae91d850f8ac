"""A MindSpore name mshard does not offer says so and what to use; a misspelt one gets the nearest name."""

import pytest

import mshard as ms


@pytest.mark.parametrize("module, name, says", [
    (ms.ops, "Depend", "orders effects by data dependence"),
    (ms.dataset, "MnistDataset", "file readers are not offered"),
    (ms.nn, "DynamicLossScaleUpdateCell", "use a fixed loss_scale"),
    (ms, "amp", "give the parameters a dtype"),
])
def test_a_name_not_offered_says_what_to_use(module, name, says):
    with pytest.raises(AttributeError, match=f"MindSpore's {name} is not offered; .*{says}"):
        getattr(module, name)


def test_a_misspelt_name_gets_the_nearest_one_and_imports_still_fail_cleanly():
    with pytest.raises(AttributeError, match="Did you mean 'Dense'"):
        ms.nn.Dence                                   # noqa: B018
    with pytest.raises(ImportError, match="MnistDataset"):
        from mshard.dataset import MnistDataset  # noqa: F401
    assert not hasattr(ms.nn, "__wrapped__")          # dunder probes (inspect, doctest) see a plain AttributeError
