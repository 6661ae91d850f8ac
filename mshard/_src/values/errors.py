"""One error hierarchy for mshard, rooted in :class:`MshardError`.

Every message names the op or parameter, the bad value, what was expected and the fix.
Each class subclasses ``ValueError`` or ``TypeError`` so existing ``except`` clauses work.

>>> import mshard as ms
>>> try:
...     ms.set_auto_parallel_context(parallel_mode="semi_auto")
... except ms.errors.ContextError as e:
...     print(type(e).__mro__[1].__name__)
MshardError
"""


from searchers.errors import MshardError, SearchError, SearchGraphError, SearchLimitError  # noqa: F401

# (the root and the searchers' errors live in searchers/, which never imports JAX: re-exported here)


class ContextError(MshardError, ValueError):
    """A bad key or value for set_auto_parallel_context / set_algo_parameters / set_cost_model_context.

    ``ms.set_auto_parallel_context(parallel_mode="semi_auto")`` -> unknown parallel_mode.
    """


class ContextTypeError(MshardError, TypeError):
    """A context value of the wrong type, e.g. ``device_num="8"``."""


class StrategyError(MshardError, ValueError):
    """A strategy that cannot hold: a split that does not divide the dim, a split product that does not
    divide device_num, inputs of one op that disagree on a shared dim, a strategy of the wrong length.

    ``ops.MatMul().shard(((2, 3), (3, 1)))`` on 8 devices -> 3 does not divide 8.
    """


class StrategyTypeError(MshardError, TypeError):
    """A strategy that is not a tuple of positive ints, a Layout call, a PartitionSpec or a NamedSharding."""


class LayoutError(MshardError, ValueError):
    """A bad Layout: unknown alias, alias used twice in one tensor, device matrix not matching device_num."""


class ParameterPlanError(MshardError, ValueError):
    """A parameter_plan key that matches no parameter, or a plan that does not fit the parameter."""


class DatasetStrategyError(MshardError, ValueError):
    """A dataset_strategy that does not fit the batch (rank, divisibility)."""


class PlanError(MshardError, ValueError):
    """A strategy file or plan that cannot be read or does not fit the region."""


class CheckpointError(MshardError, ValueError):
    """A checkpoint whose strategy or shapes do not match, or a corrupt/truncated checkpoint."""


class OptimizerParallelError(MshardError, ValueError):
    """A parallel optimizer setting that cannot hold, e.g. ``optimizer_weight_shard_size=8`` when the batch is
    split only 4 ways (the shard size must not exceed the data-parallel size)."""


class CheckpointTypeError(MshardError, TypeError):
    """A checkpoint call given an object it cannot save or load into (not an nnx Module, Cell or
    TrainOneStepCell), or a metadata value that is not JSON."""


class CellError(MshardError, ValueError):
    """A layer or training cell given a value it cannot use: ``Dropout(p=1.5)``, ``num_heads`` that does not
    divide ``hidden_size``, a batch that does not split into the replicas' micro-batches."""


class CellTypeError(MshardError, TypeError):
    """A layer or training cell called with the wrong kind of argument."""


class RegionTypeError(MshardError, TypeError):
    """An ``ms.jit`` region called in a way it does not support (keyword arguments, say)."""


class CommFusionWarning(UserWarning):
    """A comm_fusion / all_reduce_fusion_config setting that a step cannot apply (a step planned by a search,
    whose gradient reductions XLA places and fuses)."""


class GradientsMeanWarning(UserWarning):
    """``gradients_mean=False`` with data-parallel replicas: MindSpore would sum the replicas' gradients; mshard
    computes the gradient of the global-batch loss in every route (README, "Gradients")."""


class StrategyIgnoredWarning(UserWarning):
    """User strategies found in a region whose parallel_mode ignores them (data_parallel, stand_alone)."""


__all__ = [
    "CellError",
    "CellTypeError",
    "CheckpointError",
    "CheckpointTypeError",
    "CommFusionWarning",
    "ContextError",
    "ContextTypeError",
    "DatasetStrategyError",
    "GradientsMeanWarning",
    "LayoutError",
    "MshardError",
    "OptimizerParallelError",
    "ParameterPlanError",
    "PipelineError",
    "PlanError",
    "RegionTypeError",
    "StrategyError",
    "StrategyIgnoredWarning",
    "StrategyTypeError",
]


class PipelineError(MshardError, ValueError):
    """A pipeline setting that cannot run: ``micro_size`` smaller than ``pipeline_stages``, a ``pipeline_stage`` out
    of range, an empty stage, a batch that does not split into the micro-batches, ``pipeline_stages > 1`` without a
    ``PipelineCell``/``Pipeline``."""
