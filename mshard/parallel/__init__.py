"""``ms.parallel``: MindSpore 2.6's ``mindspore.parallel`` names (``AutoParallel``, ``Layout``, ``parallel.nn``).

>>> from mshard.parallel import AutoParallel, Layout
>>> Layout((2, 4), ("dp", "mp"))("dp", "mp").dims
(('dp',), ('mp',))
"""

from mshard._src.frontend.auto_parallel import AutoParallel as AutoParallel
from mshard._src.values.layout import Layout as Layout
from mshard.parallel import auto_parallel as auto_parallel
from mshard.parallel import nn as nn

__all__ = ["AutoParallel", "Layout", "auto_parallel", "nn"]
