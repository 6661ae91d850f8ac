"""``ms.save_checkpoint`` / ``ms.load_checkpoint`` and MindSpore's distributed-checkpoint names over them.

>>> import tempfile, jax.numpy as jnp
>>> from flax import nnx
>>> import mshard as ms
>>> d = tempfile.mkdtemp()
>>> net = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> ms.save_checkpoint(net, d, step=0).step       # committed on return (async_save=True writes in the background)
0
>>> other = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
>>> r = ms.load_checkpoint(d, other)
>>> bool((other.kernel[...] == net.kernel[...]).all()), r.step, r.param_not_load
(True, 0, [])

Differences from MindSpore: a checkpoint is a directory (one sub-directory per step, orbax's layout), not a
``.ckpt`` file; it holds the whole state of the object (parameters, optimizer state, step count, RNG state) with
its layouts and strategy file; the layout it is saved in does not matter on load (any strategy, device count or
process count), so ``load_distributed_checkpoint`` and ``transform_checkpoints`` need no strategy to read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mshard._src.edges.checkpoint import store
from mshard._src.edges.checkpoint.checksum import block_sums, grid_of, total
from mshard._src.edges.checkpoint.leaves import Leaf, assign, leaves_of
from mshard._src.frontend.cell import cell_region
from mshard._src.runtime.region import Region
from mshard._src.training.train_cells import TrainOneStepCell
from mshard._src.values.errors import CheckpointError, CheckpointTypeError
from mshard._src.values.plan import load_plan


# -- save ------------------------------------------------------------------------------------------------
@dataclass
class SaveHandle:
    """What :func:`save_checkpoint` returns: the step saved, possibly still in flight.

    With ``async_save=True`` orbax writes in the background once the arrays are copied to the host; ``wait()``
    blocks until the step is committed on disk and returns the handle. A synchronous save is committed already.

    Args:
        directory: the checkpoint directory (an absolute path).
        step: the step saved.
        _manager: the orbax manager writing it (internal: made by ``save_checkpoint``).

    >>> import tempfile
    >>> from flax import nnx
    >>> h = save_checkpoint(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tempfile.mkdtemp(), step=7, async_save=True)
    >>> h.wait() is h, h.step
    (True, 7)
    """

    directory: str
    step: int
    _manager: Any = field(repr=False)

    def wait(self) -> SaveHandle:
        """Block until the checkpoint is committed on disk; returns ``self``."""
        self._manager.wait_until_finished()
        return self


def _spec_json(x: jax.Array) -> dict:
    sh = x.sharding
    if isinstance(sh, NamedSharding):
        spec = [list(d) if isinstance(d, tuple) else d for d in sh.spec]
        return {"mesh": {"names": list(sh.mesh.axis_names), "shape": [int(n) for n in sh.mesh.devices.shape]},
                "spec": spec}
    return {"devices": len(sh.device_set)}


def _plan_json(obj: nnx.Module) -> dict | None:
    """The strategy file of the region that last ran ``obj`` (a TrainOneStepCell's step, a sharded Cell)."""
    region = obj._rt.region if isinstance(obj, TrainOneStepCell) else (
        cell_region(obj) if getattr(obj, "_mshard_shard", None) is not None else None)
    comps = list(getattr(region, "_cache", {}).values())
    plan = comps[-1].plan if comps else None
    return plan.to_json() if plan is not None else None


def _default_step(obj: nnx.Module, directory: str) -> int:
    if isinstance(obj, TrainOneStepCell):
        return int(np.asarray(jax.device_get(obj.optimizer.step[...])))
    found = store.steps(directory)
    return found[-1] + 1 if found else 0


def save_checkpoint(obj: nnx.Module, directory: str | os.PathLike, *, step: int | None = None,
                    metadata: dict | None = None, keep: int | None = None,
                    async_save: bool = False) -> SaveHandle:
    """Save ``obj`` as step ``step`` of the checkpoint directory ``directory`` (MindSpore's ``save_checkpoint``).

    Saves every variable in its current layout (each process writes only its shards), the layouts, the plan's
    strategy file, per-leaf content checksums and ``metadata``. Synchronous by default, as MindSpore's: the step
    is committed on disk when it returns. A step that already exists is an error (nothing saved is overwritten).
    Differences from MindSpore: a directory of steps holding the object's whole state, not a ``.ckpt`` file
    (docs/checkpoint.md).

    Args:
        obj: what to save: a Cell, any nnx module, or a TrainOneStepCell (network, optimizer state, step count).
        directory: the checkpoint directory (created if missing); each step is one sub-directory.
        step: the step number; None: the optimizer's step count for a TrainOneStepCell, else one past the last
            saved step.
        metadata: a JSON-serialisable dict stored with the step (``LoadResult.metadata`` on load).
        keep: keep only the last ``keep`` steps of the directory; None: keep every step.
        async_save: return once the arrays are copied off the devices and commit in the background; ``.wait()``,
            any later save or load of the same directory in this process and the interpreter's exit wait for it.

    Returns:
        A :class:`SaveHandle` with the ``directory`` and ``step`` saved.

    >>> import tempfile
    >>> from flax import nnx
    >>> h = save_checkpoint(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tempfile.mkdtemp(), metadata={"epoch": 1},
    ...                     async_save=True)
    >>> h.wait().step
    0
    """
    directory = os.path.abspath(os.fspath(directory))
    leaves = leaves_of(obj)
    if metadata is not None:
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise CheckpointTypeError(f"save_checkpoint: metadata must be JSON (dicts, lists, str, numbers), got "
                                      f"{metadata!r}: {e}.") from e
    if step is None:
        step = _default_step(obj, directory)
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise CheckpointTypeError(f"save_checkpoint: step must be a non-negative int, got {step!r}.")
    step = int(step)
    if step in store.steps(directory):
        raise CheckpointError(f"save_checkpoint: step {step} already exists in {directory!r}; save under another "
                              f"step (step=...) or another directory. Nothing saved is overwritten.")
    grids = [grid_of(lf.value) for lf in leaves]
    sums = block_sums([lf.value for lf in leaves], grids)
    meta = {"format": store.FORMAT, "version": store.VERSION, "step": step, "kind": type(obj).__name__,
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            "leaves": {lf.name: {"shape": list(lf.value.shape), "dtype": str(lf.value.dtype), "kind": lf.kind,
                                 "key_impl": lf.key_impl, "layout": _spec_json(lf.value), "grid": list(g),
                                 "checksum": s.reshape(-1, 2).tolist()}
                       for lf, g, s in zip(leaves, grids, sums)},
            "strategy": _plan_json(obj), "metadata": metadata or {}}
    m = store.manager(directory, keep, async_save)
    m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave({lf.name: lf.value for lf in leaves}),
                                         mshard=ocp.args.JsonSave(meta)))
    if not async_save:
        m.wait_until_finished()
    return SaveHandle(directory, step, m)


