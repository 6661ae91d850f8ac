"""Shared test helpers: single-device references and shard-shape checks."""

import contextlib
import itertools
import os
import pathlib
import re
import signal
import socket
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import pytest

# float32 forward checks (test_strategies, test_shard_in_plain_jit, the examples' MLP): dot products of 32 to 256
# terms reordered by the partitioning, over 1-2 layers; roundings are random-signed, ~sqrt(n) * 2**-24 <= 1e-6
# relative each (worst case n * 2**-24: 4e-6 at n = 64, 1.5e-5 at n = 256); ATOL for outputs that cancel near 0
RTOL = 1e-5
ATOL = 1e-5

TESTS = pathlib.Path(__file__).resolve().parent      # the suite's root folder
ROOT = TESTS.parent                                   # the repository
MP = TESTS / "mp"                                     # multi-process workers


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess: ``devices`` simulated CPU devices, compiled as the tests compile
    (``MSHARD_TEST_XLA_EXTRA``, set by conftest)."""
    return f"--xla_force_host_platform_device_count={devices}{os.environ.get('MSHARD_TEST_XLA_EXTRA', '')}"


def on_one_device(fn, *args):
    """The same computation on one device (plain JAX: stand_alone, where mshard ignores strategies even inside a
    jax.jit)."""
    import mshard as ms
    dev = jax.devices()[0]
    with ms.parallel_context(parallel_mode="stand_alone"):
        return jax.jit(fn)(*[jax.device_put(a, dev) if hasattr(a, "shape") else a for a in args])


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def split_counts(arr) -> tuple[int, ...]:
    """How many slices each dim of a global array is cut into (from its sharding, not from mshard)."""
    shard = arr.sharding.shard_shape(arr.shape)
    return tuple(n // s for n, s in zip(arr.shape, shard, strict=True))


def rand(key, *shape):
    return jax.random.normal(jax.random.key(key), shape, dtype=np.float32)


@contextlib.contextmanager
def reserved_port():
    """A TCP port on 127.0.0.1 chosen by the OS at bind time and held, bound, until the block ends: yields it as a
    string. The socket sets SO_REUSEPORT, as gRPC's servers do (JAX's coordination service among them), so the job's
    coordinator can bind the same port while no other process can be handed it in between (binding, closing and
    reusing a port later is a race with every other process on the machine)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield str(s.getsockname()[1])


def run_workers(worker, n: int = 2, timeout: float = 300) -> None:
    """Start ``n`` processes of ``worker`` (argv: rank, port) on 127.0.0.1, wait, kill leftovers, and assert
    each exited 0 and printed ``process <rank> OK``."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with reserved_port() as port:
        procs = [subprocess.Popen([sys.executable, str(worker), str(i), port], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env) for i in range(n)]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            pytest.fail(f"{worker}: multi-process run timed out after {timeout} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out[-4000:]
        assert f"process {i} OK" in out


def all_layouts(rank: int, naxes: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every layout of a rank-``rank`` tensor on a mesh of ``naxes`` axes: each axis on one tensor dim or none, every
    order inside a dim (per dim, the mesh axis indices that split it, major first)."""
    out = set()
    for place in itertools.product(range(-1, rank), repeat=naxes):
        dims = [[a for a in range(naxes) if place[a] == d] for d in range(rank)]
        for perms in itertools.product(*[list(itertools.permutations(x)) for x in dims]):
            out.add(tuple(tuple(p) for p in perms))
    return sorted(out)


_RING = {"all-reduce": lambda s, k: 2 * s * (k - 1) / k, "all-gather": lambda s, k: s * (k - 1) / k,
         "reduce-scatter": lambda s, k: s * (k - 1), "all-to-all": lambda s, k: s * (k - 1) / k,
         "collective-permute": lambda s, k: s}
_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}


class Collective(NamedTuple):
    computation: str          # the HLO computation it sits in
    kind: str                 # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    result: str               # its result type, layouts dropped: ``f32[256,32]``, or a tuple ``(f32[], f32[8])``
    line: str


def loop_bodies(hlo: str) -> set[str]:
    """The names of the computations that are some while loop's body."""
    return set(re.findall(r"\bbody=%([\w.\-]+)", hlo))


def hlo_collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled HLO module's text, read without mshard's code."""
    out, comp = [], ""
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            comp = head.group(1)
        m = re.search(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                      line)
        if m:
            out.append(Collective(comp, m.group(2), re.sub(r"\{[^}]*\}", "", m.group(1)), line))
    return out


def loop_moved(hlo: str, trips: int) -> dict[str, float]:
    """Bytes moved per device by each collective kind of a compiled module, read from its text without mshard's
    code: each collective's result shapes (a tuple-shaped one counts every element), its replica group's size k, the
    ring formulas (all-reduce 2 S (k-1)/k, all-gather S (k-1)/k of its result, reduce-scatter S (k-1) of its result,
    all-to-all S (k-1)/k, a permute S), a collective in a while loop's body counted ``trips`` times."""
    bodies = loop_bodies(hlo)
    return _moved(hlo, lambda comp: trips if comp in bodies else 1)


