"""MindSpore's training callbacks (``mindspore.train``): ``Callback``, ``RunContext``, ``LossMonitor``,
``TimeMonitor``, ``ModelCheckpoint`` and its ``CheckpointConfig``.

``Model.train`` / ``Model.eval`` call every callback's ``on_train_*`` / ``on_eval_*`` methods with a
:class:`RunContext`; ``run_context.original_args()`` is the ``cb_params`` dict (attribute access too):
``cur_epoch_num``, ``cur_step_num``, ``batch_num``, ``epoch_num``, ``net_outputs`` (the step's loss),
``train_network``, ``network``, ``optimizer``, ...

>>> class Stop(Callback):
...     def on_train_step_end(self, run_context):
...         if run_context.original_args().cur_step_num == 2:
...             run_context.request_stop()
>>> rc = RunContext(InternalCallbackParam(cur_step_num=2))
>>> Stop().on_train_step_end(rc); rc.get_stop_requested()
True
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from mshard._src.edges.checkpoint import store
from mshard._src.edges.checkpoint.api import save_checkpoint
from mshard._src.edges.checkpoint.manager import CheckpointConfig as _ManagerConfig
from mshard._src.edges.metrics import to_host
from mshard._src.values.errors import CellError, CellTypeError, CheckpointTypeError

__all__ = ["Callback", "CallbackManager", "CheckpointConfig", "InternalCallbackParam", "LossMonitor",
           "ModelCheckpoint", "RunContext", "TimeMonitor"]


class Callback:
    """The base of MindSpore's callbacks: every method is a no-op; override the stages you need.

    The ``on_train_*`` / ``on_eval_*`` methods call MindSpore's older names (``begin``, ``epoch_begin``,
    ``step_begin``, ``step_end``, ``epoch_end``, ``end``) as MindSpore does, so overriding either works. A callback
    is a context manager, entered for the length of one ``Model.train`` / ``Model.eval``.

    >>> class Steps(Callback):
    ...     def step_end(self, run_context):
    ...         print("step", run_context.original_args().cur_step_num)
    >>> Steps().on_train_step_end(RunContext(InternalCallbackParam(cur_step_num=3)))
    step 3
    """

    def __init__(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *err):
        return None

    # MindSpore's older names, called by both the train and the eval stages
    def begin(self, run_context: RunContext) -> None:
        """Once before training or evaluation."""

    def epoch_begin(self, run_context: RunContext) -> None:
        """Before each epoch."""

    def epoch_end(self, run_context: RunContext) -> None:
        """After each epoch."""

    def step_begin(self, run_context: RunContext) -> None:
        """Before each step."""

    def step_end(self, run_context: RunContext) -> None:
        """After each step."""

    def end(self, run_context: RunContext) -> None:
        """Once after training or evaluation."""

    # the stages Model calls
    def on_train_begin(self, run_context: RunContext) -> None:
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_begin(run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        self.epoch_end(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self.step_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        self.end(run_context)

    def on_eval_begin(self, run_context: RunContext) -> None:
        self.begin(run_context)

    def on_eval_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_begin(run_context)

    def on_eval_epoch_end(self, run_context: RunContext) -> None:
        self.epoch_end(run_context)

    def on_eval_step_begin(self, run_context: RunContext) -> None:
        self.step_begin(run_context)

    def on_eval_step_end(self, run_context: RunContext) -> None:
        self.step_end(run_context)

    def on_eval_end(self, run_context: RunContext) -> None:
        self.end(run_context)


class InternalCallbackParam(dict):
    """MindSpore's ``cb_params``: a dict whose keys are also attributes (``cb_params.cur_step_num``).

    Args:
        *args: as ``dict``'s (a mapping or key/value pairs).
        **kwargs: the initial entries.

    >>> p = InternalCallbackParam(cur_epoch_num=1)
    >>> p.cur_step_num = 5
    >>> p.cur_epoch_num, p["cur_step_num"]
    (1, 5)
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"cb_params has no {key!r}; it has {sorted(self)}.") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class RunContext:
    """What a callback receives (MindSpore's ``RunContext``): ``original_args()`` is the ``cb_params`` dict and
    ``request_stop()`` ends training after the current step.

    Args:
        original_args: the ``cb_params`` dict (an :class:`InternalCallbackParam`).

    >>> rc = RunContext(InternalCallbackParam(cur_step_num=1))
    >>> rc.original_args().cur_step_num, rc.get_stop_requested()
    (1, False)
    >>> rc.request_stop(); rc.get_stop_requested()
    True
    """

    def __init__(self, original_args: dict):
        if not isinstance(original_args, dict):
            raise CellTypeError(f"RunContext: original_args must be a dict (cb_params), got "
                                f"{type(original_args).__name__}.")
        self._original_args = original_args
        self._stop_requested = False

    def original_args(self) -> dict:
        """The ``cb_params`` dict."""
        return self._original_args

    def request_stop(self) -> None:
        """Ask ``Model.train`` to stop after this step (the epoch and training end callbacks still run)."""
        self._stop_requested = True

    def get_stop_requested(self) -> bool:
        """Whether a callback asked to stop."""
        return self._stop_requested