# -- load ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_checkpoint` did; ``param_not_load`` and ``ckpt_not_load`` are MindSpore's names (the lists
    ``load_param_into_net`` returns).

    Args:
        step: the step loaded.
        metadata: the ``metadata`` dict saved with the step.
        param_not_load: the object's leaves the checkpoint did not fill (missing, or of another shape).
        ckpt_not_load: the checkpoint's leaves that went nowhere (sorted).
        cast: the leaves restored in the object's dtype rather than the saved one.
        strategy: the strategy file (as a dict) of the plan the object was saved under; None without one.

    >>> import tempfile
    >>> from flax import nnx
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), d, metadata={"epoch": 3})
    >>> r = load_checkpoint(d, nnx.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(1)), strict=False)
    >>> r.step, r.metadata, r.param_not_load, r.ckpt_not_load, r.cast, r.strategy
    (0, {'epoch': 3}, [], ['bias'], [], None)
    """

    step: int
    metadata: dict
    param_not_load: list[str]
    ckpt_not_load: list[str]
    cast: list[str]
    strategy: dict | None


def _match(targets: list[Leaf], saved: dict) -> dict[str, str]:
    """Target leaf name -> saved leaf name. Exact names first; else the one prefix pair (a TrainOneStepCell's
    ``network.backbone.`` against a bare network, either way) that maps the most leaves of the same kind."""
    exact = {t.name: t.name for t in targets if t.name in saved}
    if len(exact) == len(targets):
        return exact
    score: dict[tuple[str, str], int] = {}
    for t in targets:
        for s, info in saved.items():
            if s == t.name:
                pair = ("", "")
            elif s.endswith("." + t.name):
                pair = ("", s[:-len(t.name)])
            elif t.name.endswith("." + s):
                pair = (t.name[:-len(s)], "")
            else:
                continue
            score[pair] = score.get(pair, 0) + (2 if info["kind"] == t.kind else 1)
    if not score:
        return exact
    tp, sp = max(score, key=lambda p: (score[p], p == ("", "")))
    out = {}
    for t in targets:
        if t.name.startswith(tp) and sp + t.name[len(tp):] in saved:
            out[t.name] = sp + t.name[len(tp):]
    return out


def _target_sharding(x: jax.Array, name: str, layouts: dict | None):
    if layouts and name in layouts:
        sh = layouts[name]
        if not isinstance(sh, jax.sharding.Sharding):
            raise CheckpointTypeError(f"load_checkpoint: layouts[{name!r}] must be a jax.sharding.Sharding (as "
                                      f"ms.infer_predict_layout returns), got {type(sh).__name__}.")
        return sh
    sh = x.sharding
    if jax.process_count() > 1 and sh.is_fully_addressable:
        # a leaf this process holds alone: replicated over every device of the job, so each process restores
        # the same global value
        return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
    return sh


def _verify(restored: dict[str, jax.Array], saved: dict, directory: str, step: int, what: str) -> None:
    names = list(restored)
    arrays = [restored[n] for n in names]
    whole = block_sums(arrays, [(1,) * a.ndim for a in arrays])
    for n, a, w in zip(names, arrays, whole):
        want = total(np.asarray(saved[n]["checksum"], np.uint64))
        if np.array_equal(total(w), want):
            continue
        grid = tuple(saved[n]["grid"])
        blocks = block_sums([a], [grid])[0].reshape(-1, 2)
        ref = np.asarray(saved[n]["checksum"], np.uint64).reshape(-1, 2)
        bad = [i for i in range(len(ref)) if not np.array_equal(blocks[i].astype(np.uint64), ref[i])]
        ch = store.chunks_of(directory, step, n, what)
        shape = tuple(saved[n]["shape"])
        files = []
        for i in bad:
            ix = np.unravel_index(i, grid) if grid else ()
            size = [s // g for s, g in zip(shape, grid)]
            lo = tuple(int(j) * z for j, z in zip(ix, size))
            files += [os.path.join(store.leaf_dir(directory, step, n), f)
                      for f in ch.covering(lo, tuple(a + z for a, z in zip(lo, size)))]
        raise CheckpointError(f"{what}: leaf {n!r}: content checksum mismatch in file {', '.join(files) or '?'} "
                              f"(step {step} of {directory!r}): the data on disk is not what was saved. Nothing was "
                              f"loaded; load an earlier step.")


def _place(obj: nnx.Module, inputs: tuple) -> None:
    """Put ``obj``'s variables on the layouts its plan gives for ``inputs`` (plans, does not run)."""
    if isinstance(obj, TrainOneStepCell):
        obj.place(*inputs)
    elif getattr(obj, "_mshard_shard", None) is not None:
        cell_region(obj).place(obj, *inputs)
    else:
        Region(lambda m, *a: m(*a), name=type(obj).__name__).place(obj, *inputs)


