"""Pipeline parallel with MindSpore's names: ``nn.PipelineCell(net_with_loss, micro_size)`` and
``nn.Pipeline(net_with_loss, micro_size, stage_config={"blocks.0": 0, ...})``.

>>> import jax.numpy as jnp, optax, mshard as ms
>>> from flax import nnx
>>> from mshard import nn
>>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2,
...                              gradients_mean=True)
>>> class Two(nn.Cell):
...     def __init__(self):
...         self.a, self.b = nn.Dense(4, 8, rngs=nnx.Rngs(0)), nn.Dense(8, 2, rngs=nnx.Rngs(1))
...         self.a.pipeline_stage, self.b.pipeline_stage = 0, 1
...     def __call__(self, x):
...         return self.b(jnp.tanh(self.a(x)))
>>> step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(Two(), nn.MSELoss()), micro_size=4), optax.sgd(0.1))
>>> float(step(jnp.ones((16, 4)), jnp.zeros((16, 2)))) > 0
True
>>> ms.reset_auto_parallel_context()

Under :class:`~mshard.nn.TrainOneStepCell` the devices split into ``pipeline_stages`` stage groups along mesh axes
of the step's mesh (the first axes whose sizes multiply to the stage count); the rest of the mesh is data parallel
inside each stage: without operator strategies, each device runs its replica of the stage on its rows of every
micro-batch and the gradients are summed over the replicas once per step (MindSpore's data parallel, whose loss and
gradient are the replicas' mean: a batch-mean loss's, as one device computes it). The batch is cut into
``micro_size`` micro-batches (micro-batch ``k`` holds rows ``k, k + micro_size, ...``, as
:class:`~mshard.nn.GradAccumulationCell`), the network's forward is cut into stage functions
(:mod:`mshard._src.training.pipeline.stages`) and the schedule of ``pipeline_config`` runs as one SPMD program
(:mod:`mshard._src.training.pipeline.run`): ``pipeline_scheduler="gpipe"`` or ``"1f1b"`` (default), and with
``pipeline_interleave=True`` Megatron's interleaved 1F1B over the chunks that ``cell.pipeline_segment`` numbers. The
step's loss is the mean of the micro-batch losses and its gradient that mean's gradient (for a mean-reduced loss:
the full batch's, as one device computes), whatever ``gradients_mean`` says (README, "Gradients").

The cells' operator strategies hold inside a stage: they are planned on one stage's devices, and the parameters,
their optimizer state and gradients are stored in those layouts. Every schedule keeps each forward's residuals
until its backward (memory grows with the micro-batches in flight: all ``M`` for gpipe, at most ``S`` for 1f1b);
a cell with ``recompute()`` keeps only its inputs and is recomputed at backward time, so the recompute setting
decides what is recomputed (:mod:`mshard._src.training.pipeline.run` gives the measured trade-off).

Composition: :class:`~mshard.nn.MicroBatchInterleaved` goes inside the PipelineCell (each micro-batch runs as
interleaved slices); :class:`~mshard.nn.GradAccumulationCell` goes outside it (``n`` whole pipeline passes per
step, gradients averaged); inside it would loop over micro-batches across the stages, which is an error.

Parameter memory drops with the stage count (:mod:`mshard._src.training.pipeline.storage`): a parameter that one stage alone
uses is stored split over the stage axes on one dim (every device holds ``1/S`` of it, and of its optimizer state),
an ordinary ``jax.Array`` of its own shape that reads, saves and runs eagerly like any other; inside the step one
``all_to_all`` brings each stage its own parameters whole and sends their gradients back split. A parameter several
stages use (a tied embedding and head) is stored whole on every stage and its gradient summed over the stages, so
the stages hold the same value after every update.

Called outside a training step, a PipelineCell runs its micro-batches one after another and returns the mean loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mshard._src.frontend.cell import Cell
from mshard._src.frontend.wrapper_cells import GradAccumulationCell, MicroBatchInterleaved, _split_rows, check_rows
from mshard._src.jaxpr import marks
from mshard._src.training.pipeline.report import build_report, with_layouts
from mshard._src.training.pipeline.run import ring_size, run_gpipe_keeping_residuals, run_pipeline
from mshard._src.training.pipeline.schedule import make_schedule
from mshard._src.training.pipeline.stages import cut
from mshard._src.training.pipeline.storage import StageStorage
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import PipelineError
from mshard._src.values.layout import choose_axes, dims_of, jax_mesh, prime_mesh

__all__ = ["Pipeline", "PipelineCell", "PipelinePlan"]


class PipelineCell(Cell):
    """``PipelineCell(network, micro_size)``: ``network`` (a network with loss) trained in ``pipeline_stages``
    stages over ``micro_size`` micro-batches (module doc). ``micro_size`` must be at least ``pipeline_stages``.

    As in MindSpore, each sub-Cell's ``pipeline_stage`` says which stage runs it, and
    :class:`~mshard.nn.TrainOneStepCell` runs the schedule (``pipeline_config``: gpipe, 1f1b, interleaved).
    Micro-batch ``k`` holds rows ``k, k + micro_size, ...``; the loss is the mean of the micro-batch losses.
    Called outside a training step it runs the micro-batches one after another and returns that mean.

    Args:
        network: the network with loss (e.g. :class:`~mshard.nn.WithLossCell`); every array input's dim 0 must
            be divisible by ``micro_size``.
        micro_size: the number of micro-batches (a positive int, at least ``pipeline_stages``).
        stage_config: cell path -> stage, instead of ``pipeline_stage`` (what :class:`Pipeline` passes), or None.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> x, y = jnp.arange(16.0).reshape(4, 4), jnp.zeros((4, 2))
    >>> net_with_loss = nn.WithLossCell(nn.Dense(4, 2, rngs=nnx.Rngs(0)), nn.MSELoss())
    >>> bool(jnp.allclose(nn.PipelineCell(net_with_loss, micro_size=2)(x, y), net_with_loss(x, y)))
    True
    """

    def __init__(self, network: nnx.Module, micro_size: int, stage_config: dict[str, int] | None = None):
        if not isinstance(micro_size, int) or isinstance(micro_size, bool) or micro_size < 1:
            raise PipelineError(f"PipelineCell: micro_size={micro_size!r} must be a positive int.")
        self.network = network
        self.micro_size = micro_size
        # a hashable static attribute (it is part of the graph definition)
        self.stage_config = tuple(sorted(stage_config.items())) if stage_config else None

    def __call__(self, *inputs):
        n = self.micro_size
        for x in inputs:
            if hasattr(x, "shape") and x.ndim and x.shape[0] % n:
                raise PipelineError(_batch_message(x.shape, n))
        if _differentiated_in_hand_written_step(self):
            return _scheduled_loss(self, inputs)
        return _sequential(self, inputs)


class Pipeline(PipelineCell):
    """``Pipeline(network, micro_size, stage_config=None)``: MindSpore's newer form, the stages given by cell path
    (``{"embedding": 0, "blocks.0": 0, "blocks.1": 1, "head": 1}``) or, without ``stage_config``, by each cell's
    ``pipeline_stage`` as in :class:`PipelineCell`.

    Otherwise a :class:`PipelineCell`; the paths are attribute paths inside ``network`` (so
    ``"backbone.<path>"`` under a :class:`~mshard.nn.WithLossCell`).

    Args:
        network: the network with loss; every array input's dim 0 must be divisible by ``micro_size``.
        micro_size: the number of micro-batches (a positive int, at least ``pipeline_stages``).
        stage_config: a non-empty dict of cell path -> stage, or None (the cells' ``pipeline_stage``).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> class Two(nn.Cell):
    ...     def __init__(self):
    ...         self.a, self.b = nn.Dense(4, 8, rngs=nnx.Rngs(0)), nn.Dense(8, 2, rngs=nnx.Rngs(1))
    ...     def __call__(self, x):
    ...         return self.b(jnp.tanh(self.a(x)))
    >>> p = nn.Pipeline(nn.WithLossCell(Two(), nn.MSELoss()), 2, {"backbone.a": 0, "backbone.b": 1})
    >>> p.stage_config, p(jnp.ones((4, 4)), jnp.zeros((4, 2))).shape
    ((('backbone.a', 0), ('backbone.b', 1)), ())
    """

    def __init__(self, network: nnx.Module, micro_size: int = 1, stage_config: dict[str, int] | None = None):
        if stage_config is not None and (not isinstance(stage_config, dict) or not stage_config):
            raise PipelineError(f"nn.Pipeline: stage_config must be a non-empty dict of cell path -> stage, got "
                                f"{stage_config!r}.")
        super().__init__(network, micro_size, stage_config)


def _sequential(cell: PipelineCell, inputs: tuple) -> Any:
    """The micro-batches one after another on the caller's devices; the mean of their losses."""
    n = cell.micro_size
    outs = [cell.network(*[x[k::n] if hasattr(x, "shape") and x.ndim else x for x in inputs]) for k in range(n)]
    return jax.tree.map(lambda *o: sum(o[1:], o[0]) / n, *outs)


# the tracers of JAX's differentiation: JVP, and the direct linearization jax.vjp / value_and_grad use by default
_DIFFERENTIATING = tuple(t for t in (getattr(jax._src.interpreters.ad, n, None) for n in ("JVPTracer", "LinearizeTracer"))
                         if t is not None)


def _differentiated_in_hand_written_step(cell: PipelineCell) -> bool:
    """Whether this call is MindSpore's functional pipeline step: inside an ``ms.jit`` training step written by
    hand (``value_and_grad`` + ``optimizer(grads)``, mshard._src.frontend.functional), under
    ``pipeline_stages > 1``, with the network's parameters being differentiated."""
    record = marks.current_region()
    ctx = ctxmod.current()
    if record is None or not record.hand_written or ctx.pipeline_stages <= 1 or ctx.parallel_mode == "stand_alone":
        return False
    leaves = jax.tree.leaves(nnx.as_pure(nnx.state(cell.network, nnx.Param)))
    return any(isinstance(x, _DIFFERENTIATING) for x in leaves)


def _scheduled_loss(cell: PipelineCell, inputs: tuple) -> Any:
    """The PipelineCell's loss whose gradient is the pipeline schedule's: MindSpore's functional pipeline step
    (``ms.value_and_grad`` over a function that calls the PipelineCell, inside ``ms.jit``).

    The schedule computes the loss and the parameters' gradient together (its backward interleaves with the
    forward: 1F1B), so it runs as the forward of a ``jax.custom_vjp`` whose backward scales the gradient it
    already has by the loss's cotangent. The stages are cut on the step's whole mesh (``prime_mesh`` of the
    context's devices); the rest of the step (the optimizer update) is planned around it as usual. The schedule's
    ``shard_map`` is on the region's mesh, so its parameter layouts are fixed in the region's plan: a parameter one
    stage owns is stored split over the stage axes, as under TrainOneStepCell. Gradients with respect to the
    PipelineCell's inputs are not computed (zero), as in MindSpore's pipeline, which differentiates the weights."""
    ctx = ctxmod.current()
    record = marks.current_region()
    record.pipelines.append(type(cell).__name__)
    data = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in inputs)
    with marks.recording_into(None):            # the stage cut traces the network on its own
        pplan = pipeline_plan(cell, data, prime_mesh(ctx.devices), ctx)
    graphdef, params, rest = nnx.split(cell, nnx.Param, ...)
    p_leaves, p_tree = jax.tree.flatten(nnx.as_pure(params))

    def rebuild(leaves):
        return nnx.merge(graphdef, nnx.State(jax.tree.unflatten(p_tree, list(leaves))), rest)

    @jax.custom_vjp
    def loss_of(leaves, xs):
        return _sequential(rebuild(leaves), xs)

    def forward(leaves, xs):
        loss, g = pipeline_grads(rebuild(leaves), xs, pplan)
        return loss, jax.tree.leaves(g)

    def backward(grads, ct):
        return [g * ct for g in grads], jax.tree.map(lambda _: None, inputs)    # no input gradient (docstring)

    loss_of.defvjp(forward, backward)
    return loss_of(p_leaves, inputs)