class CallbackManager(Callback):
    """Runs a list of callbacks in order (what ``Model`` calls), entering each as a context manager.

    Args:
        callbacks: None, a :class:`Callback`, or a list / tuple of them.

    >>> class Hi(Callback):
    ...     def begin(self, run_context): print("hi")
    >>> with CallbackManager([Hi(), Hi()]) as cbs:
    ...     cbs.on_train_begin(RunContext({}))
    hi
    hi
    """

    def __init__(self, callbacks: Callback | Sequence[Callback] | None):
        if callbacks is None:
            cbs: list = []
        elif isinstance(callbacks, Callback):
            cbs = [callbacks]
        elif isinstance(callbacks, (list, tuple)):
            cbs = list(callbacks)
        else:
            raise CellTypeError(f"Model: callbacks={callbacks!r} must be a Callback, a list of Callbacks or None.")
        bad = [type(c).__name__ for c in cbs if not isinstance(c, Callback)]
        if bad:
            raise CellTypeError(f"Model: callbacks holds {bad}, which are not Callbacks; subclass "
                                f"Callback (or use LossMonitor, TimeMonitor, ModelCheckpoint).")
        super().__init__()
        self._callbacks = cbs
        self._stack: contextlib.ExitStack | None = None

    @property
    def callbacks(self) -> list[Callback]:
        """The callbacks, in the order they run."""
        return list(self._callbacks)

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._callbacks = [self._stack.enter_context(c) or c for c in self._callbacks]
        return self

    def __exit__(self, *err):
        stack, self._stack = self._stack, None
        return stack.__exit__(*err) if stack is not None else None

    def _each(self, name: str, run_context: RunContext) -> None:
        for c in self._callbacks:
            getattr(c, name)(run_context)

    def on_train_begin(self, run_context):
        self._each("on_train_begin", run_context)

    def on_train_epoch_begin(self, run_context):
        self._each("on_train_epoch_begin", run_context)

    def on_train_epoch_end(self, run_context):
        self._each("on_train_epoch_end", run_context)

    def on_train_step_begin(self, run_context):
        self._each("on_train_step_begin", run_context)

    def on_train_step_end(self, run_context):
        self._each("on_train_step_end", run_context)

    def on_train_end(self, run_context):
        self._each("on_train_end", run_context)

    def on_eval_begin(self, run_context):
        self._each("on_eval_begin", run_context)

    def on_eval_epoch_begin(self, run_context):
        self._each("on_eval_epoch_begin", run_context)

    def on_eval_epoch_end(self, run_context):
        self._each("on_eval_epoch_end", run_context)

    def on_eval_step_begin(self, run_context):
        self._each("on_eval_step_begin", run_context)

    def on_eval_step_end(self, run_context):
        self._each("on_eval_step_end", run_context)

    def on_eval_end(self, run_context):
        self._each("on_eval_end", run_context)


