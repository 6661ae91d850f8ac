"""MindSpore's ``mindspore.common.initializer``: ``initializer(init, shape, dtype)`` and the initializer classes.

>>> from mshard.common.initializer import initializer, Normal
>>> initializer(Normal(0.02), [3, 2]).shape
(3, 2)
"""

from mshard._src.frontend.parameter import Constant as Constant
from mshard._src.frontend.parameter import HeNormal as HeNormal
from mshard._src.frontend.parameter import HeUniform as HeUniform
from mshard._src.frontend.parameter import Initializer as Initializer
from mshard._src.frontend.parameter import Normal as Normal
from mshard._src.frontend.parameter import One as One
from mshard._src.frontend.parameter import TruncatedNormal as TruncatedNormal
from mshard._src.frontend.parameter import Uniform as Uniform
from mshard._src.frontend.parameter import XavierNormal as XavierNormal
from mshard._src.frontend.parameter import XavierUniform as XavierUniform
from mshard._src.frontend.parameter import Zero as Zero
from mshard._src.frontend.parameter import initializer as initializer

__all__ = [
    "Constant",
    "HeNormal",
    "HeUniform",
    "Initializer",
    "Normal",
    "One",
    "TruncatedNormal",
    "Uniform",
    "XavierNormal",
    "XavierUniform",
    "Zero",
    "initializer",
]