def _batch_message(shape, n: int) -> str:
    return (f"PipelineCell: the batch dim {shape[0]} (input shape {tuple(shape)}) is not divisible by micro_size "
            f"{n}; use a batch size that is a multiple of {n}, or a micro_size that divides {shape[0]}.")


def _accumulated_pipeline(cell: Any) -> bool:
    return isinstance(cell, GradAccumulationCell) and isinstance(cell.network, PipelineCell)


def check_pipeline(ctx, cell: Any) -> None:
    """The pipeline settings errors that do not need the network traced."""
    S = ctx.pipeline_stages
    if _accumulated_pipeline(cell):
        cell = cell.network
    if isinstance(cell, PipelineCell):
        for path, m in nnx.iter_graph(cell.network):
            if isinstance(m, GradAccumulationCell):
                where = ".".join(map(str, path)) or "the network"
                raise PipelineError(
                    f"a GradAccumulationCell ({where}) inside a PipelineCell: its micro-batch loop would span the "
                    f"stages. Put it outside, nn.TrainOneStepCell(nn.GradAccumulationCell(nn.PipelineCell("
                    f"net_with_loss, micro_size), n), optimizer) (n pipeline passes per step), or raise micro_size.")
    if S > 1 and not isinstance(cell, PipelineCell):
        raise PipelineError(f"pipeline_stages={S}, but the training step's network is a {type(cell).__name__}, not "
                            f"a PipelineCell: wrap the network with loss, e.g. nn.TrainOneStepCell(nn.PipelineCell("
                            f"net_with_loss, micro_size={2 * S}), optimizer), or set pipeline_stages=1.")
    if isinstance(cell, PipelineCell) and cell.micro_size < S:
        raise PipelineError(f"PipelineCell: micro_size={cell.micro_size} is smaller than pipeline_stages={S}; "
                                f"every stage needs a micro-batch in flight: use micro_size >= {S} (2x or more "
                                f"lowers the bubble (S-1)/(M+S-1)).")


