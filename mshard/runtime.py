"""MindSpore's ``mindspore.runtime``: ``set_memory`` (accepted; XLA sizes its own memory).

>>> from mshard import runtime
>>> runtime.set_memory(init_size="1GB")
"""

from mshard._src.values.run_mode import set_memory as set_memory

__all__ = ["set_memory"]
