"""mshard.ops: MindSpore-style primitive objects and ``ops.shard``."""

from ..shard import shard as shard
from .comm import AllGather as AllGather, AllReduce as AllReduce, AlltoAll as AlltoAll, ReduceScatter as ReduceScatter
from .primitive import Primitive as Primitive
from .primitives import (Add as Add, AvgPool as AvgPool, BatchMatMul as BatchMatMul, BatchNorm as BatchNorm,
                         BiasAdd as BiasAdd, Cast as Cast, Concat as Concat, Conv2D as Conv2D, Exp as Exp,
                         ExpandDims as ExpandDims, Gather as Gather, GeLU as GeLU, LayerNorm as LayerNorm, Log as Log,
                         LogSoftmax as LogSoftmax, MatMul as MatMul, Maximum as Maximum, MaxPool as MaxPool,
                         Minimum as Minimum, Mul as Mul, OneHot as OneHot, RealDiv as RealDiv, ReduceMax as ReduceMax,
                         ReduceMean as ReduceMean, ReduceSum as ReduceSum, ReLU as ReLU, Reshape as Reshape,
                         Sigmoid as Sigmoid, Softmax as Softmax,
                         SoftmaxCrossEntropyWithLogits as SoftmaxCrossEntropyWithLogits, Sqrt as Sqrt, Square as Square,
                         Squeeze as Squeeze, StridedSlice as StridedSlice, Sub as Sub, Tanh as Tanh,
                         Transpose as Transpose)