class ParamDict(dict):
    """What ``ms.load_checkpoint(directory)`` returns without an object: MindSpore's parameter dict.

    A dict of saved leaf name -> global array (on this process's first device, or replicated over the job's devices
    with several processes). Load it with :func:`load_param_into_net`.

    Args:
        none: made by :func:`load_checkpoint`; ``kinds`` maps each name to its Variable type (Param,
            OptVariable, ...) and ``step`` is the step read.

    >>> import tempfile, mshard as ms
    >>> from flax import nnx
    >>> d = tempfile.mkdtemp()
    >>> _ = ms.save_checkpoint(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), d)
    >>> p = ms.load_checkpoint(d)
    >>> sorted(p), p.kinds["kernel"], p.step
    (['bias', 'kernel'], 'Param', 0)
    """

    kinds: dict[str, str]
    step: int


def load_checkpoint(directory: str | os.PathLike, obj: nnx.Module | None = None, *, step: int | None = None,
                    strict: bool = True, inputs: tuple | None = None,
                    layouts: dict[str, jax.sharding.Sharding] | None = None) -> LoadResult | ParamDict:
    """Restore a step of ``directory`` into ``obj`` in place (MindSpore's ``load_checkpoint`` and
    ``load_param_into_net`` in one call); without ``obj``, MindSpore's parameter dict (:class:`ParamDict`, every
    leaf verified and read whole) for :func:`load_param_into_net`.

    Each leaf is read straight into the layout ``obj``'s variable has now (a trained step's plan, or one device for
    a fresh module); the saved layout, device count and process count do not matter. Every leaf's content checksum
    is verified before anything is written into ``obj``: a flipped bit, a truncated or a missing file raises
    :class:`~mshard.errors.CheckpointError` naming the leaf and the file. Leaves match by exact name, else by one
    prefix mapping (a TrainOneStepCell's checkpoint loads into its bare network and back). Saved optimizer or RNG
    state the object has no place for is reported, not an error; a dtype that differs is cast (docs/checkpoint.md).

    Args:
        directory: a checkpoint directory written by :func:`save_checkpoint`.
        obj: the object to fill: a Cell, any nnx module or a TrainOneStepCell.
        step: the step to load; None: the last committed one.
        strict: whether a leaf of ``obj`` the checkpoint lacks, a shape that differs or a saved parameter with
            nowhere to go is an error listing every difference; False loads the leaves that match.
        inputs: example inputs; ``obj`` is first placed on the plan its region makes for them (so no device ever
            holds a whole split parameter). None: the current layouts.
        layouts: leaf name -> ``jax.sharding.Sharding`` for single leaves (e.g. from :func:`infer_predict_layout`).

    Returns:
        A :class:`LoadResult`: the step, its metadata, what was not loaded either way and what was cast.

    >>> import tempfile
    >>> from flax import nnx
    >>> d = tempfile.mkdtemp()
    >>> _ = save_checkpoint(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), d).wait()
    >>> try:
    ...     load_checkpoint(d, nnx.Linear(2, 4, rngs=nnx.Rngs(0)))
    ... except CheckpointError as e:
    ...     print(str(e).splitlines()[2])
      kernel: shape (2, 4) here, (2, 3) in the checkpoint
    """
    what = "load_checkpoint"
    directory = os.path.abspath(os.fspath(directory))
    step = store.resolve_step(directory, step, what)
    meta = store.read_meta(directory, step, what)
    if obj is None:
        return _param_dict(directory, step, meta, what)
    if inputs is not None:
        _place(obj, tuple(inputs))
    targets = leaves_of(obj)
    saved = meta["leaves"]
    names = _match(targets, saved)
    used = set(names.values())
    missing = [t.name for t in targets if t.name not in names]
    shapes = [(t.name, tuple(t.value.shape), tuple(saved[names[t.name]]["shape"])) for t in targets
              if t.name in names and tuple(t.value.shape) != tuple(saved[names[t.name]]["shape"])]
    extra = [s for s in saved if s not in used]
    extra_params = [s for s in extra if saved[s]["kind"] == "Param"]
    if strict and (missing or shapes or extra_params):
        lines = [f"{what}: step {step} of {directory!r} does not fit {type(obj).__name__}:"]
        lines += [f"  {n}: shape {a} here, {b} in the checkpoint" for n, a, b in shapes]
        lines += [f"  {n}: not in the checkpoint" for n in missing]
        lines += [f"  {s}: in the checkpoint, no such {saved[s]['kind']} here" for s in extra_params]
        lines.append("Load into the model that was saved, or pass strict=False to load the leaves that match.")
        raise CheckpointError("\n".join(lines))
    load = [t for t in targets if t.name in names and t.name not in {n for n, _, _ in shapes}]
    tgt = {}
    for t in load:
        s = names[t.name]
        tgt[s] = jax.ShapeDtypeStruct(tuple(saved[s]["shape"]), jnp.dtype(saved[s]["dtype"]),
                                      sharding=_target_sharding(t.value, t.name, layouts))
    store.check_files(directory, step, list(tgt), what)
    restored = _restore(directory, step, tgt, what) if tgt else {}      # nothing matches: nothing to read
    _verify(restored, saved, directory, step, what)
    values, cast = {}, []
    for t in load:
        s = names[t.name]
        x = restored[s]
        impl = saved[s].get("key_impl")
        if impl:
            x = jax.random.wrap_key_data(x, impl=impl)
        elif x.dtype != t.value.dtype:
            x = x.astype(t.value.dtype)
            cast.append(t.name)
        values[t.path] = x
    assign(obj, values)
    not_loaded = missing + [n for n, _, _ in shapes]
    return LoadResult(step, meta.get("metadata", {}), not_loaded, sorted(extra), cast, meta.get("strategy"))