def _step_in_epoch(p: dict) -> int:
    n = p.get("batch_num")
    if isinstance(n, int) and n > 0:
        return (p["cur_step_num"] - 1) % n + 1
    return p.get("cur_step_in_epoch", p["cur_step_num"])


def _loss_value(loss: Any) -> Any:
    """MindSpore's ``_handle_loss``: the first output of a tuple, an array's mean as a Python float."""
    if isinstance(loss, (tuple, list)) and loss:
        loss = loss[0]
    if hasattr(loss, "shape") and hasattr(loss, "dtype"):
        return float(to_host(loss).mean())
    return loss


class LossMonitor(Callback):
    """MindSpore's ``LossMonitor``: prints ``epoch: 1 step: 5, loss is 0.123...`` every ``per_print_times`` steps
    (the step counted within its epoch, the loss as a Python float); a NaN or infinite loss stops training with
    :class:`~mshard.errors.CellError`.

    Args:
        per_print_times: print every this many steps; 0 prints nothing.

    >>> rc = RunContext(InternalCallbackParam(cur_epoch_num=1, cur_step_num=5, batch_num=4, net_outputs=0.5))
    >>> LossMonitor().on_train_step_end(rc)
    epoch: 1 step: 1, loss is 0.5
    """

    def __init__(self, per_print_times: int = 1):
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int) or per_print_times < 0:
            raise CellError(f"LossMonitor: per_print_times={per_print_times!r} must be an int >= 0 (0: print "
                            f"nothing).")
        super().__init__()
        self._per_print_times = per_print_times
        self._last_print_time = 0

    def begin(self, run_context: RunContext) -> None:
        """Start counting the steps between prints afresh."""
        self._last_print_time = run_context.original_args().get("cur_step_num", 0)

    def step_end(self, run_context: RunContext) -> None:
        """Print the step's loss (every ``per_print_times`` steps)."""
        p = run_context.original_args()
        loss = _loss_value(p.get("net_outputs"))
        step = _step_in_epoch(p)
        if isinstance(loss, float) and (math.isnan(loss) or math.isinf(loss)):
            raise CellError(f"epoch: {p['cur_epoch_num']} step: {step}. Invalid loss {loss}, terminating training; "
                            f"lower the learning rate or check the data.")
        if self._per_print_times and p["cur_step_num"] - self._last_print_time >= self._per_print_times:
            self._last_print_time = p["cur_step_num"]
            print(f"epoch: {p['cur_epoch_num']} step: {step}, loss is {loss}", flush=True)


class TimeMonitor(Callback):
    """MindSpore's ``TimeMonitor``: at each epoch's end prints ``Train epoch time: 1234.567 ms, per step time:
    12.346 ms`` (the epoch's wall time, waiting for the last step's result, over its ``batch_num`` steps).

    Args:
        data_size: the steps per epoch when ``cb_params.batch_num`` does not say (a positive int), or None.

    >>> tm = TimeMonitor()
    >>> rc = RunContext(InternalCallbackParam(mode="train", batch_num=2))
    >>> tm.on_train_epoch_begin(rc); tm.on_train_epoch_end(rc)
    Train epoch time: ... ms, per step time: ... ms
    """

    def __init__(self, data_size: int | None = None):
        if data_size is not None and (isinstance(data_size, bool) or not isinstance(data_size, int) or data_size < 1):
            raise CellError(f"TimeMonitor: data_size={data_size!r} must be a positive int or None.")
        super().__init__()
        self.data_size = data_size
        self.epoch_time = time.time()

    def epoch_begin(self, run_context: RunContext) -> None:
        """Start the epoch's clock."""
        self.epoch_time = time.time()

    def epoch_end(self, run_context: RunContext) -> None:
        """Print the epoch's time and the time per step."""
        p = run_context.original_args()
        jax.block_until_ready(p.get("net_outputs"))
        ms = (time.time() - self.epoch_time) * 1000
        steps = p.get("batch_num")
        if not (isinstance(steps, int) and steps > 0):
            steps = self.data_size
        if not (isinstance(steps, int) and steps > 0):
            raise CellError(f"TimeMonitor: the steps per epoch are unknown (cb_params.batch_num={steps!r}); pass "
                            f"TimeMonitor(data_size=<steps per epoch>).")
        mode = str(p.get("mode", "")).title()
        print(f"{mode} epoch time: {ms:5.3f} ms, per step time: {ms / steps:5.3f} ms".lstrip(), flush=True)


