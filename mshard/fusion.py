"""Communication fusion: MindSpore's ``comm_fusion`` / ``all_reduce_fusion_config`` as gradient buckets.

>>> from mshard.fusion import plan_buckets
>>> plan_buckets([4, 4, 4, 4], "index", (1, 3))
[[0], [1, 2], [3]]
"""

from mshard._src.runtime.fusion import AUTO_THRESHOLD_MB as AUTO_THRESHOLD_MB
from mshard._src.runtime.fusion import fusion_setting as fusion_setting
from mshard._src.runtime.fusion import plan_buckets as plan_buckets

__all__ = [
    "AUTO_THRESHOLD_MB",
    "fusion_setting",
    "plan_buckets",
]
