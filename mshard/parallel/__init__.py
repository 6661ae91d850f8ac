"""``ms.parallel``: MindSpore 2.6's ``mindspore.parallel`` names (``AutoParallel``)."""

from .auto_parallel import AutoParallel as AutoParallel

__all__ = ["AutoParallel"]
