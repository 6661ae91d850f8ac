"""`mshard run` on 127.0.0.1: time to the first training step and time to end the job after each fault.

    python bench/launch.py [--out bench/out/launch.json] [--dry-run-sizes 64,1024,2048]
    python bench/launch.py --smoke     # a dry run on 8 (no launch, no fault: test_launch.py runs those): that it runs

Every job is 2 processes x 4 simulated CPU devices training tests/mp/worker_launch.py, fed per rank through
ms.dataset.shard_batch, in data_parallel and in semi_auto Megatron (mp 4 inside a process, dp across the two).
Figures, in seconds:

- ``first_step_s``: from starting ``mshard run`` to worker 0 logging its first step (imports, ``init``, planning,
  compiling, one step);
- per fault, ``end_s``: from the fault to ``mshard run`` returning (every worker gone), with its exit code and the
  line naming the failing rank. Faults: ``kill -9`` of worker 1 and of worker 0 (the coordinator), ``SIGSTOP`` of
  worker 1 (a hung peer: the heartbeat, 10 s by ``ms.communication.init``'s default, ends the survivor), a
  ``ValueError`` raised on rank 1 only (timed from its last logged step), and rank 1 feeding a smaller local batch
  (timed from the start: ``shard_batch`` raises on both ranks);
- ``dry_run``: ``mshard run --dry_run`` of tests/mp/worker_dry.py (a Megatron GPT step) for each size: seconds to
  plan and compile, and whether it compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mp" / "worker_launch.py"
DRY = ROOT / "tests" / "mp" / "worker_dry.py"


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _start(log_dir: str, fault: str, mode: str = "data_parallel") -> subprocess.Popen:
    env = dict(os.environ, FAULT=fault, MODE=mode, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "mshard", "run", "--worker_num=2", "--local_worker_num=2",
                             f"--master_port={_port()}", f"--log_dir={log_dir}", "--tail_worker_log=0", str(WORKER)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _wait(path: Path, text: str, p: subprocess.Popen, timeout: float = 180) -> str:
    end = time.time() + timeout
    while time.time() < end:
        body = path.read_text() if path.exists() else ""
        if text in body:
            return body
        if p.poll() is not None:
            raise SystemExit(f"bench/launch.py: the job ended before {text!r} in {path}:\n{p.stderr.read()[-2000:]}")
        time.sleep(0.01)
    p.kill()
    raise SystemExit(f"bench/launch.py: {text!r} did not appear in {path}")


def first_step() -> float:
    with tempfile.TemporaryDirectory() as d:
        t = time.time()
        p = _start(d, "loop")
        _wait(Path(d) / "worker_0.log", "step 0 ", p)
        dt = time.time() - t
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:   # what is measured is the first step; a slow shutdown (a loaded machine) is
            pass                            # not a result: the job is killed below
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        return dt


def fault(kind: str, rank: int, mode: str = "data_parallel") -> dict:
    with tempfile.TemporaryDirectory() as d:
        t_start = time.time()
        p = _start(d, {"raise": "raise", "batch": "batch"}.get(kind, "loop"), mode)
        if kind == "batch":
            t0 = t_start
        else:
            body = _wait(Path(d) / f"worker_{rank}.log", "step 2 ", p)
            pid = int(body.split(" pid ", 1)[1].split()[0])
            t0 = time.time()
            if kind in ("kill", "stop"):
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        try:
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
            if kind == "stop":
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        line = next((ln for ln in err.splitlines() if "failed" in ln), "")
        return {"end_s": time.time() - t0, "exit_code": p.returncode, "report": line.split(". Last lines")[0]}


def dry_run(n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    t = time.time()
    out = subprocess.run([sys.executable, "-m", "mshard", "run", "--dry_run", f"--worker_num={n}", str(DRY)],
                         capture_output=True, text=True, env=env, timeout=900)
    mem = next((ln for ln in out.stdout.splitlines() if ln.startswith("per-device memory")), "")
    return {"seconds": time.time() - t, "compiled": out.returncode == 0, "memory": mem,
            "error": "" if out.returncode == 0 else out.stderr.strip().splitlines()[-1][:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "launch.json"))
    ap.add_argument("--dry-run-sizes", default="64,1024,2048,4096")
    ap.add_argument("--smoke", action="store_true",
                    help="a dry run on 8; no launch, no fault (test_launch.py runs those): checks that it runs")
    a = ap.parse_args()
    faults = [(mode, kind, rank) for mode in ("data_parallel", "megatron")
              for kind, rank in (("kill", 1), ("kill", 0), ("stop", 1), ("raise", 1), ("batch", 1))]
    if a.smoke:     # the launches and faults are tests/unit/edges/test_launch.py's; here a dry run on 8
        faults, a.dry_run_sizes = [], "8"
    res = {"first_step_s": None if a.smoke else first_step(), "faults": {}}
    for mode, kind, rank in faults:
        res["faults"][f"{mode}_{kind}_rank{rank}"] = fault(kind, rank, mode)
    res["dry_run"] = {str(n): dry_run(int(n)) for n in a.dry_run_sizes.split(",") if n}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