# -- checkpoints -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_ManagerConfig):
    """MindSpore's ``CheckpointConfig`` with all its keywords: mshard's :class:`~mshard.CheckpointConfig` (steps,
    keep, async_save, append_info) plus the keys that have no meaning here or are not offered.

    Accepted and unused: ``integrated_save`` (checkpoints are always distributed and load into any layout) and
    ``exception_save``. Honoured: ``saved_network`` (save it instead of the train network) and ``append_info`` as
    MindSpore's list (``"epoch_num"``, ``"step_num"`` and dicts). Refused: time-based saving and ``enc_key``.

    Args:
        save_checkpoint_steps: save every this many steps (a positive int).
        keep_checkpoint_max: keep only the last this many checkpoints (a positive int).
        async_save: write in the background.
        append_info: a dict, or MindSpore's list of ``"epoch_num"`` / ``"step_num"`` and dicts, stored with
            every checkpoint (``LoadResult.metadata``).
        save_checkpoint_seconds: 0 only (time-based saving is not offered).
        keep_checkpoint_per_n_minutes: 0 only.
        integrated_save: accepted, unused.
        saved_network: an nnx module to save instead of the train network, or None.
        enc_key: None only (encrypted checkpoints are not offered).
        enc_mode: accepted, unused.
        exception_save: accepted, unused (no checkpoint is written when training raises).

    >>> cfg = CheckpointConfig(save_checkpoint_steps=10, integrated_save=False, append_info=["epoch_num", {"lr": 0.1}])
    >>> cfg.keep_checkpoint_max, cfg.append_info, cfg.append_keys
    (5, {'lr': 0.1}, ('epoch_num',))
    """

    save_checkpoint_seconds: int = 0
    keep_checkpoint_per_n_minutes: int = 0
    integrated_save: bool = True
    saved_network: Any = None
    enc_key: Any = None
    enc_mode: str = "AES-GCM"
    exception_save: bool = False
    append_keys: tuple = field(init=False, default=())

    def __post_init__(self):
        for k in ("save_checkpoint_seconds", "keep_checkpoint_per_n_minutes"):
            if getattr(self, k):
                raise CheckpointTypeError(f"CheckpointConfig: {k}={getattr(self, k)!r}: time-based checkpoints are not "
                                          f"offered; use save_checkpoint_steps and keep_checkpoint_max.")
        if self.enc_key is not None:
            raise CheckpointTypeError("CheckpointConfig: enc_key is given but encrypted checkpoints are not offered; "
                                      "pass enc_key=None and encrypt the checkpoint directory by other means.")
        info = self.append_info
        if info is None:
            info = {}
        if isinstance(info, (list, tuple)):
            merged, keys = {}, []
            for item in info:
                if isinstance(item, dict):
                    merged.update(item)
                elif item in ("epoch_num", "step_num"):
                    keys.append(item)
                else:
                    raise CheckpointTypeError(f"CheckpointConfig: append_info item {item!r} must be 'epoch_num', "
                                              f"'step_num' or a dict.")
            object.__setattr__(self, "append_keys", tuple(keys))
            info = merged
        if not isinstance(info, dict):
            raise CheckpointTypeError(f"CheckpointConfig: append_info={info!r} must be a dict or a list of "
                                      f"'epoch_num', 'step_num' and dicts.")
        object.__setattr__(self, "append_info", info)
        super().__post_init__()


