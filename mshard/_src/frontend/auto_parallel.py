"""``AutoParallel``: MindSpore 2.6's wrapper that carries a network's parallel configuration with it.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> import mshard as ms
>>> from mshard._src.frontend.auto_parallel import AutoParallel
>>> net = AutoParallel(ms.jit(lambda x: x * 2), parallel_mode="recursive_programming")
>>> net.dataset_strategy("full_batch")
>>> net(jnp.ones((8, 4))).shape, ms.get_auto_parallel_context("parallel_mode")
((8, 4), 'stand_alone')

The settings live in the wrapper (a context value), not in the global context: each call runs the wrapped network
under them (``ms.parallel_context``), so two AutoParallel networks with different settings coexist and the
global context is untouched.

Differences from MindSpore: ``hsdp`` is optimizer parallel at MindSpore's levels: level1 shards the optimizer state and
the update, level2 is the same program (mshard's level1 already reduce-scatters the gradients), level3 also stores
the weights sharded (FSDP);
``no_init_parameters_in_compile`` does nothing (flax creates parameters when the model is built);
``pipeline`` sets ``pipeline_stages`` only (its ``output_broadcast``, ``interleave`` and ``scheduler`` are ignored;
the step must train a PipelineCell: ``TrainOneStepCell(PipelineCell(...))``, or an ``ms.jit`` step that calls
``value_and_grad`` over a function of a ``Pipeline`` cell, MindSpore's functional form).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mshard._src.frontend.cell import Cell
from mshard._src.values import context as ctxmod
from mshard._src.values.context import did_you_mean
from mshard._src.values.errors import ContextError

# AutoParallel's parallel_mode -> (parallel_mode, search_mode) of the context
MODES = {"semi_auto": ("semi_auto_parallel", None),
         "sharding_propagation": ("auto_parallel", "sharding_propagation"),
         "recursive_programming": ("auto_parallel", "recursive_programming")}


class _Settings(dict):
    """The wrapper's context values: a dict that hashes by its contents, so the Cell's graph (which holds it as a
    static attribute) can be a cache key."""

    def __hash__(self) -> int:                              # type: ignore[override]
        return hash(repr(sorted(self.items())))


class AutoParallel(Cell):
    """``AutoParallel(network, parallel_mode="semi_auto")``: ``network`` (a Cell, a TrainOneStepCell, an
    ``ms.jit`` region or any callable) run with its own parallel configuration on every device of the job.

    MindSpore 2.6's methods (``dataset_strategy``, ``hsdp``, ``pipeline``, ``comm_fusion``, ...) set the
    configuration; it lives in the wrapper (``settings``), and each call runs ``network`` under it
    (``ms.parallel_context``), leaving the global context untouched. Other attributes are the network's.
    Differences from MindSpore: ``hsdp`` is optimizer parallel (``level3``: weights stored sharded too),
    ``pipeline`` sets only the stage count, ``no_init_parameters_in_compile`` does nothing.

    Args:
        network: what to run: a Cell, a TrainOneStepCell, an ``ms.jit`` region or any callable.
        parallel_mode: ``"semi_auto"`` (the cells' strategies), ``"sharding_propagation"`` or
            ``"recursive_programming"`` (searched strategies).

    >>> import jax.numpy as jnp, mshard as ms
    >>> from mshard.parallel import AutoParallel
    >>> net = AutoParallel(ms.jit(lambda x: x * 2), parallel_mode="sharding_propagation")
    >>> net.dataset_strategy("full_batch")
    >>> net(jnp.ones((8, 4))).shape, net.settings["search_mode"], ms.get_auto_parallel_context("parallel_mode")
    ((8, 4), 'sharding_propagation', 'stand_alone')
    """

    def __init__(self, network: Callable, parallel_mode: str = "semi_auto"):
        if parallel_mode not in MODES:
            raise ContextError(f"AutoParallel: unknown parallel_mode {parallel_mode!r}.{did_you_mean(parallel_mode, MODES)}"
                               f" Expected one of {', '.join(map(repr, MODES))}.")
        mode, search = MODES[parallel_mode]
        self.network = network
        self.parallel_mode = parallel_mode
        settings: dict[str, Any] = {"parallel_mode": mode, "device_num": jax.device_count()}
        if search is not None:
            settings["search_mode"] = search
        self._settings = _Settings(settings)
        self._check()

    def _check(self) -> None:
        with ctxmod.parallel_context(**self._settings):     # every setting validated when it is made
            pass

    def _set(self, **kwargs: Any) -> None:
        before = self._settings
        self._settings = _Settings({**before, **kwargs})
        try:
            self._check()
        except Exception:
            self._settings = before
            raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with ctxmod.parallel_context(**self._settings):
            return self.network(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:                # the wrapped network's own attributes
        if name.startswith("_") or "network" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["network"], name)

    @property
    def settings(self) -> dict[str, Any]:
        """The context values this wrapper runs its network under."""
        return dict(self._settings)

    # -- MindSpore 2.6's methods -----------------------------------------------------------------------
    def dataset_strategy(self, config: Any) -> None:
        """``"data_parallel"``, ``"full_batch"`` or one split tuple per input (``set_auto_parallel_context``'s)."""
        self._set(dataset_strategy=config)

    def hsdp(self, shard_size: int = -1, threshold: int = 64, optimizer_level: str = "level1") -> None:
        """Optimizer parallel: each data-parallel replica keeps 1/shard_size of the optimizer state
        (``shard_size=-1``: all replicas); parameters under ``threshold`` KB stay whole. ``optimizer_level="level3"``
        stores the weights sharded too (FSDP: gathered where they compute)."""
        self._set(enable_parallel_optimizer=True, parallel_optimizer_config={
            "optimizer_weight_shard_size": shard_size, "parallel_optimizer_threshold": threshold,
            "optimizer_level": optimizer_level})

    def pipeline(self, stages: int = 1, output_broadcast: bool = False, interleave: bool = False,
                 scheduler: str = "1f1b") -> None:
        """Pipeline stages (``pipeline_stages``)."""
        self._set(pipeline_stages=stages)

    def comm_fusion(self, config: dict) -> None:
        """``{"allreduce": {"mode": "size", "config": 32}, ...}`` (``set_auto_parallel_context``'s)."""
        self._set(comm_fusion=config)

    def enable_gradients_mean(self) -> None:
        """Gradients are averaged over the data-parallel replicas (``gradients_mean=True``)."""
        self._set(gradients_mean=True)

    def _strategy_file(self, key: str, file_path: str) -> None:
        cfg = dict(self._settings.get("strategy_ckpt_config", {}))
        cfg[key] = str(file_path)
        self._set(strategy_ckpt_config=cfg)

    def save_param_strategy_file(self, file_path: str) -> None:
        """Write the plan's strategy file (parameters and operators) to ``file_path`` when the network is planned."""
        self._strategy_file("save_file", file_path)

    def load_param_strategy_file(self, file_path: str) -> None:
        """Plan the network from the strategy file at ``file_path``."""
        self._strategy_file("load_file", file_path)

    save_operator_strategy_file = save_param_strategy_file
    load_operator_strategy_file = load_param_strategy_file

    def no_init_parameters_in_compile(self) -> None:
        """Accepted for MindSpore scripts; flax builds parameters eagerly, so there is nothing to defer."""