def _stage_axes(rmesh, S: int) -> tuple[str, ...] | None:
    """The stage axes: the outermost mesh axes whose sizes multiply to ``S`` (the axes between hosts, where the
    slow links are: one process's devices stay in one stage), else any axes that do."""
    prod = 1
    for k, n in enumerate(rmesh.shape):
        prod *= n
        if prod == S:
            return tuple(rmesh.names[:k + 1])
        if prod > S:
            break
    return choose_axes(S, list(rmesh.names), rmesh)


@dataclass
class PipelinePlan:
    """What a pipelined step runs, decided before the step is traced (:func:`pipeline_plan`): the stage program
    cut from the network, the schedule, the stage axes, and the parameters' layouts inside a stage."""

    prog: Any                      # mshard._src.training.pipeline.stages.StageProgram
    sched: Any                     # mshard._src.training.pipeline.schedule.Schedule
    stage_axes: tuple[str, ...]
    jmesh: Any                     # the step's jax mesh
    dp: int                        # the data-parallel size inside a stage
    specs: list | None             # PartitionSpec per Param leaf inside a stage (where the cells carry strategies)
    dims: list                     # per Param leaf, its stored layout (DimAxes): the in-stage layout, and the
                                   # stage axes on its stage dim for a parameter one stage owns
    runner: Any                    # run_pipeline or run_gpipe_keeping_residuals
    report: Any                    # mshard._src.training.pipeline.report.PipelineReport
    parts: int = 1                 # GradAccumulationCell(PipelineCell, n): n whole pipeline passes per step
    storage: Any = None            # mshard._src.training.pipeline.storage.StageStorage: which stage owns each parameter
    data_specs: list | None = None     # per micro-batch data leaf, its PartitionSpec inside a stage
    carry_specs: list | None = None    # per carry slot (activation handed on), its PartitionSpec inside a stage
    param_avals: list | None = None    # per Param leaf, its shape and dtype (what the pipeline's collectives move)
    replicas: tuple[str, ...] = ()     # the data-parallel axes inside a stage the pipeline runs replicas over
    replica_prog: Any = None           # the stage program of one replica (its rows of a micro-batch)