def _whole_sharding() -> jax.sharding.Sharding:
    if jax.process_count() > 1:
        return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _param_dict(directory: str, step: int, meta: dict, what: str) -> ParamDict:
    saved = meta["leaves"]
    tgt = {n: jax.ShapeDtypeStruct(tuple(i["shape"]), jnp.dtype(i["dtype"]), sharding=_whole_sharding())
           for n, i in saved.items()}
    store.check_files(directory, step, list(tgt), what)
    restored = _restore(directory, step, tgt, what) if tgt else {}
    _verify(restored, saved, directory, step, what)
    out = ParamDict()
    for n, x in restored.items():
        impl = saved[n].get("key_impl")
        out[n] = jax.random.wrap_key_data(x, impl=impl) if impl else x
    out.kinds = {n: i["kind"] for n, i in saved.items()}
    out.step = step
    return out


def load_param_into_net(net: nnx.Module, parameter_dict: dict, strict_load: bool = False) -> tuple[list, list]:
    """MindSpore's ``load_param_into_net``: write a parameter dict (``ms.load_checkpoint(directory)``, or any dict
    of name -> array) into ``net`` in place, each value placed in the layout its variable has now.

    Names match exactly, else by one prefix (a TrainOneStepCell's ``network.backbone.`` against the bare network,
    either way), as :func:`load_checkpoint` matches them.

    Args:
        net: the object to fill (a Cell, any nnx module or a TrainOneStepCell).
        parameter_dict: name -> array (a :class:`ParamDict` or a plain dict).
        strict_load: whether a leaf of ``net`` the dict does not fill, or a value of another shape, is an error.

    Returns:
        ``(param_not_load, ckpt_not_load)``: ``net``'s leaves not filled, and the dict's names that went nowhere.

    >>> import tempfile, mshard as ms
    >>> from flax import nnx
    >>> d = tempfile.mkdtemp()
    >>> _ = ms.save_checkpoint(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), d)
    >>> ms.load_param_into_net(nnx.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(1)), ms.load_checkpoint(d))
    ([], ['bias'])
    """
    if not isinstance(parameter_dict, dict):
        raise CheckpointTypeError(f"load_param_into_net: parameter_dict must be a dict of name -> array (what "
                                  f"ms.load_checkpoint(directory) returns), got {type(parameter_dict).__name__}.")
    kinds = getattr(parameter_dict, "kinds", {})
    stored = {n: jax.random.key_data(x) if jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key) else x
              for n, x in parameter_dict.items()}          # a PRNG key as its key data, the form leaves_of gives
    saved = {n: {"kind": kinds.get(n, "Param"), "shape": tuple(np.shape(x))} for n, x in stored.items()}
    targets = leaves_of(net)
    names = _match(targets, saved)
    shapes = [t.name for t in targets if t.name in names and tuple(t.value.shape) != saved[names[t.name]]["shape"]]
    missing = [t.name for t in targets if t.name not in names]
    if strict_load and (missing or shapes):
        raise CheckpointError(f"load_param_into_net: {type(net).__name__} leaves {missing + shapes} are not filled "
                              f"by the dict (missing, or of another shape); pass strict_load=False to load the rest.")
    values = {}
    for t in targets:
        if t.name in names and t.name not in shapes:
            x = stored[names[t.name]]
            values[t.path] = jax.device_put(jnp.asarray(x, t.value.dtype), t.value.sharding)
    assign(net, values)
    used = {names[t.name] for t in targets if t.name in names and t.name not in shapes}
    return missing + shapes, sorted(n for n in parameter_dict if n not in used)


