"""The on-disk checkpoint: orbax does the I/O, mshard decides what is saved, where it goes and whether it is intact.

The format (one directory per step, ``state/`` as zarr arrays one chunk per shard, ``mshard/`` JSON with
layouts and checksums, orbax's atomic commit) is in docs/checkpoint.md.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours: see _finish_saves)
import gc
import itertools
import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass

import numpy as np
import orbax.checkpoint as ocp

from mshard._src.values.errors import CheckpointError


class _NoMergeNote(logging.Filter):
    """Orbax notes at WARNING level, on every save, that it found no OCDBT files to merge: mshard saves without
    OCDBT on purpose (one file per shard, so a damaged shard is named), so the note says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


logging.getLogger("absl").addFilter(_NoMergeNote())

FORMAT = "mshard-checkpoint"
VERSION = 1
_MANAGERS: dict[tuple, ocp.CheckpointManager] = {}


def manager(directory: str, keep: int | None = None, async_save: bool = False,
            for_restore: bool = False) -> ocp.CheckpointManager:
    """The (cached) orbax manager of ``directory``: keeps the last ``keep`` steps (all when None). A restore
    uses whichever manager the directory has."""
    directory = os.path.abspath(os.fspath(directory))
    if for_restore:
        for k, m in _MANAGERS.items():
            if k[0] == directory:
                return m
    key = (directory, keep, async_save)
    m = _MANAGERS.get(key)
    if m is None:
        for k in [k for k in _MANAGERS if k[0] == directory]:      # one manager per directory at a time
            _MANAGERS.pop(k).wait_until_finished()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                            enable_async_checkpointing=async_save)
        m = ocp.CheckpointManager(directory, options=opts, item_handlers={
            "state": ocp.PyTreeCheckpointHandler(use_ocdbt=False), "mshard": ocp.JsonCheckpointHandler()})
        _MANAGERS[key] = m
    return m


def finish(directory: str | None = None) -> None:
    """Block until every save in flight to ``directory`` (every directory when None) is committed. Called before
    the process reads or writes a directory's steps, so a save followed at once by a load (or another save) sees
    its own checkpoint."""
    directory = None if directory is None else os.path.abspath(os.fspath(directory))
    for k, m in list(_MANAGERS.items()):
        if directory is None or k[0] == directory:
            m.wait_until_finished()


def _finish_saves() -> None:
    """Commit every save still in flight before the interpreter shuts down. Orbax's background commit submits
    work to thread pools, which refuse new work once ``concurrent.futures`` has run its own exit hook (it runs
    before ``atexit``'s): so this runs among the threading module's exit hooks, registered after that one
    (they run last-registered first), and again from ``atexit`` for an interpreter without them."""
    for m in list(_MANAGERS.values()):
        try:
            m.wait_until_finished()
        except Exception as e:  # the process is exiting: say what was lost, do not raise from an exit hook
            logging.getLogger(__name__).error("mshard: a checkpoint save did not commit before exit: %s", e)


_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_saves)
atexit.register(_finish_saves)


def steps(directory: str) -> list[int]:
    """The committed steps of ``directory`` (a half-written step is not one), after this process's saves to it
    in flight have committed."""
    finish(directory)
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isfile(os.path.join(directory, n, "state", "commit_success.txt"))
                  and os.path.isdir(os.path.join(directory, n, "mshard")))


def resolve_step(directory: str, step: int | None, what: str) -> int:
    found = steps(directory)
    if not found:
        raise CheckpointError(f"{what}: no committed checkpoint in {directory!r} (a directory written by "
                              f"ms.save_checkpoint holds one sub-directory per step; a save that was killed "
                              f"before it committed is not loaded).")
    if step is None:
        return found[-1]
    if step not in found:
        raise CheckpointError(f"{what}: step {step} is not a committed checkpoint in {directory!r}; committed steps: "
                              f"{found}.")
    return step


