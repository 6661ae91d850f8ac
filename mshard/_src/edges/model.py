"""MindSpore's high-level ``Model``: ``train`` / ``eval`` / ``predict`` over mshard's ``TrainOneStepCell`` and
planned regions, under the current parallel context.

``Model(network, loss_fn, optimizer)`` builds ``TrainOneStepCell(WithLossCell(network, loss_fn), optimizer)`` once;
``train`` runs it on every batch of a dataset (a ``GeneratorDataset`` / ``NumpySlicesDataset`` or any iterable of
batches), each batch laid out as ``dataset_strategy`` says (``ms.dataset.shard_batch``), and feeds the callbacks.
``eval`` and ``predict`` run the network in inference mode as one planned region (``ms.jit``).

>>> import numpy as np, optax, mshard as ms
>>> from flax import nnx
>>> from mshard import nn
>>> from mshard._src.runtime.data_sources import NumpySlicesDataset
>>> x = np.ones((16, 4), np.float32)
>>> model = Model(nn.Dense(4, 2, rngs=nnx.Rngs(0)), nn.MSELoss(), optax.sgd(0.1))
>>> model.train(2, NumpySlicesDataset((x, np.zeros((16, 2), np.float32))).batch(8))
>>> float(np.abs(model.predict(x)).max()) < 1.0
True
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from mshard._src.edges.callbacks import Callback, CallbackManager, InternalCallbackParam, RunContext
from mshard._src.edges.checkpoint.infer import infer_predict_layout as _infer_predict_layout
from mshard._src.edges.metrics import Loss, Metric, get_metrics
from mshard._src.frontend.wrapper_cells import WithLossCell
from mshard._src.runtime.data_sources import Dataset
from mshard._src.runtime.dataset import shard_batch
from mshard._src.runtime.region import Region
from mshard._src.training.train_cells import TrainOneStepCell
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import CellError, CellTypeError, DatasetStrategyError

__all__ = ["Model"]

_MODE_ATTRS = ("deterministic", "use_running_average")
_MISSING = object()


def _call(module, *inputs):
    return module(*inputs)


class _WithEvalCell(nnx.Module):
    """MindSpore's ``WithEvalCell``: ``(loss, outputs, label)`` of ``network(*data)`` against the last input."""

    def __init__(self, network: nnx.Module, loss_fn: Callable):
        self.network = network
        self.loss_fn = loss_fn

    def __call__(self, *inputs):
        outputs = self.network(*inputs[:-1])
        return self.loss_fn(outputs, inputs[-1]), outputs, inputs[-1]


@contextlib.contextmanager
def _inference_mode(module: nnx.Module) -> Iterator[None]:
    """``module.set_train(False)`` (nnx's ``eval()`` for a plain module) for the block; every module's
    ``deterministic`` / ``use_running_average`` is put back as it was afterwards."""
    saved = [(m, a, vars(m).get(a, _MISSING)) for _, m in nnx.iter_graph(module) if isinstance(m, nnx.Module)
             for a in _MODE_ATTRS if hasattr(m, a)]
    if hasattr(module, "set_train"):
        module.set_train(False)
    else:
        module.set_attributes(deterministic=True, use_running_average=True, raise_if_not_found=False)
    try:
        yield
    finally:
        for m, a, v in saved:
            if v is _MISSING:
                vars(m).pop(a, None)
            else:
                setattr(m, a, v)


def _columns(element: Any) -> tuple:
    """One batch as the step's inputs: a tuple/list as is, a dict's values, a single array as one input."""
    if isinstance(element, dict):
        element = tuple(element.values())
    elif not isinstance(element, (tuple, list)):
        element = (element,)
    return tuple(x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x) for x in element)


def _passes(dataset: Any, where: str, first_epoch: int = 0) -> Callable[[], Iterator]:
    """A function starting the next pass (epoch) over ``dataset``."""
    if isinstance(dataset, Dataset):
        it = dataset.create_tuple_iterator(num_epochs=-1, output_numpy=True)
        it._epoch = first_epoch          # a run resumed at initial_epoch shuffles as that epoch did
        return lambda: iter(it)
    if not hasattr(dataset, "__iter__"):
        raise CellTypeError(f"Model.{where}: the dataset must be a GeneratorDataset / NumpySlicesDataset or an "
                            f"iterable of batches (tuples of arrays), got {type(dataset).__name__}.")
    return lambda: iter(dataset)


