"""MindSpore's ``CheckpointConfig`` and a checkpoint manager that keeps the last N steps (orbax's manager).

>>> import tempfile
>>> from flax import nnx
>>> mgr = CheckpointManager(tempfile.mkdtemp(), CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2))
>>> net = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
>>> [mgr.step_end(net, s) is not None for s in range(1, 7)]
[False, True, False, True, False, True]
>>> mgr.wait().all_steps()
[4, 6]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from flax import nnx

from mshard._src.edges.checkpoint import store
from mshard._src.edges.checkpoint.api import LoadResult, SaveHandle, load_checkpoint, save_checkpoint
from mshard._src.values.errors import CheckpointTypeError


@dataclass(frozen=True)
class CheckpointConfig:
    """MindSpore's ``CheckpointConfig``: when a :class:`CheckpointManager` saves and how many steps it keeps.

    Differences from MindSpore: the time-based and ``integrated_save`` options have no meaning here (checkpoints
    are always distributed and whole) and are not accepted.

    Args:
        save_checkpoint_steps: save every this many steps (a positive int).
        keep_checkpoint_max: keep only the last this many steps (a positive int).
        async_save: write in the background (False by default, as in MindSpore); committed before the next save
            or load of the directory and before the interpreter exits.
        append_info: a JSON dict that goes into every checkpoint's metadata.

    >>> CheckpointConfig(save_checkpoint_steps=100).keep_checkpoint_max
    5
    >>> try:
    ...     CheckpointConfig(keep_checkpoint_max=0)
    ... except CheckpointTypeError as e:
    ...     print(e)
    CheckpointConfig: keep_checkpoint_max must be a positive int, got 0.
    """

    save_checkpoint_steps: int = 1
    keep_checkpoint_max: int = 5
    async_save: bool = False
    append_info: dict = field(default_factory=dict)

    def __post_init__(self):
        for k in ("save_checkpoint_steps", "keep_checkpoint_max"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise CheckpointTypeError(f"CheckpointConfig: {k} must be a positive int, got {v!r}.")


class CheckpointManager:
    """Saves an object every ``config.save_checkpoint_steps`` steps into ``directory`` and keeps the last
    ``config.keep_checkpoint_max`` (MindSpore's ``ModelCheckpoint`` callback, called by hand: ``step_end``).

    ``save``, ``restore``, ``all_steps``, ``latest_step`` and ``wait`` act on the one directory
    (see :func:`save_checkpoint` and :func:`load_checkpoint`).

    Args:
        directory: the checkpoint directory (created on the first save).
        config: when to save and what to keep; None: ``CheckpointConfig()``.

    >>> import tempfile
    >>> from flax import nnx
    >>> mgr = CheckpointManager(tempfile.mkdtemp(), CheckpointConfig(keep_checkpoint_max=2, append_info={"run": "a"}))
    >>> net = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> for s in (1, 2, 3):
    ...     _ = mgr.save(net, s)
    >>> mgr.all_steps(), mgr.latest_step(), mgr.restore(nnx.Linear(2, 2, rngs=nnx.Rngs(1))).metadata
    ([2, 3], 3, {'run': 'a'})
    """

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig | None = None):
        self.directory = os.path.abspath(os.fspath(directory))
        self.config = config or CheckpointConfig()

    def save(self, obj: nnx.Module, step: int | None = None, metadata: dict | None = None) -> SaveHandle:
        """Save now (see :func:`save_checkpoint`), dropping steps beyond ``keep_checkpoint_max``."""
        meta = {**self.config.append_info, **(metadata or {})}
        return save_checkpoint(obj, self.directory, step=step, metadata=meta, keep=self.config.keep_checkpoint_max,
                               async_save=self.config.async_save)

    def step_end(self, obj: nnx.Module, step: int, metadata: dict | None = None) -> SaveHandle | None:
        """Call after training step ``step`` (counted from 1): saves when it is a multiple of
        ``save_checkpoint_steps``."""
        if step % self.config.save_checkpoint_steps:
            return None
        return self.save(obj, step, metadata)

    def restore(self, obj: nnx.Module, step: int | None = None, **kwargs) -> LoadResult:
        """Load ``step`` (default: the last committed) into ``obj`` (see :func:`load_checkpoint`)."""
        return load_checkpoint(self.directory, obj, step=step, **kwargs)

    def all_steps(self) -> list[int]:
        return store.steps(self.directory)

    def latest_step(self) -> int | None:
        found = store.steps(self.directory)
        return found[-1] if found else None

    def wait(self) -> CheckpointManager:
        """Block until every save in flight is committed."""
        store.finish(self.directory)
        return self
