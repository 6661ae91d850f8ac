"""``mshard.parallel.auto_parallel``: MindSpore 2.6's import path of ``AutoParallel``.

>>> from mshard.parallel.auto_parallel import AutoParallel
>>> AutoParallel.__name__
'AutoParallel'
"""

from mshard._src.frontend.auto_parallel import AutoParallel as AutoParallel

__all__ = ["AutoParallel"]
