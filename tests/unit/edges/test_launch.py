"""`mshard run` and ms.communication (issue 18): a 2-process job trains equal to one device; every fault ends the
whole job (a 60 s hang guard, no wall-clock assert: bench/launch.py times it) with a non-zero exit naming the
failing rank; mismatched local batches raise; environment
detection; the dry run."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from helpers import MP, xla_flags

import mshard as ms

WORKER = MP / "worker_launch.py"


def _launch(tmp_path, port, fault="none", extra=(), script=WORKER, devices=4, mode="data_parallel",
            order="init_first", tx="adam"):
    env = dict(os.environ, FAULT=fault, MODE=mode, JAX_PLATFORMS="cpu", ORDER=order, JOB_DEVICES=str(2 * devices),
               TX=tx, XLA_FLAGS=xla_flags(devices))
    cmd = [sys.executable, "-m", "mshard", "run", "--worker_num=2", "--local_worker_num=2",
           f"--master_port={port}", f"--log_dir={tmp_path}", *extra, str(script)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(path: pathlib.Path, text: str, p: subprocess.Popen, timeout: float = 120) -> str:
    end = time.time() + timeout
    while time.time() < end:
        body = path.read_text() if path.exists() else ""
        if text in body:
            return body
        if p.poll() is not None:
            pytest.fail(f"the job ended before {text!r} appeared in {path}: {p.communicate()}")
        time.sleep(0.05)
    p.kill()
    pytest.fail(f"{text!r} did not appear in {path} within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("fault,mode,order,tx", [("none", "data_parallel", "init_first", "adam"),
                                                 ("none", "megatron", "init_first", "sgd"),
                                                 ("hybrid", "data_parallel", "init_first", "sgd"),
                                                 ("none", "data_parallel", "context_first", "adam")])
def test_two_processes_train_equal_to_one_device(tmp_path, port, fault, mode, order, tx):
    """Each worker compares every parameter and optimizer leaf it holds with one device; plain SGD in two cases, where
    a gradient off by the process count shows. ``order=context_first``: MindSpore's order of set-up,
    set_auto_parallel_context before communication.init() (JAX refuses jax.distributed.initialize once its backend
    is up, so setting the context must not start it)."""
    p = _launch(tmp_path, port, fault=fault, mode=mode, order=order, tx=tx)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    for r in range(2):
        log = (tmp_path / f"worker_{r}.log").read_text()
        assert f"process {r} OK" in log and "mshard.communication.init: mshard run: process" in log, log[-2000:]
    assert "[worker 0] " in out and "[worker 1] " in out and "all 2 workers finished" in out


@pytest.mark.slow
def test_workers_end_when_the_launcher_is_killed(tmp_path, port):
    """A launcher killed by SIGKILL (a timeout's kill) cannot stop its workers, which run in sessions of their own:
    each worker asks the kernel to kill it when the launcher dies. Before, the workers of a job in a loop outlived it
    (bench/launch.py's smoke left two after every CI run)."""
    p = _launch(tmp_path, port, fault="loop")
    pids = []
    try:
        for r in range(2):
            body = _wait_for(tmp_path / f"worker_{r}.log", "step 2 ", p)
            pids.append(int(body.split(" pid ", 1)[1].split()[0]))
        p.kill()
        p.communicate(timeout=30)   # reaps the launcher and closes its pipes
        end = time.time() + 30      # the kernel's SIGKILL is at once; 30 s covers a loaded machine's reaping
        alive = list(pids)
        while alive and time.time() < end:
            alive = [pid for pid in alive if _running(pid)]
            time.sleep(0.1)
        assert not alive, f"workers {alive} outlived their killed launcher"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("fault,rank,sig", [("kill", 1, signal.SIGKILL), ("kill", 0, signal.SIGKILL),
                                            ("stop", 1, signal.SIGSTOP), ("raise", 1, None)])
def test_a_fault_ends_the_whole_job_naming_the_failing_rank(tmp_path, port, fault, rank, sig):
    p = _launch(tmp_path, port, fault="raise" if fault == "raise" else "loop")
    log = tmp_path / f"worker_{rank}.log"
    body = _wait_for(log, "step 2 ", p)
    pid = int(body.split(" pid ", 1)[1].split()[0])
    t0 = time.time()
    if sig is not None:
        os.kill(pid, sig)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        if sig == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elapsed = time.time() - t0          # reported, not asserted: the 15 s figures are bench/launch.py's
    assert p.returncode != 0
    assert "mshard run: worker" in err and "failed" in err, err[-2000:]
    # fail-fast by behaviour: when the launcher returns, no worker of the job is left, and it says how each of the
    # others ended: killed by it while still running, or ended on its own before that (a peer's runtime abort)
    pids = [int(v) for v in out.split("pids [", 1)[1].split("]", 1)[0].split(",")]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    failing = int(err.split("mshard run: worker ", 1)[1].split()[0])
    for r in {0, 1} - {failing}:
        fate = err.split(f"mshard run: worker {r} (pid {pids[r]}) ", 1)[1].splitlines()[0]
        assert fate in ("was still running: killed by mshard run (SIGKILL)",
                        "had ended by itself (exit code 134 (aborted: the JAX runtime stopped it, e.g. a lost peer))",
                        "had ended by itself (killed by SIGABRT)", "had ended by itself (exit code 1)"), fate
    if fault == "stop":     # the stopped rank cannot end by itself: only the launcher's SIGKILL ends it
        assert f"mshard run: worker 1 (pid {pids[1]}) was still running: killed by mshard run (SIGKILL)" in err, err
    if fault in ("kill", "raise"):
        assert f"worker {rank} failed" in err, err[-2000:]
    if fault == "raise":
        assert "a bad value on rank 1 only" in err            # the last lines of its log
    if fault == "stop":                                       # the survivor's runtime abort names the hung rank
        assert "rank 1 stopped sending heartbeats" in err, err[-2000:]
    print(f"{fault} rank {rank}: ended in {elapsed:.2f} s; {err.strip().splitlines()[0]}")


@pytest.mark.slow
@pytest.mark.parametrize("fault,want", [("batch", "rank 0: (8, 16), (8, 8); rank 1: (4, 16), (4, 8)"),
                                        ("hostbatch", "rank 0: (16, 16), (16, 8); rank 1: (8, 16), (8, 8)"),
                                        # same shapes, each rank's own rows: a global batch made of both would be
                                        # silently wrong (issue 36); the error names shard_batch
                                        ("ownrows", "host input 0 (shape (8, 16)) differs between the processes")])
def test_mismatched_local_batches_raise_on_every_rank(tmp_path, port, fault, want):
    p = _launch(tmp_path, port, fault=fault)
    p.communicate(timeout=240)
    assert p.returncode != 0
    logs = [(tmp_path / f"worker_{r}.log").read_text() for r in range(2)]
    hit = [log for log in logs if "DatasetStrategyError" in log]
    assert hit, logs
    assert want in hit[0], hit[0][-2000:]


@pytest.mark.slow
def test_dry_run_plans_a_step_for_64_devices_and_runs_nothing(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "mshard", "run", "--dry_run", "--worker_num=64",
                          str(MP / "worker_dry.py")], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "region 'TrainOneStepCell' on 64 devices (compiled, not run)" in out.stdout, out.stdout[-3000:]
    assert "per-device memory: argument" in out.stdout and "loss" not in out.stdout.split("compiled, not run")[1]
    assert "ran the steps" not in out.stdout


@pytest.mark.parametrize("env,want", [
    ({}, ("single process", None)),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
      "SLURM_STEP_NODELIST": "gpu[03-04]"},
     ("SLURM", {"coordinator_address": "gpu03:8118", "num_processes": 4, "process_id": 3, "local_rank": 1})),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.1.2.3:4567"},
     ("Open MPI", {"coordinator_address": "10.1.2.3:8118", "num_processes": 2, "process_id": 1, "local_rank": 1})),
    ({"MSHARD_COORDINATOR": "h:1", "MSHARD_NUM_PROCESSES": "2", "MSHARD_PROCESS_ID": "0", "SLURM_JOB_ID": "1",
      "SLURM_NTASKS": "9"},
     ("mshard run", {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0, "local_rank": 0})),
])
def test_environment_detection(env, want):
    assert ms.communication.detect(env) == want


def test_launcher_argument_errors(tmp_path):
    from mshard._src.edges import launch
    script = tmp_path / "s.py"
    script.write_text("")
    for argv, msg in ((["--worker_num=2", "--local_worker_num=3", str(script)], "exceeds --worker_num=2"),
                      (["--worker_num=4", "--local_worker_num=2", "--node_rank=2", str(script)], "node 2"),
                      (["--worker_num=2", str(tmp_path / "missing.py")], "not found")):
        with pytest.raises(SystemExit, match=msg):
            launch.run(launch.parser().parse_args(argv))
    with pytest.raises(ms.errors.ContextError, match="MSHARD_NUM_PROCESSES"):
        ms.communication.detect({"MSHARD_COORDINATOR": "h:1"})
