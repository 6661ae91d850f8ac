"""MindSpore's ``mindspore.nn.utils``: ``no_init_parameters``.

>>> from mshard.nn.utils import no_init_parameters
>>> with no_init_parameters():
...     pass
"""

from mshard._src.frontend.parameter import no_init_parameters as no_init_parameters

__all__ = ["no_init_parameters"]
