"""``ms.communication``: join the job's processes with MindSpore's ``mindspore.communication`` names.

>>> from mshard.communication import get_rank, get_group_size
>>> get_rank(), get_group_size() >= 1
(0, True)
"""

from mshard._src.values.communication import detect as detect
from mshard._src.values.communication import get_group_size as get_group_size
from mshard._src.values.communication import get_local_rank as get_local_rank
from mshard._src.values.communication import get_rank as get_rank
from mshard._src.values.communication import init as init
from mshard._src.values.communication import release as release

__all__ = [
    "detect",
    "get_group_size",
    "get_local_rank",
    "get_rank",
    "init",
    "release",
]