def _restore(directory, step: int, tgt: dict, what: str) -> dict:
    """Read the leaves ``tgt`` names (saved name -> target ShapeDtypeStruct) of one step with orbax."""
    m = store.manager(directory, for_restore=True)
    m.wait_until_finished()
    try:
        out = m.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            tgt, restore_args=ocp.checkpoint_utils.construct_restore_args(tgt), partial_restore=True)))
    except Exception as e:
        raise store.restore_error(e, directory, step, list(tgt), what) from e
    return dict(out["state"])


# -- MindSpore's distributed names -----------------------------------------------------------------------
def load_distributed_checkpoint(network: nnx.Module, checkpoint_dir: str | os.PathLike | list,
                                predict_strategy: dict[str, jax.sharding.Sharding] | None = None, *,
                                step: int | None = None, strict_load: bool = False,
                                inputs: tuple | None = None) -> LoadResult:
    """MindSpore's ``load_distributed_checkpoint``: load a checkpoint saved under any strategy and device count
    into ``network``, laid out by ``predict_strategy`` (:func:`load_checkpoint` with ``layouts``).

    Differences from MindSpore: ``checkpoint_dir`` is one checkpoint directory (the per-rank file list and the
    training strategy file are not needed: the checkpoint holds global arrays and their layouts).

    Args:
        network: the object to fill (a Cell or any nnx module).
        checkpoint_dir: a checkpoint directory written by :func:`save_checkpoint` (or a list naming it once per rank,
            as MindSpore's per-rank file list).
        predict_strategy: leaf name -> ``jax.sharding.Sharding``, as ``ms.infer_predict_layout`` returns; leaves
            it does not name keep their current layout. None: every leaf keeps its current layout.
        step: the step to load; None: the last committed one.
        strict_load: as :func:`load_checkpoint`'s ``strict`` (False by default, as in MindSpore).
        inputs: as :func:`load_checkpoint`'s ``inputs``.

    Returns:
        The :class:`LoadResult` of the load.

    >>> import tempfile, jax.numpy as jnp, mshard as ms
    >>> from flax import nnx
    >>> d = tempfile.mkdtemp()
    >>> _ = ms.save_checkpoint(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), d)
    >>> net = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    >>> r = ms.load_distributed_checkpoint(net, d, ms.infer_predict_layout(net, jnp.ones((8, 4))))
    >>> r.step, r.param_not_load
    (0, [])
    """
    if isinstance(checkpoint_dir, (list, tuple)):
        # MindSpore passes one checkpoint file per rank; here every rank's list entry names the same checkpoint
        # (global arrays), which may be given once per rank
        dirs = sorted({os.path.abspath(os.fspath(d)) for d in checkpoint_dir})
        if len(dirs) != 1:
            raise CheckpointTypeError(
                f"load_distributed_checkpoint: checkpoint_filenames names {len(dirs)} checkpoints ({dirs[:3]}...); "
                f"an mshard checkpoint holds every rank's shards in one directory: pass that directory (e.g. "
                f"ModelCheckpoint's latest_ckpt_file_name).")
        checkpoint_dir = dirs[0]
    return load_checkpoint(checkpoint_dir, network, step=step, strict=strict_load, inputs=inputs,
                           layouts=predict_strategy)


