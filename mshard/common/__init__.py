"""``mshard.common``: MindSpore's ``mindspore.common`` import paths (``initializer``, ``Parameter``, ``Tensor``).

>>> from mshard.common.initializer import initializer
>>> initializer("ones", [2]).tolist()
[1.0, 1.0]
"""

from mshard._src.frontend.parameter import Parameter as Parameter
from mshard._src.frontend.parameter import Tensor as Tensor
from mshard.common import initializer as initializer

__all__ = ["Parameter", "Tensor", "initializer"]