class ModelCheckpoint(Callback):
    """MindSpore's ``ModelCheckpoint``: saves the train network (parameters, optimizer state, step count) every
    ``save_checkpoint_steps`` steps and at the end of training, keeping the last ``keep_checkpoint_max``.

    Differences from MindSpore: the checkpoints are the steps (global step numbers) of one directory,
    ``<directory>/<prefix>`` (:func:`~mshard.save_checkpoint`'s format), not ``<prefix>-<epoch>_<step>.ckpt`` files;
    load one with ``ms.load_checkpoint(ckpt.latest_ckpt_file_name, net)``. A prefix whose directory already holds
    checkpoints becomes ``<prefix>_1``, ``<prefix>_2``, ... as in MindSpore.

    Args:
        prefix: the checkpoints' name (a str without ``/``).
        directory: where the prefix's directory goes; None: the working directory.
        config: a :class:`CheckpointConfig` (either kind); None: the defaults.

    >>> import tempfile
    >>> ckpt = ModelCheckpoint(prefix="net", directory=tempfile.mkdtemp())
    >>> ckpt.latest_ckpt_file_name is None
    True
    """

    def __init__(self, prefix: str = "CKP", directory: str | os.PathLike | None = None,
                 config: _ManagerConfig | None = None):
        if not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix:
            raise CheckpointTypeError(f"ModelCheckpoint: prefix={prefix!r} must be a non-empty str without '/'.")
        if config is None:
            config = _ManagerConfig()
        if not isinstance(config, _ManagerConfig):
            raise CheckpointTypeError(f"ModelCheckpoint: config must be a CheckpointConfig, got "
                                      f"{type(config).__name__}.")
        super().__init__()
        self._prefix = prefix
        self._directory = os.path.abspath(os.fspath(directory) if directory is not None else ".")
        self._config = config
        self._ckpt_dir: str | None = None
        self._last_triggered_step = 0
        self._latest: str | None = None

    @property
    def latest_ckpt_file_name(self) -> str | None:
        """The directory of the checkpoints saved (``ms.load_checkpoint`` loads its last step), None before any."""
        return self._latest

    def on_train_begin(self, run_context: RunContext) -> None:
        """Choose the checkpoint directory: ``<directory>/<prefix>``, or ``<prefix>_<n>`` if that holds steps."""
        name, n = self._prefix, 0
        while store.steps(os.path.join(self._directory, name)):
            n += 1
            name = f"{self._prefix}_{n}"
        self._ckpt_dir = os.path.join(self._directory, name)
        self._last_triggered_step = run_context.original_args().get("cur_step_num", 0)

    def on_train_step_end(self, run_context: RunContext) -> None:
        """Save when ``save_checkpoint_steps`` steps have passed since the last save."""
        p = run_context.original_args()
        if p["cur_step_num"] >= self._last_triggered_step + self._config.save_checkpoint_steps:
            self._save(p)

    def on_train_end(self, run_context: RunContext) -> None:
        """Save the last step unless it was just saved."""
        p = run_context.original_args()
        if p.get("cur_step_num", 0) > self._last_triggered_step:
            self._save(p)

    def _save(self, p: dict) -> None:
        if self._ckpt_dir is None:
            self.on_train_begin(RunContext(InternalCallbackParam()))
        obj = getattr(self._config, "saved_network", None)
        obj = p["train_network"] if obj is None else obj
        meta = dict(self._config.append_info)
        keys = getattr(self._config, "append_keys", ())
        if "epoch_num" in keys:
            meta["epoch_num"] = int(p["cur_epoch_num"])
        if "step_num" in keys:
            meta["step_num"] = int(p["cur_step_num"])
        save_checkpoint(obj, self._ckpt_dir, step=int(p["cur_step_num"]), metadata=meta,
                        keep=self._config.keep_checkpoint_max, async_save=self._config.async_save)
        self._last_triggered_step = p["cur_step_num"]
        self._latest = self._ckpt_dir
