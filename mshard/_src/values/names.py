"""What a MindSpore user meets when a name is not offered: the module's ``__getattr__`` raises an AttributeError that
says so, names the MindSpore concept, and gives the mshard way or the nearest name.

>>> getattr_ = missing_names("mshard.ops", ["MatMul", "ReLU"])
>>> try:
...     getattr_("Depend")
... except AttributeError as e:
...     print(str(e)[:65])
module 'mshard.ops' has no attribute 'Depend': MindSpore's Depend
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NoReturn

from mshard._src.values.context import did_you_mean

_READER = ("file readers are not offered; read the files yourself (numpy) and wrap the arrays in "
           "ms.dataset.NumpySlicesDataset or GeneratorDataset")
NOT_OFFERED: dict[str, dict[str, str]] = {
    "mshard.dataset": {n: _READER for n in (
        "MnistDataset", "Cifar10Dataset", "Cifar100Dataset", "ImageFolderDataset", "MindDataset", "TFRecordDataset",
        "CSVDataset", "TextFileDataset", "CocoDataset", "VOCDataset", "CelebADataset")},
    "mshard.ops": {
        "Depend": "JAX orders effects by data dependence itself; drop it",
    },
    "mshard.nn": {
        "TrainOneStepWithLossScaleCell": "use nn.TrainOneStepCell with the optimizer's loss_scale (a fixed scale)",
        "DynamicLossScaleUpdateCell": "dynamic loss scaling is not offered; use a fixed loss_scale on the optimizer",
        "FixedLossScaleUpdateCell": "use the optimizer's loss_scale",
        "Accuracy": "metrics live in mshard.train (Accuracy, Loss), as in MindSpore 2.x",
    },
    "mshard": {
        "amp": "mixed precision is not offered as a module; give the parameters a dtype (ms.float16, ms.bfloat16)",
        "export": "exporting MindIR is not offered; jax.export exports a jitted function",
        "load": "loading MindIR is not offered",
    },
}


def missing_names(module: str, names: Iterable[str]) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` for ``module``, whose public names are ``names``.

    Args:
        module: the module's dotted name.
        names: its public names (for the nearest-name hint).

    Returns:
        The ``__getattr__`` function: it always raises AttributeError.
    """
    known = tuple(names)

    def __getattr__(name: str) -> NoReturn:
        hint = NOT_OFFERED.get(module, {}).get(name)
        if hint is not None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}: MindSpore's {name} is not offered; "
                                 f"{hint}.")
        near = "" if name.startswith("_") else did_you_mean(name, known)
        raise AttributeError(f"module {module!r} has no attribute {name!r}.{near}")

    return __getattr__