def _moved(hlo: str, times: Callable[[str], float]) -> dict[str, float]:
    """Bytes per device by collective kind, each collective counted ``times(its computation)`` times."""
    out: dict[str, float] = {}
    for c in hlo_collectives(hlo):
        size = sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                   for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", c.result))
        out[c.kind] = out.get(c.kind, 0.0) + _RING[c.kind](size, _group(c.line)) * times(c.computation)
    return out


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """-> (each computation's name -> its instruction lines, the entry computation's name)."""
    comps: dict[str, list[str]] = {}
    name = entry = ""
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            name = head.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name:
            comps[name].append(line)
    return comps, entry


def _callees(line: str) -> tuple[list[str], list[str]]:
    """-> (the computations an instruction calls by name: a loop's body and condition, a fusion, a reduction, a
    conditional's true/false computations; a conditional's branch computations, in order)."""
    refs = re.findall(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)", line)
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    return refs, re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []


def trip_moved(hlo: str, branch: Callable[[int, int], float] | None = None) -> dict[str, float]:
    """:func:`loop_moved` with each while loop counted by its own trip count (``known_trip_count`` in its
    backend_config), nested loops multiplied: a collective in a computation is counted the product of the trip
    counts of the loops around it (a computation a loop body calls, a fusion, as often as the body). A loop whose
    trip count the module does not say counts once. A conditional's branch ``i`` of ``n`` runs ``branch(n, i)``
    times as often as the conditional (default 1: every branch, an upper bound; a caller that knows which branch
    one device takes how often, a pipeline's schedule, says so)."""
    comps, entry = _computations(hlo)
    times = {entry: 1}
    order = [entry]
    while order:
        c = order.pop()
        for line in comps.get(c, ()):
            trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            body = re.search(r"\bbody=%([\w.\-]+)", line)
            refs, arms = _callees(line)
            for ref in refs + arms:
                n = int(trip.group(1)) if trip and body and ref == body.group(1) else 1
                if ref in arms and branch is not None:
                    n = branch(len(arms), arms.index(ref))
                if ref in comps and times.get(ref, -1) < times[c] * n:
                    times[ref] = times[c] * n
                    order.append(ref)
    return _moved(hlo, lambda comp: times.get(comp, 1))


def _group(line: str) -> int:
    """The replica group size of a collective: ``{{0,1},{2,3}}``, iota ``[4,2]<=[8]``, or mesh axes
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (the named axes' sizes multiplied)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2))]))
    groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if groups:
        return len(groups.group(1).split(","))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", line)
    return int(iota.group(1)) if iota else 2          # a permute: k unused


def busiest_stage_moved(hlo: str, S: int, M: int, chunks: int, ticks: int, gpipe: bool) -> dict[str, float]:
    """Bytes per device of the compiled pipelined step, read from its HLO (:func:`trip_moved`) for the
    device of each stage, the most of them: a stage's ticks loop runs ``ticks`` times and, per tick, one branch of
    the executor's conditional (idle, forward, backward; gpipe: idle or its stage's forward, then the transposed
    loop the same), and each virtual stage of a device's stage runs M forwards and M backwards per step."""
    V = S * chunks
    per = []
    for s in range(S):
        if gpipe:
            T = M + S - 1
            def branch(n, i, s=s, T=T):
                return ((T - M) / T if i == 0 else M / T if i == s + 1 else 0.0) if n == S + 1 else 1.0
        else:
            def branch(n, i, s=s):
                if n == 3:                                   # idle, forward, backward
                    return [(ticks - 2 * M * chunks) / ticks, M * chunks / ticks, M * chunks / ticks][i]
                return (1 / chunks if i % S == s else 0.0) if n == V else 1.0      # which virtual stage
        per.append({k: v for k, v in trip_moved(hlo, branch).items() if v})
    return max(per, key=lambda d: sum(d.values()))


def loop_computations(hlo: str) -> set[str]:
    """The computations some while loop runs: its body and every computation the body calls (a conditional's
    branches, a fusion, a reduction), transitively."""
    comps, _ = _computations(hlo)
    calls = {c: {ref for line in lines for refs, arms in [_callees(line)] for ref in refs + arms}
             for c, lines in comps.items()}
    out, todo = set(), list(loop_bodies(hlo))
    while todo:
        c = todo.pop()
        if c not in out:
            out.add(c)
            todo += calls.get(c, ())
    return out


def replica_groups(line: str) -> frozenset[frozenset[int]] | None:
    """The device groups of a collective's line: explicit ``{{0,2},{1,3}}`` or iota ``[4,2]<=[8]`` (optionally
    ``[2,4]<=[2,2,2]T(0,2,1)``: ``arange`` reshaped, transposed, cut into rows); None for any other form."""
    explicit = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
    if explicit:
        return frozenset(frozenset(int(d) for d in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", explicit.group(1)))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if not iota:
        return None
    dims = [int(d) for d in iota.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(4):
        ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
    rows = ids.reshape(int(iota.group(1)), int(iota.group(2)))
    return frozenset(frozenset(int(d) for d in r) for r in rows)


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Fail the test (``pytest.fail``) if the block runs longer than ``seconds``: for a step whose regression is a
    search that does not end (the suite has no per-test timeout). SIGALRM interrupts Python code only, which is
    where the searchers run; the main thread only."""
    def expired(signum, frame):
        pytest.fail(f"{what} ran past {seconds:.0f} s", pytrace=False)
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
