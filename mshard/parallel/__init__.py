"""``ms.parallel``: MindSpore 2.6's ``mindspore.parallel`` names (``AutoParallel``)."""

from mshard._src.frontend.auto_parallel import AutoParallel as AutoParallel

__all__ = ["AutoParallel"]
