"""``mshard run``: start a job's local workers with one command, as MindSpore's ``msrun`` does, and end it fast.

    mshard run --worker_num=8 --local_worker_num=4 --master_addr=10.0.0.1 --master_port=8118 --node_rank=0 \\
        --log_dir=logs train.py --lr 1e-3          # on each node (node_rank 0 and 1)
    mshard run --worker_num=2 --local_worker_num=2 train.py                     # one machine, two processes
    mshard run --dry_run --worker_num=64 train.py                               # plan for 64 devices, run nothing

Each worker runs ``python train.py args...`` with its rank in the environment (``MSHARD_COORDINATOR``,
``MSHARD_NUM_PROCESSES``, ``MSHARD_PROCESS_ID``, ``MSHARD_LOCAL_RANK``, ``MSHARD_LOCAL_WORKER_NUM``,
``MSHARD_CLUSTER_TIME_OUT``; and MindSpore's ``RANK_ID``, ``RANK_SIZE``, ``LOCAL_RANK``, ``MS_WORKER_NUM``,
``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_NODE_RANK``); the script calls ``ms.communication.init()``. Its output
goes to ``log_dir/worker_<rank>.log``; ``--tail_worker_log`` picks the rank whose log is echoed (-1: every local
worker, prefixed with its rank).

Fail fast: when a worker exits with an error (an exception ends it at once, see ``ms.communication``; a peer
that died or hangs makes the others fail within the heartbeat or collective timeout), the launcher kills every
other local worker (its whole process group), prints the failing rank, how it ended and the last lines of its
log, and exits non-zero. ``--join`` is accepted for msrun's command lines; the launcher always waits for its
workers.

Dry run (``--dry_run``, msrun's simulation): one process with ``worker_num`` simulated CPU devices (times
``--sim_devices_per_worker``) runs the script until its first jitted region or training step, which is traced,
planned and compiled but not run; the plan summary and the compiled per-device memory are printed and the script
ends there (exit 0).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

__all__ = ["main", "run"]


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes"):
        return True
    if v.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {v!r}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mshard run", description="Start a job's local workers (MindSpore's msrun).")
    ap.add_argument("--worker_num", type=int, default=1, help="processes in the whole job")
    ap.add_argument("--local_worker_num", type=int, default=None, help="processes on this node (default worker_num)")
    ap.add_argument("--master_addr", default="127.0.0.1", help="the coordinator's address (node 0)")
    ap.add_argument("--master_port", type=int, default=8118, help="the coordinator's port")
    ap.add_argument("--node_rank", type=int, default=0, help="this node's index")
    ap.add_argument("--log_dir", default="mshard_log", help="worker logs: log_dir/worker_<rank>.log")
    ap.add_argument("--join", type=_bool, nargs="?", const=True, default=True,
                    help="accepted for msrun command lines; the launcher always waits for its workers")
    ap.add_argument("--cluster_time_out", type=int, default=300, help="seconds for the processes to find each other")
    ap.add_argument("--tail_worker_log", type=int, default=-1, help="the rank whose log is echoed (-1: all local)")
    ap.add_argument("--dry_run", action="store_true", help="plan and compile the first step for worker_num devices")
    ap.add_argument("--sim_devices_per_worker", type=int, default=1,
                    help="dry run: simulated devices per worker (the devices one process drives)")
    ap.add_argument("script", help="the training script")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return ap


def _check(a: argparse.Namespace) -> None:
    local = a.local_worker_num if a.local_worker_num is not None else a.worker_num
    a.local_worker_num = local
    if a.worker_num < 1 or local < 1:
        raise SystemExit(f"mshard run: --worker_num ({a.worker_num}) and --local_worker_num ({local}) must be >= 1.")
    if local > a.worker_num:
        raise SystemExit(f"mshard run: --local_worker_num={local} exceeds --worker_num={a.worker_num}.")
    if (a.node_rank + 1) * local > a.worker_num:
        raise SystemExit(f"mshard run: node {a.node_rank} with {local} workers needs ranks up to "
                         f"{(a.node_rank + 1) * local - 1}, but --worker_num={a.worker_num}; give each node "
                         f"worker_num / nodes local workers.")
    if not Path(a.script).is_file():
        raise SystemExit(f"mshard run: script {a.script!r} not found.")


def worker_env(a: argparse.Namespace, local_rank: int, base: dict | None = None) -> dict:
    """The environment of local worker ``local_rank``."""
    env = dict(os.environ if base is None else base)
    rank = a.node_rank * a.local_worker_num + local_rank
    env.update({
        "MSHARD_COORDINATOR": f"{a.master_addr}:{a.master_port}", "MSHARD_NUM_PROCESSES": str(a.worker_num),
        "MSHARD_PROCESS_ID": str(rank), "MSHARD_LOCAL_RANK": str(local_rank),
        "MSHARD_LOCAL_WORKER_NUM": str(a.local_worker_num), "MSHARD_CLUSTER_TIME_OUT": str(a.cluster_time_out),
        "RANK_ID": str(rank), "RANK_SIZE": str(a.worker_num), "LOCAL_RANK": str(local_rank),
        "MS_WORKER_NUM": str(a.worker_num), "MS_SCHED_HOST": a.master_addr, "MS_SCHED_PORT": str(a.master_port),
        "MS_NODE_RANK": str(a.node_rank), "PYTHONUNBUFFERED": "1"})
    return env


class _Tail(threading.Thread):
    """Echoes a growing log file to the console, each line prefixed with its rank."""

    def __init__(self, path: Path, prefix: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.path, self.prefix, self.stop = path, prefix, stop

    def run(self) -> None:
        while not self.path.exists() and not self.stop.is_set():
            time.sleep(0.05)
        with open(self.path, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    sys.stdout.write(self.prefix + line)
                    sys.stdout.flush()
                elif self.stop.is_set():
                    return
                else:
                    time.sleep(0.05)


def _last_lines(path: Path, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return "(no log)\n"


_FAILED_AT = re.compile(r"mshard: rank \d+ failed at ([0-9.]+):")


def _first_failure(bad: list[tuple[int, int]], logs: list[Path]) -> tuple[int, int]:
    """Of the workers found failed at once, the one that failed first: one killed from outside (a signal other
    than the runtime's abort) caused the others' errors; else the earliest failure time its log records
    (``ms.communication``'s hook writes it); else the lowest rank."""
    external = [(i, c) for i, c in bad if c < 0 and c != -signal.SIGABRT]
    if external:
        return external[0]

    def when(i: int) -> float:
        m = _FAILED_AT.findall(_last_lines(logs[i], 200))
        return float(m[0]) if m else float("inf")
    return min(bad, key=lambda ic: (when(ic[0]), ic[0]))


def _unhealthy(path: Path) -> str:
    """The peers a runtime abort names: JAX's coordination service lists the tasks that stopped sending
    heartbeats (a hung or stopped rank) one per line after the message."""
    m = re.findall(r"unhealthy \(stopped sending heartbeats\):\s*\n((?:\s*\d+\s*\n)+)", _last_lines(path, 200))
    ranks = sorted({int(r) for r in m[-1].split()}) if m else []
    return f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped sending heartbeats" if ranks \
        else ""


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}" + (" (aborted: the JAX runtime stopped it, e.g. a lost peer)" if rc == 134 else "")


def run(a: argparse.Namespace) -> int:
    """Start the local workers, echo the chosen log, stop everything when one fails; the exit code."""
    _check(a)
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, a.script, *a.args]
    if a.dry_run:
        env = dict(os.environ, MSHARD_DRY_RUN="1", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        n = a.worker_num * a.sim_devices_per_worker
        flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
        print(f"mshard run: dry run of {a.script} for {n} devices ({a.worker_num} workers x "
              f"{a.sim_devices_per_worker}); nothing is executed", flush=True)
        return subprocess.call(cmd, env=env)
    stop = threading.Event()
    procs, logs, files = [], [], []
    first = a.node_rank * a.local_worker_num
    try:
        for lr in range(a.local_worker_num):
            rank = first + lr
            path = log_dir / f"worker_{rank}.log"
            f = open(path, "w")                      # noqa: SIM115 - held open while the worker writes
            files.append(f)
            logs.append(path)
            procs.append(subprocess.Popen(cmd, env=worker_env(a, lr), stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=_die_with_parent))
        tails = [_Tail(p, f"[worker {first + i}] ", stop) for i, p in enumerate(logs)
                 if a.tail_worker_log in (-1, first + i)]
        for t in tails:
            t.start()
        print(f"mshard run: {a.local_worker_num} workers (ranks {first}..{first + a.local_worker_num - 1} of "
              f"{a.worker_num}), pids {[p.pid for p in procs]}, logs in {log_dir}/", flush=True)
        failed = None
        while failed is None:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = _first_failure(bad, logs)
            elif all(c == 0 for c in codes):
                break
            else:
                time.sleep(0.05)
        ended = [p.poll() for p in procs]              # before the kill: which of the others had ended by then
        if failed is not None:
            _kill(procs)
        stop.set()
        for t in tails:
            t.join(timeout=2)
        if failed is None:
            print(f"mshard run: all {a.local_worker_num} workers finished", flush=True)
            return 0
        i, rc = failed
        hint = _unhealthy(logs[i]) if rc in (134, -signal.SIGABRT) else ""
        others = "".join(f"mshard run: worker {first + j} (pid {p.pid}) "
                         + ("was still running: killed by mshard run (SIGKILL)" if ended[j] is None
                            else f"had ended by itself ({_how(ended[j])})") + "\n"
                         for j, p in enumerate(procs) if j != i)
        sys.stderr.write(f"mshard run: worker {first + i} failed ({_how(rc)}{hint}); stopped the other workers.\n"
                         f"{others}Last lines of {logs[i]}:\n{_last_lines(logs[i])}")
        sys.stderr.flush()
        return rc if 0 < rc < 256 else 1
    except KeyboardInterrupt:
        _kill(procs)
        return 130
    finally:
        _kill(procs)
        for f in files:
            f.close()


def _die_with_parent() -> None:
    """In a worker before it runs (Linux): the kernel SIGKILLs it when the launcher dies. A launcher killed by
    SIGKILL (a test's or a scheduler's timeout) cannot stop its workers itself, and they run in sessions of their own,
    so without this a worker in a long loop would outlive the job."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # 1: PR_SET_PDEATHSIG


def _kill(procs: list) -> None:
    """SIGKILL every still-running worker's process group (a worker stuck in a collective or in JAX's shutdown
    does not answer SIGTERM in time)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def main(argv: list[str] | None = None) -> int:
    """The ``mshard`` console entry point: ``mshard run ...``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mshard run [options] script.py [args...]   (mshard run --help for the options)")
        return 0 if argv else 2
    if argv[0] != "run":
        print(f"mshard: unknown command {argv[0]!r}; the command is `mshard run`.", file=sys.stderr)
        return 2
    return run(parser().parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
