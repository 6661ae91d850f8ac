"""mshard.ops: MindSpore-style primitive objects and ``ops.shard``."""

from mshard._src.frontend.comm_ops import AllGather as AllGather
from mshard._src.frontend.comm_ops import AllReduce as AllReduce
from mshard._src.frontend.comm_ops import AlltoAll as AlltoAll
from mshard._src.frontend.comm_ops import Broadcast as Broadcast
from mshard._src.frontend.comm_ops import ReduceScatter as ReduceScatter
from mshard._src.frontend.comm_ops import SendReceive as SendReceive
from mshard._src.frontend.debug_print import Print as Print
from mshard._src.frontend.functional import GradOperation as GradOperation
from mshard._src.frontend.layers import DropoutOp as Dropout
from mshard._src.frontend.primitive_base import Primitive as Primitive
from mshard._src.frontend.primitive_ops import Add as Add
from mshard._src.frontend.primitive_ops import AvgPool as AvgPool
from mshard._src.frontend.primitive_ops import BatchMatMul as BatchMatMul
from mshard._src.frontend.primitive_ops import BatchNorm as BatchNorm
from mshard._src.frontend.primitive_ops import BiasAdd as BiasAdd
from mshard._src.frontend.primitive_ops import Cast as Cast
from mshard._src.frontend.primitive_ops import Concat as Concat
from mshard._src.frontend.primitive_ops import Conv2D as Conv2D
from mshard._src.frontend.primitive_ops import Exp as Exp
from mshard._src.frontend.primitive_ops import ExpandDims as ExpandDims
from mshard._src.frontend.primitive_ops import Flatten as Flatten
from mshard._src.frontend.primitive_ops import Gather as Gather
from mshard._src.frontend.primitive_ops import GeLU as GeLU
from mshard._src.frontend.primitive_ops import LayerNorm as LayerNorm
from mshard._src.frontend.primitive_ops import Log as Log
from mshard._src.frontend.primitive_ops import LogSoftmax as LogSoftmax
from mshard._src.frontend.primitive_ops import MatMul as MatMul
from mshard._src.frontend.primitive_ops import Maximum as Maximum
from mshard._src.frontend.primitive_ops import MaxPool as MaxPool
from mshard._src.frontend.primitive_ops import Minimum as Minimum
from mshard._src.frontend.primitive_ops import Mul as Mul
from mshard._src.frontend.primitive_ops import OneHot as OneHot
from mshard._src.frontend.primitive_ops import RealDiv as RealDiv
from mshard._src.frontend.primitive_ops import ReduceMax as ReduceMax
from mshard._src.frontend.primitive_ops import ReduceMean as ReduceMean
from mshard._src.frontend.primitive_ops import ReduceSum as ReduceSum
from mshard._src.frontend.primitive_ops import ReLU as ReLU
from mshard._src.frontend.primitive_ops import Reshape as Reshape
from mshard._src.frontend.primitive_ops import Sigmoid as Sigmoid
from mshard._src.frontend.primitive_ops import Softmax as Softmax
from mshard._src.frontend.primitive_ops import SoftmaxCrossEntropyWithLogits as SoftmaxCrossEntropyWithLogits
from mshard._src.frontend.primitive_ops import Sqrt as Sqrt
from mshard._src.frontend.primitive_ops import Square as Square
from mshard._src.frontend.primitive_ops import Squeeze as Squeeze
from mshard._src.frontend.primitive_ops import StridedSlice as StridedSlice
from mshard._src.frontend.primitive_ops import Sub as Sub
from mshard._src.frontend.primitive_ops import Tanh as Tanh
from mshard._src.frontend.primitive_ops import Transpose as Transpose
from mshard._src.frontend.shard import shard as shard
from mshard._src.values.names import missing_names

__all__ = [
    "Add",
    "AllGather",
    "AllReduce",
    "AlltoAll",
    "AvgPool",
    "BatchMatMul",
    "BatchNorm",
    "BiasAdd",
    "Broadcast",
    "Cast",
    "Concat",
    "Conv2D",
    "Dropout",
    "Exp",
    "ExpandDims",
    "Flatten",
    "Gather",
    "GeLU",
    "GradOperation",
    "LayerNorm",
    "Log",
    "LogSoftmax",
    "MatMul",
    "MaxPool",
    "Maximum",
    "Minimum",
    "Mul",
    "OneHot",
    "Primitive",
    "Print",
    "ReLU",
    "RealDiv",
    "ReduceMax",
    "ReduceMean",
    "ReduceScatter",
    "ReduceSum",
    "Reshape",
    "SendReceive",
    "Sigmoid",
    "Softmax",
    "SoftmaxCrossEntropyWithLogits",
    "Sqrt",
    "Square",
    "Squeeze",
    "StridedSlice",
    "Sub",
    "Tanh",
    "Transpose",
    "shard",
]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