def _dst_layouts(plan, saved: dict, devices) -> dict[str, NamedSharding]:
    mesh = jax.sharding.Mesh(np.array(devices[:int(np.prod(plan.mesh.shape))]).reshape(plan.mesh.shape),
                             plan.mesh.names)
    # the strategy file's parameters (its optimizer-state entries are the planner's, before the step lays the state
    # out like its parameter): each optimizer-state leaf follows the parameter its path ends with
    params = {k: v for k, v in plan.param_specs.items() if saved.get(k, {}).get("kind") == "Param"}
    out = {}
    by_len = sorted(params, key=len, reverse=True)
    for name, info in saved.items():
        spec = params.get(name)
        if spec is None:           # optimizer state follows its parameter (the same shape under a longer path)
            spec = next((params[p] for p in by_len if name.endswith("." + p.split("network.", 1)[-1])), None)
        if spec is not None and len(spec) > len(info["shape"]):
            spec = None
        out[name] = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
    return out


def transform_checkpoints(src_checkpoints_dir: str | os.PathLike, dst_checkpoints_dir: str | os.PathLike,
                          ckpt_prefix: str | None = None, src_strategy_file: str | os.PathLike | None = None,
                          dst_strategy_file: str | os.PathLike | None = None, process_num: int = 1,
                          output_format: str = "ckpt", *, step: int | None = None) -> int:
    """MindSpore's ``transform_checkpoints``: rewrite a step of a checkpoint saved under one strategy as a
    checkpoint laid out by another strategy file (``plan.save`` / ``strategy_ckpt_config``), on that strategy's
    device count. Leaves the destination strategy does not name are replicated (optimizer state follows its
    parameter). Differences from MindSpore: directories of this module's format, not per-rank ``.ckpt`` files;
    loading needs no transform (any layout loads), so this is only to store a checkpoint in another layout.

    Args:
        src_checkpoints_dir: the checkpoint directory to read.
        dst_checkpoints_dir: the checkpoint directory to write (the whole checkpoint, every rank's shards: load
            it with ``ms.load_checkpoint(dst_checkpoints_dir, net)``); it must not hold the step already.
        ckpt_prefix: MindSpore's per-rank file prefix; accepted, unused (one directory, no per-rank files).
        src_strategy_file: optional (the checkpoint records its layouts); when given, it must agree with them.
        dst_strategy_file: the strategy file to lay the checkpoint out by (required).
        process_num: MindSpore's worker count; accepted, unused (orbax reads and writes in parallel itself).
        output_format: ``"ckpt"`` or ``"safetensors"``; accepted, the format is always this module's.
        step: the step to transform; None: the last committed one.

    Returns:
        The step written.

    >>> import os, tempfile, jax.numpy as jnp, mshard as ms
    >>> from flax import nnx
    >>> src, dst, d = tempfile.mkdtemp(), tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> net = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    >>> _ = ms.save_checkpoint(net, src, step=3)
    >>> with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
    ...     ms.jit(lambda m, x: m(x)).plan(net, jnp.ones((8, 4))).save(os.path.join(d, "strategy.json"))
    >>> ms.transform_checkpoints(src, dst, dst_strategy_file=os.path.join(d, "strategy.json"))
    3
    >>> ms.load_checkpoint(dst, nnx.Linear(4, 8, rngs=nnx.Rngs(1))).strategy["mesh"]
    {'names': ['d0', 'd1', 'd2'], 'shape': [2, 2, 2]}
    """
    what = "transform_checkpoints"
    src = os.path.abspath(os.fspath(src_checkpoints_dir))
    step = store.resolve_step(src, step, what)
    meta = store.read_meta(src, step, what)
    saved = meta["leaves"]
    if src_strategy_file is not None:
        sp = load_plan(src_strategy_file)
        diff = []
        for n, spec in sp.param_specs.items():
            if saved.get(n, {}).get("kind") != "Param":
                continue
            lay = saved[n].get("layout", {})
            if "spec" in lay:
                have = tuple(tuple(d) if isinstance(d, list) else d for d in lay["spec"])
                want = tuple(spec) + (None,) * (len(have) - len(tuple(spec)))
                have = have + (None,) * (len(want) - len(have))
                if have != want:
                    diff.append(f"{n}: saved {have}, strategy file {want}")
        if diff:
            raise CheckpointError(f"{what}: the checkpoint in {src!r} was not saved with {os.fspath(src_strategy_file)!r}:"
                                  f" {'; '.join(diff[:5])}. Give the strategy file it was saved with, or none.")
    if dst_strategy_file is None:
        raise CheckpointError(f"{what}: dst_strategy_file is required (a strategy file written by plan.save or "
                              f"strategy_ckpt_config={{'save_file': ...}}).")
    plan = load_plan(dst_strategy_file)
    if int(np.prod(plan.mesh.shape)) > jax.device_count():
        raise CheckpointError(f"{what}: the destination strategy needs {int(np.prod(plan.mesh.shape))} devices, this "
                              f"job has {jax.device_count()}; run it where the destination devices exist.")
    lay = _dst_layouts(plan, saved, jax.devices())
    tgt = {n: jax.ShapeDtypeStruct(tuple(i["shape"]), jnp.dtype(i["dtype"]), sharding=lay[n]) for n, i in saved.items()}
    store.check_files(src, step, list(tgt), what)
    try:
        out = store.manager(src, for_restore=True).restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            tgt, restore_args=ocp.checkpoint_utils.construct_restore_args(tgt))))
    except Exception as e:
        raise store.restore_error(e, src, step, list(tgt), what) from e
    restored = dict(out["state"])
    _verify(restored, saved, src, step, what)
    new_meta = dict(meta)
    new_meta["strategy"] = plan.to_json()
    new_meta["leaves"] = {n: dict(saved[n], layout=_spec_json(restored[n]), grid=list(grid_of(restored[n])))
                          for n in saved}
    grids = [tuple(new_meta["leaves"][n]["grid"]) for n in restored]
    for n, s in zip(restored, block_sums(list(restored.values()), grids)):
        new_meta["leaves"][n]["checksum"] = s.reshape(-1, 2).tolist()
    dst = os.path.abspath(os.fspath(dst_checkpoints_dir))
    if step in store.steps(dst):
        raise CheckpointError(f"{what}: step {step} already exists in {dst!r}; give an empty destination.")
    m = store.manager(dst)
    m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(restored), mshard=ocp.args.JsonSave(new_meta)))
    m.wait_until_finished()
    return step