def _read_json(path: str, what: str) -> dict:
    """A JSON file of the checkpoint, or a CheckpointError naming ``what`` and the file."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what}: cannot read {path}: {e}. The checkpoint is damaged; load an earlier step."
                              ) from e


def read_meta(directory: str, step: int, what: str) -> dict:
    path = os.path.join(directory, str(step), "mshard", "metadata")
    meta = _read_json(path, f"{what}: the mshard metadata of step {step}")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{what}: {path} is not an mshard checkpoint of version {VERSION}.")
    return meta


@dataclass(frozen=True)
class Chunks:
    shape: tuple[int, ...]
    chunks: tuple[int, ...]

    def files(self) -> list[str]:
        grid = [-(-n // c) if c else 1 for n, c in zip(self.shape, self.chunks)]
        if not grid:
            return ["0"]
        return [".".join(map(str, ix)) for ix in np.ndindex(*grid)]

    def covering(self, lo: tuple[int, ...], hi: tuple[int, ...]) -> list[str]:
        """The chunk files that hold the index box [lo, hi)."""
        if not self.shape:
            return ["0"]
        rngs = [range(a // c, -(-b // c)) for a, b, c in zip(lo, hi, self.chunks)]
        return [".".join(map(str, ix)) for ix in itertools.product(*rngs)]


def leaf_dir(directory: str, step: int, name: str) -> str:
    return os.path.join(directory, str(step), "state", name)


def chunks_of(directory: str, step: int, name: str, what: str) -> Chunks:
    z = _read_json(os.path.join(leaf_dir(directory, step, name), ".zarray"), f"{what}: leaf {name!r}")
    return Chunks(tuple(z["shape"]), tuple(z["chunks"]))


def check_files(directory: str, step: int, names: list[str], what: str) -> None:
    """Every chunk file of every leaf to load exists (zarr would read a missing chunk as its fill value)."""
    for name in names:
        ch = chunks_of(directory, step, name, what)
        d = leaf_dir(directory, step, name)
        missing = [f for f in ch.files() if not os.path.isfile(os.path.join(d, f))]
        if missing:
            raise CheckpointError(f"{what}: leaf {name!r}: file {os.path.join(d, missing[0])} is missing"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the checkpoint "
                                  f"of step {step} is incomplete. Load an earlier step.")


def _orphan(u) -> bool:
    """An orphaned read of a failed restore: its own error, or its event loop gone when it is finally collected."""
    msg = str(u.exc_value)
    return msg.startswith("Encountered error while reading array index") or (
        isinstance(u.exc_value, RuntimeError) and msg == "Event loop is closed")


def _drop_orphans() -> None:
    """A failed orbax restore leaves its other reads as coroutines that were never awaited, each of which Python
    would print as "Exception ignored in ..." when it is collected (the CheckpointError raised says it all):
    collect them now, and from now on drop exactly these reports (other unraisable errors still reach the hook)."""
    hook = sys.unraisablehook
    if not getattr(hook, "_mshard_orphans", False):
        def quiet(u, _hook=hook):
            if not _orphan(u):
                _hook(u)
        quiet._mshard_orphans = True
        sys.unraisablehook = quiet
    gc.collect()


def restore_error(e: BaseException, directory: str, step: int, names: list[str], what: str) -> CheckpointError:
    """Orbax's restore error, with the leaf and file it is about (TensorStore's message is in the cause chain)."""
    _drop_orphans()
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(str(x))
        x = x.__cause__ or x.__context__
    text = " | ".join(chain)
    leaf = next((n for n in sorted(names, key=len, reverse=True) if f"{n}/" in text or f"{n}." in text), None)
    m = re.search(r'"([^"]*/[^"/]+)"', text)
    file = m.group(1) if m else None
    if leaf and file and not os.path.isabs(file):
        file = os.path.join(directory, str(step), "state", file)
    where = f"leaf {leaf!r}" if leaf else "a leaf"
    return CheckpointError(f"{what}: {where}{f', file {file}' if file else ''}: the checkpoint of step {step} in "
                           f"{directory!r} cannot be read: {chain[-1][:400]}. The file is damaged or truncated; load "
                           f"an earlier step.")
