"""``ms.communication``: join the job's processes (MindSpore's ``mindspore.communication`` names) and fail fast.

``init()`` finds out how the job was started and calls ``jax.distributed.initialize`` accordingly:

1. ``mshard run`` (``MSHARD_COORDINATOR``, ``MSHARD_NUM_PROCESSES``, ``MSHARD_PROCESS_ID``, ``MSHARD_LOCAL_RANK``);
2. a cluster JAX detects itself: SLURM (``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``,
   the first host of ``SLURM_STEP_NODELIST``), Open MPI (``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``,
   ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_MCA_orte_hnp_uri``) and the other clusters of
   ``jax.distributed.initialize`` (Kubernetes JobSets, GKE TPU, ...);
3. none of these: one process, nothing to join.

It prints one line naming the source it used. It also sets fail-fast defaults, each overridable:

- ``heartbeat_timeout_seconds=10``: a peer that stops (SIGSTOP, a deadlock, a partition) is detected in ~10 s
  (JAX's default is 100 s);
- ``shutdown_timeout_seconds=10``: a clean exit waits at most this long for the others;
- ``collective_timeout_seconds=60`` (CPU collectives, ``--xla_cpu_collective_timeout_seconds``; XLA's default is
  30 minutes): a collective whose peer never arrives raises instead of waiting;
- an uncaught exception in any thread logs ``mshard: rank r failed at <time>: <error>`` with its traceback and
  ends the process at once with ``os._exit(1)``, instead of waiting in JAX's shutdown barrier for peers that will
  never arrive (which took 300 s before); ``mshard run`` then stops the other workers.

>>> import mshard as ms
>>> ms.communication.detect({})
('single process', None)
>>> ms.communication.detect({"MSHARD_COORDINATOR": "10.0.0.1:8118", "MSHARD_NUM_PROCESSES": "4",
...                          "MSHARD_PROCESS_ID": "2", "MSHARD_LOCAL_RANK": "0"})[1]["process_id"]
2
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import jax

from mshard._src.values.errors import ContextError

__all__ = ["detect", "get_group_size", "get_local_rank", "get_rank", "init", "release"]

_STATE: dict[str, Any] = {"source": None, "local_rank": 0}


def _slurm(env: Mapping[str, str]) -> dict | None:
    if "SLURM_JOB_ID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
    first = nodes.split(",")[0]
    if "[" in first:                          # "node[01-04]" -> "node01"
        prefix, rest = first.split("[", 1)
        first = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    port = int(env.get("MSHARD_MASTER_PORT", 8118))
    return {"coordinator_address": f"{first}:{port}", "num_processes": int(env["SLURM_NTASKS"]),
            "process_id": int(env.get("SLURM_PROCID", 0)), "local_rank": int(env.get("SLURM_LOCALID", 0))}


def _ompi(env: Mapping[str, str]) -> dict | None:
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    uri = env.get("OMPI_MCA_orte_hnp_uri") or env.get("PMIX_SERVER_URI2", "")
    # "123.0;tcp://10.1.2.3:4567": the job's head node
    host = uri.split(";")[1].split("//")[-1].split(":")[0] if ";" in uri else env.get("MSHARD_MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MSHARD_MASTER_PORT", 8118))
    return {"coordinator_address": f"{host}:{port}", "num_processes": int(env["OMPI_COMM_WORLD_SIZE"]),
            "process_id": int(env.get("OMPI_COMM_WORLD_RANK", 0)),
            "local_rank": int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))}


def _mshard(env: Mapping[str, str]) -> dict | None:
    if "MSHARD_COORDINATOR" not in env:
        return None
    try:
        return {"coordinator_address": env["MSHARD_COORDINATOR"], "num_processes": int(env["MSHARD_NUM_PROCESSES"]),
                "process_id": int(env["MSHARD_PROCESS_ID"]), "local_rank": int(env.get("MSHARD_LOCAL_RANK", 0))}
    except (KeyError, ValueError) as e:
        raise ContextError(f"ms.communication.init: MSHARD_COORDINATOR is set but {e} is missing or not an integer; "
                           f"start workers with `mshard run`, which sets MSHARD_NUM_PROCESSES and "
                           f"MSHARD_PROCESS_ID.") from e


# the order init() tries them in: mshard run's own variables win over the cluster the launcher runs inside
SOURCES = (("mshard run", _mshard), ("SLURM", _slurm), ("Open MPI", _ompi))


def _jax_clusters() -> list[str]:
    """The clusters JAX's own detection finds in this process's environment (Kubernetes JobSets, TPU pods, mpi4py,
    ...), by class name; [] when none (or when this JAX has no such registry)."""
    try:
        from jax._src import clusters  # private: imported where used, so its absence means "not detected"
        return [c.__name__ for c in clusters.ClusterEnv._cluster_types if c.is_env_present()]
    except Exception:            # a private registry: its absence only means "not detected"
        return []


def detect(env: Mapping[str, str] | None = None) -> tuple[str, dict | None]:
    """Which launcher started this process, as :func:`init` finds it; reads the environment and starts nothing.

    The sources are tried in order: ``mshard run``, SLURM, Open MPI, then (for the real environment only) the
    clusters of JAX's own detection. Not in MindSpore: use it to check a launch before calling ``init()``.

    Args:
        env: the environment variables to read; None: ``os.environ``.

    Returns:
        ``(source, arguments for jax.distributed.initialize)``: e.g. ``("SLURM", {"coordinator_address": ...,
        "num_processes": ..., "process_id": ..., "local_rank": ...})``; ``("jax: <ClusterClass>", {})`` for a
        cluster only JAX's detection knows (``initialize()`` finds the rest); ``("single process", None)``.

    >>> detect({})
    ('single process', None)
    >>> detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "node[01-02]"})
    ('SLURM', {'coordinator_address': 'node01:8118', 'num_processes': 2, 'process_id': 1, 'local_rank': 0})
    """
    real = env is None
    env = os.environ if env is None else env
    for name, fn in SOURCES:
        found = fn(env)
        if found is not None:
            return name, found
    if real:
        found = _jax_clusters()
        if found:
            return f"jax: {found[0]}", {}
    return "single process", None


def _fail_fast_hooks(rank: int) -> None:
    def die(exc_type, exc, tb):
        # the time lets `mshard run` tell the first failure from the ones it caused in the peers
        sys.stderr.write(f"mshard: rank {rank} failed at {time.time():.6f}: {exc_type.__name__}: {exc}\n")
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = die
    threading.excepthook = lambda a: die(a.exc_type, a.exc_value, a.exc_traceback)


def _collective_timeout(seconds: int) -> None:
    """Put the CPU collective timeout into XLA_FLAGS (read when JAX creates its CPU client)."""
    import jax._src.xla_bridge as xb  # private: JAX 0.10 has no public way to ask whether the CPU client exists
    if getattr(xb, "_backends", None):
        return                               # too late for this process: the client exists
    flag = "--xla_cpu_collective_timeout_seconds"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={int(seconds)}".strip()


def init(backend_name: str | None = None, *, heartbeat_timeout_seconds: int = 10,
         shutdown_timeout_seconds: int = 10, collective_timeout_seconds: int = 60,
         initialization_timeout: int | None = None, fail_fast: bool = True, quiet: bool = False) -> str:
    """Join the job's processes (MindSpore's ``init``) through ``jax.distributed.initialize``.

    Call it once, before any JAX computation; a second call returns the first one's source. The launcher is found
    by :func:`detect`; the fail-fast defaults are described in the module docstring. In a single process it only
    records that: nothing is joined and no timeout or hook is set.
    Differences from MindSpore: a rank is a *process*, which may drive several devices
    (``jax.local_device_count()``); ``get_group_size()`` counts processes.

    Args:
        backend_name: MindSpore's ``"hccl"`` / ``"nccl"``; ignored: JAX picks the collectives of its platform
            (gloo on CPU, NCCL on GPU).
        heartbeat_timeout_seconds: how soon a peer that stops is detected (JAX's default is 100 s).
        shutdown_timeout_seconds: how long a clean exit waits for the other processes.
        collective_timeout_seconds: how long a CPU collective waits for a peer before it raises
            (``--xla_cpu_collective_timeout_seconds``; XLA's default is 30 minutes).
        initialization_timeout: seconds to wait for every process to join; None: ``MSHARD_CLUSTER_TIME_OUT`` or 300.
        fail_fast: whether an uncaught exception in any thread logs the rank and ends the process at once.
        quiet: whether to skip the one line on stderr that names the source.

    Returns:
        The source used: ``"mshard run"``, ``"SLURM"``, ``"Open MPI"``, ``"jax: <ClusterClass>"`` or
        ``"single process"``.

    >>> init(quiet=True)            # no launcher: one process
    'single process'
    >>> get_rank(), get_group_size(), get_local_rank()
    (0, 1, 0)
    >>> release()
    """
    source, args = detect()
    if _STATE["source"] is not None:
        return _STATE["source"]
    if args is None:
        _STATE.update(source=source, local_rank=0)
        if not quiet:
            print(f"mshard.communication.init: {source}", file=sys.stderr, flush=True)
        return source
    _collective_timeout(collective_timeout_seconds)
    if initialization_timeout is None:
        initialization_timeout = int(os.environ.get("MSHARD_CLUSTER_TIME_OUT", 300))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")      # CPU devices only; GPUs use NCCL
    local_rank = args.pop("local_rank", 0)
    jax.distributed.initialize(**args, initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                               shutdown_timeout_seconds=shutdown_timeout_seconds)
    _STATE.update(source=source, local_rank=local_rank)
    if fail_fast:
        _fail_fast_hooks(jax.process_index())
    if not quiet:
        print(f"mshard.communication.init: {source}: process {jax.process_index()} of {jax.process_count()}, "
              f"coordinator {args.get('coordinator_address', '(found by JAX)')}, {jax.local_device_count()} local "
              f"devices", file=sys.stderr, flush=True)
    return source


def get_rank() -> int:
    """This process's rank (MindSpore's ``get_rank``): ``jax.process_index()``.

    Call it after :func:`init`: reading it starts JAX's backend, after which a job can no longer be joined.

    Returns:
        The process index, from 0 to ``get_group_size() - 1``; 0 in a single process.

    >>> get_rank()
    0
    """
    return jax.process_index()


def get_group_size() -> int:
    """The number of processes in the job (MindSpore's ``get_group_size``): ``jax.process_count()``.

    Differences from MindSpore: it counts processes, not devices (a process may drive several devices).
    Call it after :func:`init`, as :func:`get_rank`.

    Returns:
        The process count; 1 in a single process.

    >>> get_group_size()
    1
    """
    return jax.process_count()


def get_local_rank() -> int:
    """This process's rank on its node (MindSpore's ``get_local_rank``), as the launcher gave it to :func:`init`.

    Returns:
        The local rank; 0 for one process and before ``init()``.

    >>> get_local_rank()
    0
    """
    return int(_STATE["local_rank"])


def release() -> None:
    """Leave the job (MindSpore's ``release``): ``jax.distributed.shutdown`` after a clean finish.

    In a single process (or before ``init()``) there is nothing to leave. Either way it forgets ``init()``'s source
    and local rank.

    >>> init(quiet=True)
    'single process'
    >>> release()
    >>> get_local_rank()
    0
    """
    if _STATE["source"] not in (None, "single process"):
        jax.distributed.shutdown()
    _STATE.update(source=None, local_rank=0)