def _micro(x, M: int):
    """``[B, ...]`` -> ``[M, B/M, ...]``: micro-batch ``k`` holds rows ``k, k + M, ...``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // M, M, *x.shape[1:]), 0, 1)


def pipeline_plan(cell: Any, data: tuple, mesh_plan, ctx) -> PipelinePlan:
    """Plan a pipelined step from the shapes of ``data`` (arrays or ``jax.ShapeDtypeStruct``), before the step is
    traced: check the settings, pick the stage axes and the schedule, and cut the network into stage functions.

    ``cell`` may be a ``GradAccumulationCell(PipelineCell(...), n)``: each pass then runs on ``1/n`` of the batch."""
    parts = 1
    if _accumulated_pipeline(cell):
        parts = cell.micro_size
        for x in data:
            if hasattr(x, "shape"):
                check_rows(tuple(x.shape), parts, "GradAccumulationCell")
        data = tuple(jax.ShapeDtypeStruct((x.shape[0] // parts, *x.shape[1:]), x.dtype)
                     if hasattr(x, "shape") and len(x.shape) else x for x in data)
        cell = cell.network
    S, M = ctx.pipeline_stages, cell.micro_size
    check_pipeline(ctx, cell)
    for x in jax.tree.leaves(data):
        if hasattr(x, "shape") and len(x.shape) and x.shape[0] % M:
            raise PipelineError(_batch_message(x.shape, M))
    rmesh = mesh_plan
    stage_axes = _stage_axes(rmesh, S)
    if stage_axes is None:
        raise PipelineError(f"pipeline_stages={S}: no mesh axes of the step's mesh {dict(zip(rmesh.names, rmesh.shape))} "
                            f"multiply to {S}; use a stage count that divides the mesh, e.g. a power of two here.")
    cfg = ctx.pipeline_config
    net = cell.network
    segments = [getattr(m, "_mshard_segment", 0) for _, m in nnx.iter_graph(net) if isinstance(m, nnx.Module)]
    chunks = max(segments, default=0) + 1
    if cfg["pipeline_interleave"] and chunks == 1:
        raise PipelineError("pipeline_config pipeline_interleave=True, but no cell has a pipeline_segment > 0: give "
                            "each cell its chunk (cell.pipeline_segment = c; virtual stage c * stages + stage).")
    if not cfg["pipeline_interleave"] and chunks > 1:
        raise PipelineError(f"cells have pipeline_segment up to {chunks - 1}, which only the interleaved schedule runs: "
                            f"set pipeline_config={{'pipeline_interleave': True}} or remove the segments.")
    name = "interleaved" if chunks > 1 else cfg["pipeline_scheduler"]
    sched = make_schedule(name, stages=S, micro=M, chunks=chunks)
    avals = [jax.ShapeDtypeStruct((x.shape[0] // M, *x.shape[1:]), x.dtype) for x in data
             if hasattr(x, "shape") and len(x.shape)]
    jmesh = jax_mesh(rmesh)
    inner = tuple(a for a in rmesh.names if a not in stage_axes)
    prog = cut(net, lambda m, *d: m(*d), avals, stages=S, chunks=chunks, stage_config=dict(cell.stage_config or ()),
               stage_mesh=(jmesh, inner), dataset_strategy=ctx.dataset_strategy)
    p_leaves = jax.tree.leaves(nnx.as_pure(nnx.state(net, nnx.Param)))
    specs = prog.marks["params"][:len(p_leaves)] if prog.marks else None
    recompute = any(getattr(m, "_mshard_recompute", False) for _, m in nnx.iter_graph(net)
                    if isinstance(m, nnx.Module))
    runner = run_gpipe_keeping_residuals if name == "gpipe" and not recompute else run_pipeline
    dp = math.prod(rmesh.shape) // S
    report = build_report(prog, sched, stage_axes, ring_size(sched), prog.cells or {})
    storage = StageStorage.build(prog.param_readers(S), p_leaves, specs, S)
    nbytes = [int(x.size) * x.dtype.itemsize for x in p_leaves]
    report = dataclasses.replace(report, stored_param_bytes=(
        sum(storage.stored_bytes(j, n) for j, n in enumerate(nbytes)), sum(nbytes)))
    dims = []
    for j, x in enumerate(p_leaves):
        sp = tuple(specs[j]) if specs is not None else ()
        d = [() if a is None else (a,) if isinstance(a, str) else tuple(a)
             for a in sp + (None,) * (len(x.shape) - len(sp))]
        if storage.split(j):          # stored split over the stage axes on its stage dim (pipeline/storage.py)
            d[storage.dim(j)] = tuple(stage_axes) + d[storage.dim(j)]
        dims.append(tuple(d))
    slices = math.prod(m.interleave_num for _, m in nnx.iter_graph(net) if isinstance(m, MicroBatchInterleaved))
    data_specs, carry_specs = _in_stage_layouts(prog, avals, rmesh, inner, slices)
    replicas, replica_prog, data_specs = _replica_program(net, prog, avals, data_specs, rmesh, slices, cut_args=dict(
        stages=S, chunks=chunks, stage_mesh=(jmesh, inner), dataset_strategy=ctx.dataset_strategy,
        stage_config=dict(prog.auto) if prog.auto else dict(cell.stage_config or ())))
    report = with_layouts(report, prog.slot_of, carry_specs, dict(zip(rmesh.names, rmesh.shape)),
                          _in_stage_words(data_specs, prog, slices, dp, replicas))
    return PipelinePlan(prog, sched, tuple(stage_axes), jmesh, dp, specs, dims, runner, report, parts, storage,
                        data_specs, carry_specs, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in p_leaves],
                        replicas, replica_prog)


def _replica_program(net, prog, avals: list, data_specs, rmesh, slices: int, cut_args: dict
                     ) -> tuple[tuple, Any, list | None]:
    """-> (the replica axes, the stage program of one replica, the data's in-stage layouts), or
    ``((), None, data_specs)`` where the stages do not run as replicas.

    The axes inside a stage that split no parameter are data parallel there: without operator strategies, the axes
    a micro-batch's rows split over (``data_specs``); with them, those of the axes no parameter's strategy uses
    that divide the rows (a Megatron block's ``data_parallel`` devices). Each device then runs the stage program cut
    from the network at its own share of the rows (one replica; the strategies keep their layouts over the other
    axes), and the pipeline sums the replicas' gradients once per step
    (:class:`~mshard._src.training.pipeline.run._Replicas`) instead of once per micro-batch, as XLA does inside each
    backward branch. The loss and gradient are the mean of the replicas' (MindSpore's data parallel: a batch-mean
    loss's, as one device computes it; see docs/gradients.md). The same cut at the replica's shapes must give the
    same stages, boundaries and carry; where it does not (a network whose program depends on the row count), the
    stages are not run as replicas, nor under a :class:`~mshard.nn.MicroBatchInterleaved` (``slices > 1``)."""
    rows = avals[0].shape[0] if avals and avals[0].shape and slices == 1 else 0
    if prog.marks:
        used = {a for sp in prog.marks["params"] for d in dims_of(sp, len(sp)) for a in d}
        axes, n = [], 1
        for a in cut_args["stage_mesh"][1]:
            if a not in used and rows and rows % (n * rmesh.axis_size(a)) == 0:
                axes.append(a)
                n *= rmesh.axis_size(a)
        split = P(tuple(axes)) if axes else None
        specs = [split if split is not None and x.shape and x.shape[0] == rows else None for x in avals]
    else:
        split = next((sp for sp in data_specs or () if sp is not None), None)
        specs = data_specs
    if split is None or not rows:
        return (), None, data_specs
    axes = tuple(dims_of(split, 1)[0])
    n = math.prod(rmesh.axis_size(a) for a in axes)
    local = [x if sp is None else jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype)
             for x, sp in zip(avals, specs)]
    one = cut(net, lambda m, *d: m(*d), local, marks_like=(prog, axes) if prog.marks else None, **cut_args)
    same = (one.stage == prog.stage and one.needs == prog.needs and one.slot_of == prog.slot_of
            and len(one.slots) == len(prog.slots) and bool(one.marks) == bool(prog.marks))
    return (axes, one, specs) if same else ((), None, data_specs)


def _in_stage_layouts(prog, avals: list, rmesh, inner: tuple[str, ...], slices: int = 1) -> tuple[list, list | None]:
    """The rest of a stage is data parallel: -> (per micro-batch data leaf, per carry slot) PartitionSpecs inside
    a stage.

    Where the cells carry strategies, their marks lay out the data and the activations (nothing here: a Megatron
    block wants its input split over its data-parallel devices only, not over all the stage's devices as the
    stage plan's data layout is; constraining the data to that layout measured more traffic, a permute half the
    size but a third more all-gather bytes over the model-parallel devices). Otherwise a micro-batch's rows are
    split over the stage's axes that divide them (in mesh order, the most that fit), and so is every activation
    handed on whose dim 0 is that row count (the micro-batch's rows; any other activation is left to XLA).

    Not under a :class:`~mshard.nn.MicroBatchInterleaved` (``slices > 1``): there every device of a stage computes
    the whole micro-batch, as before stages were data parallel. Any split of its rows, over all the stage's
    devices or only over as many as divide one slice, aborts XLA's SPMD partitioner (JAX 0.10,
    spmd_partitioner_util.cc:497 ``partition_group_list.num_replica_groups() * ... ==
    device_groups.num_devices_per_group()``, in ``PartitionGather``), with either executor; the same model, split
    and loss outside the pipeline's scan compile (``tests/e2e/pipeline/test_pipeline.py`` keeps the composition's training
    checked)."""
    if prog.marks:
        return None, None
    rows = avals[0].shape[0] if avals and slices == 1 else 0
    axes, n = [], 1
    for a in inner:
        size = rmesh.axis_size(a)
        if rows and rows % (n * size) == 0:
            axes.append(a)
            n *= size
    if not axes:
        return [None] * len(avals), None
    split = P(tuple(axes))
    data = [split if x.shape and x.shape[0] == rows else None for x in avals]
    carry = [split if len(sh) and sh[0] == rows else None for sh, _ in prog.slots]
    return data, carry


def _in_stage_words(data_specs, prog, slices: int, dp: int, replicas: tuple[str, ...] = ()) -> str:
    """The plan's words for how a stage's ``dp`` devices share one micro-batch."""
    split = next((sp for sp in data_specs or () if sp is not None), None)
    if prog.marks:
        return (f"the cells' strategies lay out the data and activations over the stage's {dp} devices" + (
            f"; each device of {replicas} runs its replica of the stage on its rows and the gradients are summed "
            f"over {replicas} once per step" if replicas else ""))
    if replicas:
        return (f"data parallel, a micro-batch's rows split over {split[0]}: each device runs its replica of the "
                f"stage and the gradients are summed over {replicas} once per step")
    if split is not None:
        return f"data parallel, a micro-batch's rows split over {split[0]}"
    why = ("under MicroBatchInterleaved (a split aborts XLA's partitioner, see mshard._src.training.pipeline.cells)" if slices > 1
           else "its rows divide over none of the stage's axes")
    return f"every one of the stage's {dp} devices computes the whole micro-batch: {why}"


def pipeline_grads(cell: Any, data: tuple, pplan: PipelinePlan) -> tuple[Any, Any]:
    """-> (mean micro-batch loss, gradient pure State of the PipelineCell's network's Params): the schedule of
    ``pplan`` (made by :func:`pipeline_plan` for these shapes) run on ``data``.

    ``cell`` may be a ``GradAccumulationCell(PipelineCell(...), n)``: the batch is cut into ``n`` parts (part
    ``k`` holds rows ``k, k + n, ...``), each runs one whole pipeline pass (a ``lax.scan`` over the parts, one
    compiled pass), and the loss and gradient are the mean over the parts (the full batch's, for a mean loss)."""
    if _accumulated_pipeline(cell):
        return _accumulate_passes(cell, data, pplan)
    M = cell.micro_size
    micro = [_micro(x, M) if hasattr(x, "ndim") and x.ndim else x for x in data]
    _, params, rest = nnx.split(cell.network, nnx.Param, ...)
    p_leaves, p_tree = jax.tree.flatten(nnx.as_pure(params))
    r_leaves = jax.tree.leaves(nnx.as_pure(rest))      # the other state (RNG keys, counts) rides along
    prog = pplan.replica_prog or pplan.prog
    more = dict(replica_axes=pplan.replicas) if pplan.replicas else {}
    loss, g = pplan.runner(prog.stage_fn, p_leaves, micro, prog.carry, pplan.sched, pplan.jmesh, pplan.stage_axes,
                           consts=r_leaves, param_specs=_param_specs(pplan, len(p_leaves)), storage=pplan.storage,
                           data_specs=pplan.data_specs, carry_specs=pplan.carry_specs, **more)
    return loss, jax.tree.unflatten(p_tree, g)


def _param_specs(pplan: PipelinePlan, n: int) -> list:
    """The parameters' layouts inside a stage: the cells' strategies where they carry them, else replicated over
    the stage's devices (data parallel). Said outright rather than left to XLA: propagation otherwise may split an
    embedding table on its rows along the token ids' batch split, a gather XLA's partitioner aborts on inside the
    stage's shard_map (seen with JAX 0.10; no reproducer kept)."""
    return pplan.specs if pplan.specs is not None else [P()] * n


def _accumulate_passes(acc: GradAccumulationCell, data: tuple, pplan: PipelinePlan):
    n = acc.micro_size
    parts = [_split_rows(x, n, "GradAccumulationCell") for x in data]
    scanned = [x for x in parts if x is not None]

    def body(carry, d):
        g_acc, l_acc = carry
        it = iter(d)
        args = tuple(next(it) if x is not None else a for x, a in zip(parts, data))
        loss, g = pipeline_grads(acc.network, args, pplan)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss.astype(jnp.float32)), None

    _, params, _ = nnx.split(acc.network.network, nnx.Param, ...)
    zeros = jax.tree.map(jnp.zeros_like, nnx.as_pure(params))
    (g, loss), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), scanned)
    return loss / n, jax.tree.map(lambda x: x / n, g)