def _size(dataset: Any) -> int | None:
    """Batches per epoch: None when unknown (an iterable without ``__len__``) or endless (-1 from the dataset)."""
    if isinstance(dataset, Dataset):
        n = dataset.get_dataset_size()
        return None if n < 0 else n
    return len(dataset) if hasattr(dataset, "__len__") else None


def _stream(new_pass: Callable[[], Iterator]) -> Iterator:
    """Passes one after another without end (a sink of ``sink_size`` steps runs on where the last stopped)."""
    while True:
        empty = True
        for element in new_pass():
            empty = False
            yield element
        if empty:
            return


def _check_int(where: str, name: str, value: Any, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CellError(f"{where}: {name}={value!r} must be an int >= {low}; {fix}.")
    return value


class Model:
    """MindSpore's ``Model``: trains, evaluates and predicts with a network under the current parallel context.

    The train network is ``TrainOneStepCell(WithLossCell(network, loss_fn), optimizer)``; without ``loss_fn``,
    ``network`` already returns the loss, and without ``optimizer`` it is already the train network (MindSpore's
    rules). ``optimizer`` is an optax ``GradientTransformation`` (or any optimizer ``TrainOneStepCell`` takes).
    Differences from MindSpore: ``amp_level`` and ``boost_level`` are ``"O0"`` only (build the network in bfloat16
    for mixed precision); ``dataset_sink_mode`` runs as the non-sink mode (see :meth:`train`).

    Args:
        network: the network (a Cell or any nnx module).
        loss_fn: ``loss_fn(output, label)``, e.g. ``nn.MSELoss()``; None: ``network`` returns the loss.
        optimizer: an optax ``GradientTransformation``; None: ``network`` is the train network.
        metrics: for :meth:`eval`: a dict ``{name: Metric}`` or a set of names (``"accuracy"``, ``"loss"``).
        eval_network: the network :meth:`eval` runs; None: ``(loss, outputs, label)`` of network and loss_fn.
        eval_indexes: where loss, outputs and label sit in ``eval_network``'s outputs (three ints), or None: every
            output goes to every metric.
        amp_level: ``"O0"`` (mixed precision is not applied here).
        boost_level: ``"O0"``.

    >>> import numpy as np, optax, mshard as ms
    >>> from flax import nnx
    >>> from mshard import nn
    >>> from mshard._src.edges.callbacks import LossMonitor
    >>> from mshard._src.runtime.data_sources import NumpySlicesDataset
    >>> ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)
    >>> ds = NumpySlicesDataset((x, 2 * x[:, :2]), column_names=["x", "y"], shuffle=False).batch(8)
    >>> net = nn.Dense(4, 2, rngs=nnx.Rngs(0))
    >>> model = Model(net, loss_fn=nn.MSELoss(), optimizer=optax.sgd(0.1))
    >>> model.train(1, ds, callbacks=[LossMonitor()])
    epoch: 1 step: 1, loss is ...
    epoch: 1 step: 2, loss is ...
    >>> model.predict(x).shape, len(net.weight[...].sharding.device_set)
    ((16, 2), 8)
    >>> ms.reset_auto_parallel_context()
    """

    def __init__(self, network: nnx.Module, loss_fn: Callable | None = None, optimizer: Any = None,
                 metrics: dict[str, Metric] | Sequence[str] | set[str] | None = None,
                 eval_network: nnx.Module | None = None, eval_indexes: Sequence[int] | None = None,
                 amp_level: str = "O0", boost_level: str = "O0"):
        if not isinstance(network, nnx.Module):
            raise CellTypeError(f"Model: network must be a Cell or an nnx Module, got {type(network).__name__}.")
        if loss_fn is not None and not callable(loss_fn):
            raise CellTypeError(f"Model: loss_fn must be callable (e.g. nn.MSELoss()) or None, got "
                                f"{type(loss_fn).__name__}.")
        for name, level in (("amp_level", amp_level), ("boost_level", boost_level)):
            if level != "O0":
                raise CellError(f"Model: {name}={level!r} is not offered (only 'O0'); for mixed precision build the "
                                f"network with bfloat16 parameters / dtype, and pass {name}='O0'.")
        if eval_network is not None and not isinstance(eval_network, nnx.Module):
            raise CellTypeError(f"Model: eval_network must be a Cell or an nnx Module, got "
                                f"{type(eval_network).__name__}.")
        self._network, self._loss_fn, self._optimizer = network, loss_fn, optimizer
        self._train_network = self._build_train_network()
        self._metric_fns = get_metrics(metrics)
        self._eval_network, self._eval_indexes = self._build_eval_network(eval_network, eval_indexes)
        self._regions: dict[int, Region] = {}

    def _build_train_network(self) -> nnx.Module:
        net = self._network
        if self._optimizer is not None:
            return TrainOneStepCell(net if self._loss_fn is None else WithLossCell(net, self._loss_fn),
                                    self._optimizer)
        return net if self._loss_fn is None else WithLossCell(net, self._loss_fn)

    def _build_eval_network(self, eval_network, eval_indexes) -> tuple[nnx.Module | None, list[int] | None]:
        if eval_network is not None:
            if eval_indexes is not None and not (isinstance(eval_indexes, (list, tuple)) and len(eval_indexes) == 3
                                                 and all(isinstance(i, int) for i in eval_indexes)):
                raise CellError(f"Model: eval_indexes={eval_indexes!r} must be None or three ints (the positions of "
                                f"loss, outputs and label in eval_network's outputs).")
            return eval_network, None if eval_indexes is None else list(eval_indexes)
        if not self._metric_fns:
            return None, None
        if self._loss_fn is None:
            raise CellError("Model: metrics are given but neither eval_network nor loss_fn; pass eval_network (the "
                            "network eval runs), or loss_fn so that eval runs (loss, outputs, label) of network and "
                            "loss_fn, or no metrics.")
        return _WithEvalCell(self._network, self._loss_fn), [0, 1, 2]

    @property
    def train_network(self) -> nnx.Module:
        """The network :meth:`train` steps (a ``TrainOneStepCell`` when an optimizer was given)."""
        return self._train_network

    @property
    def predict_network(self) -> nnx.Module:
        """The network :meth:`predict` runs."""
        return self._network

    @property
    def eval_network(self) -> nnx.Module | None:
        """The network :meth:`eval` runs (None without metrics or eval_network)."""
        return self._eval_network

    # -- running -------------------------------------------------------------------------------------------
    def _forward(self, module: nnx.Module, inputs: tuple) -> Any:
        """``module(*inputs)`` as one planned region (a Cell with a shard configuration is its own region)."""
        if getattr(module, "_mshard_shard", None) is not None:
            return module(*inputs)
        region = self._regions.get(id(module))
        if region is None:
            region = self._regions[id(module)] = Region(_call, name=f"{type(module).__name__}.predict")
        return region(module, *inputs)

    @staticmethod
    def _feed(data: tuple, p: dict, where: str) -> tuple:
        try:
            return shard_batch(data)
        except DatasetStrategyError as e:
            raise DatasetStrategyError(f"Model.{where}: epoch {p['cur_epoch_num']} step {p['cur_step_num']}: {e} A "
                                       f"last smaller batch: batch(..., drop_remainder=True).") from e

    def train(self, epoch: int, train_dataset: Any, callbacks: Callback | Sequence[Callback] | None = None,
              dataset_sink_mode: bool = False, sink_size: int = -1, initial_epoch: int = 0) -> None:
        """Train ``epoch`` epochs over ``train_dataset``, one step per batch, feeding the callbacks.

        ``dataset_sink_mode=True`` runs the same way (XLA has no data sink: a step is one compiled program either
        way) and callbacks see every step; with ``sink_size > 0`` an epoch is ``sink_size`` steps, each epoch going
        on where the last stopped, as in MindSpore. A callback's ``request_stop()`` ends training after its step.

        Args:
            epoch: the epoch to train up to (a positive int).
            train_dataset: a dataset, or any iterable of batches (tuples of arrays: the step's inputs).
            callbacks: a Callback or a list of them.
            dataset_sink_mode: accepted; runs as False does.
            sink_size: -1: an epoch is one pass; > 0: an epoch is ``sink_size`` steps (with dataset_sink_mode).
            initial_epoch: the epoch to start from (a resumed run): epochs ``initial_epoch + 1 .. epoch`` run.

        >>> import numpy as np, optax
        >>> from flax import nnx
        >>> from mshard import nn
        >>> data = [(np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32))] * 3
        >>> model = Model(nn.Dense(4, 2, rngs=nnx.Rngs(0)), nn.MSELoss(), optax.sgd(0.1))
        >>> model.train(2, data)
        >>> int(model.train_network.optimizer.step[...])
        6
        """
        _check_int("Model.train", "epoch", epoch, 1, "the number of epochs to train")
        if not isinstance(dataset_sink_mode, bool):
            raise CellTypeError(f"Model.train: dataset_sink_mode={dataset_sink_mode!r} must be a bool.")
        if isinstance(sink_size, bool) or not isinstance(sink_size, int) or (sink_size < 1 and sink_size != -1):
            raise CellError(f"Model.train: sink_size={sink_size!r} must be -1 (one pass per epoch) or a positive int "
                            f"(steps per epoch).")
        if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epoch:
            raise CellError(f"Model.train: initial_epoch={initial_epoch!r} must be an int in [0, epoch) = [0, {epoch}); "
                            f"it is the number of epochs already trained.")
        sinking = dataset_sink_mode and sink_size > 0
        new_pass = _passes(train_dataset, "train", initial_epoch)
        batch_num = sink_size if sinking else _size(train_dataset)
        if not sinking and isinstance(train_dataset, Dataset) and batch_num is None:
            raise CellError("Model.train: train_dataset repeats without end; give repeat() a count, or pass "
                            "dataset_sink_mode=True with sink_size=<steps per epoch>.")
        if batch_num == 0:
            raise CellError("Model.train: train_dataset holds no batch; check its data (and batch(..., "
                            "drop_remainder=True) on fewer rows than the batch size).")
        if (not sinking and not isinstance(train_dataset, Dataset) and epoch - initial_epoch > 1
                and iter(train_dataset) is train_dataset):
            raise CellTypeError(f"Model.train: train_dataset is a {type(train_dataset).__name__} iterator, which runs "
                                f"out after one epoch; pass a list of batches, a dataset, or an iterable that starts "
                                f"again on each iter().")
        cbm = CallbackManager(callbacks)
        ctx = ctxmod.current()
        p = InternalCallbackParam(
            train_network=self._train_network, network=self._network, loss_fn=self._loss_fn,
            optimizer=self._optimizer, epoch_num=epoch, batch_num=batch_num, mode="train",
            parallel_mode=str(ctx.parallel_mode), device_number=ctx.devices, train_dataset=train_dataset,
            list_callback=cbm.callbacks, dataset_sink_mode=dataset_sink_mode, train_dataset_element=None,
            cur_epoch_num=initial_epoch, cur_step_num=initial_epoch * (batch_num or 0), cur_step_in_epoch=0,
            net_outputs=None)
        rc = RunContext(p)
        net = self._train_network
        if hasattr(net, "set_train"):
            net.set_train(True)
        stream = _stream(new_pass) if sinking else None
        with cbm:
            cbm.on_train_begin(rc)
            for i in range(initial_epoch, epoch):
                p.cur_epoch_num, p.cur_step_in_epoch = i + 1, 0
                cbm.on_train_epoch_begin(rc)
                for element in (itertools.islice(stream, sink_size) if sinking else new_pass()):
                    data = _columns(element)
                    p.cur_step_num += 1
                    p.cur_step_in_epoch += 1
                    p.train_dataset_element = data
                    cbm.on_train_step_begin(rc)
                    p.net_outputs = net(*self._feed(data, p, "train"))
                    cbm.on_train_step_end(rc)
                    if rc.get_stop_requested():
                        break
                if p.batch_num is None:                 # an iterable without a length: counted in its first epoch
                    p.batch_num = p.cur_step_in_epoch
                cbm.on_train_epoch_end(rc)
                if rc.get_stop_requested():
                    break
            cbm.on_train_end(rc)

    def predict(self, *predict_data: Any) -> Any:
        """The network's output on ``predict_data`` in inference mode (``set_train(False)`` for the call, the mode
        restored afterwards), planned as one region under the current context.

        Args:
            *predict_data: the network's inputs (global arrays: split over the devices by ``dataset_strategy``).

        Returns:
            The network's output (``jax.Array``s).

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from mshard import nn
        >>> net = nn.Dense(4, 2, weight_init="ones", bias_init="zeros")
        >>> Model(net).predict(jnp.ones((8, 4)))[0].tolist()
        [4.0, 4.0]
        """
        if not predict_data:
            raise CellTypeError("Model.predict: give the network's inputs, e.g. model.predict(x).")
        with _inference_mode(self._network):
            return self._forward(self._network, predict_data)

    def eval(self, valid_dataset: Any, callbacks: Callback | Sequence[Callback] | None = None,
             dataset_sink_mode: bool = False) -> dict[str, Any]:
        """Run the eval network over ``valid_dataset`` in inference mode and return every metric's value.

        With ``loss_fn`` and no ``eval_network``, each batch ``(data..., label)`` gives ``(loss, outputs, label)``:
        the ``Loss`` metric takes the loss, the others ``(outputs, label)`` (MindSpore's ``eval_indexes``).

        Args:
            valid_dataset: a dataset or any iterable of batches.
            callbacks: a Callback or a list of them (their ``on_eval_*`` stages run).
            dataset_sink_mode: accepted; runs as False does.

        Returns:
            ``{metric name: value}``.

        >>> import numpy as np
        >>> from mshard import nn
        >>> net = nn.Dense(2, 2, weight_init="ones", bias_init="zeros")
        >>> x, y = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32), np.array([0, 1])
        >>> loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        >>> Model(net, loss, metrics={"acc", "loss"}).eval([(x, y)])
        {'acc': 0.5, 'loss': 0.6931...}
        """
        if not isinstance(dataset_sink_mode, bool):
            raise CellTypeError(f"Model.eval: dataset_sink_mode={dataset_sink_mode!r} must be a bool.")
        if not self._metric_fns:
            raise CellError("Model.eval: the Model has no metrics; pass metrics={'accuracy'} (or a dict of Metrics) "
                            "to Model(...).")
        new_pass = _passes(valid_dataset, "eval")
        cbm = CallbackManager(callbacks)
        for m in self._metric_fns.values():
            m.clear()
        p = InternalCallbackParam(
            eval_network=self._eval_network, network=self._network, valid_dataset=valid_dataset, mode="eval",
            epoch_num=1, cur_epoch_num=1, batch_num=_size(valid_dataset), cur_step_num=0, cur_step_in_epoch=0,
            dataset_sink_mode=dataset_sink_mode, list_callback=cbm.callbacks, net_outputs=None)
        rc = RunContext(p)
        with cbm, _inference_mode(self._eval_network):
            cbm.on_eval_begin(rc)
            cbm.on_eval_epoch_begin(rc)
            for element in new_pass():
                data = _columns(element)
                p.cur_step_num += 1
                p.cur_step_in_epoch += 1
                cbm.on_eval_step_begin(rc)
                outputs = self._forward(self._eval_network, self._feed(data, p, "eval"))
                p.net_outputs = outputs
                cbm.on_eval_step_end(rc)
                self._update_metrics(outputs)
            if p.batch_num is None:
                p.batch_num = p.cur_step_in_epoch
            cbm.on_eval_epoch_end(rc)
            metrics = {k: m.eval() for k, m in self._metric_fns.items()}
            p.metrics = metrics
            cbm.on_eval_end(rc)
        return metrics

    def _update_metrics(self, outputs: Any) -> None:
        outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        idx = self._eval_indexes
        if idx is not None and len(outputs) < 3:
            raise CellError(f"Model.eval: eval_network returns {len(outputs)} output(s) but eval_indexes={idx} needs "
                            f"(loss, outputs, label).")
        for metric in self._metric_fns.values():
            if idx is None:
                metric.update(*outputs)
            elif isinstance(metric, Loss):
                metric.update(outputs[idx[0]])
            else:
                metric.update(outputs[idx[1]], outputs[idx[2]])

    def infer_predict_layout(self, *predict_data: Any) -> dict[str, jax.sharding.NamedSharding]:
        """MindSpore's ``Model.infer_predict_layout``: the layout of every variable of the network in the plan of
        ``predict(*predict_data)`` (tracing only; see ``ms.infer_predict_layout``).

        Args:
            *predict_data: example inputs of one predict call (arrays or ``jax.ShapeDtypeStruct``s).

        Returns:
            ``{variable path: NamedSharding}``.

        >>> import jax.numpy as jnp
        >>> from mshard import nn
        >>> sorted(Model(nn.Dense(4, 2)).infer_predict_layout(jnp.ones((8, 4))))
        ['bias', 'weight']
        """
        return _infer_predict_layout(self._network, *predict_data)
