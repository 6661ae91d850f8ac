"""Simulate 8 CPU devices before JAX is imported (docs/design.md §6) and reset mshard's global state per test."""

import os

# --xla_backend_optimization_level=1: LLVM compiles the CPU kernels with fewer optimisation passes than the default
# (measured on 2 idle cores: test_plan_program + test_train's fast tests take 40 s, 44 s as users compile, 36 s at
# level 0), and compile time is most of the suite's time. The HLO program, its collectives and its buffer assignment
# (the memory tests' figures) are XLA's, unchanged by the flag. Level 0 is NOT used: the fuzzer found that it
# computes the jitted gradient of a max wrongly (values ~3e38 or inf, plain JAX on one device;
# tests/e2e/fuzz/test_fuzz.py::test_the_suites_xla_flags_compute_a_max_gradient keeps the suite's level honest).
# bench/ measures speed and does not set it; MSHARD_TEST_XLA_OPT=1 compiles as users do.
# The test's subprocesses (examples, multi-process workers) add MSHARD_TEST_XLA_EXTRA to their own XLA_FLAGS.
os.environ["MSHARD_TEST_XLA_EXTRA"] = ("" if os.environ.get("MSHARD_TEST_XLA_OPT") == "1"
                                       else " --xla_backend_optimization_level=1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           + os.environ["MSHARD_TEST_XLA_EXTRA"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit
import shutil
import sys
import tempfile

# the examples' shared modules (reference, gpt, models, ...) import by name in every test folder
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import pytest

# One JAX compilation cache for the session, in a fresh directory removed at exit: many tests compile the same
# program (the one-device reference training of one model, the same region under another test's name), and a
# cache hit skips XLA's compile. Set through jax.config, not the environment, so the multi-process tests' workers
# do not share it. Programs and results are unchanged: a hit is the executable of identical HLO.
_CACHE = tempfile.mkdtemp(prefix="mshard-tests-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


def _jax_compilation_cache():
    import jax
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_jax_compilation_cache()


@pytest.fixture
def port():
    """A port for a multi-process job's coordinator, chosen by the OS and held for the test
    (tests/helpers.py::reserved_port)."""
    from helpers import reserved_port
    with reserved_port() as p:
        yield p


@pytest.fixture(autouse=True)
def _fresh_mshard_context():
    try:
        import mshard as ms
    except Exception:  # the package is being built; searchers tests do not need it
        yield
        return
    ms.reset_auto_parallel_context()
    ms.reset_algo_parameters()
    ms.reset_cost_model_context()
    ms.set_seed(0)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    yield
    ms.reset_auto_parallel_context()
    ms.reset_algo_parameters()
    ms.reset_cost_model_context()


# Tiers are markers on the tests themselves (a renamed test keeps its tier): ``@pytest.mark.slow`` (or a module's
# ``pytestmark``) for multi-process runs, notebooks, examples and benchmarks run as scripts, and tests that compile
# whole training steps for longer than a few seconds on a 2-core CPU; ``@pytest.mark.heavy(seconds)`` for a case
# beyond CI's budget, covered there by a cheaper case of the same path. CI runs every tier but heavy; a developer
# runs the fast tier with `bash scripts/test.sh -m "not slow"`. pyproject's --strict-markers refuses a misspelt mark.


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier (multi-process, notebooks, examples, whole training "
                                       "steps); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "heavy(seconds): a case whose search alone takes tens of seconds on 2 cores, "
                                       "beyond CI's 15-minute budget; skipped (and listed as skipped) unless "
                                       "MSHARD_HEAVY=1")


def pytest_collection_modifyitems(config, items):
    heavy = os.environ.get("MSHARD_HEAVY") == "1"
    for item in items:
        mark = item.get_closest_marker("heavy")
        if mark is not None and not heavy:
            item.add_marker(pytest.mark.skip(reason=f"heavy (~{mark.args[0]} s on 2 cores): run with MSHARD_HEAVY=1"))
    _keep_shard(config, items)


def _keep_shard(config, items) -> None:
    """``MSHARD_TEST_SHARD=k/n`` (set by scripts/test.sh, which runs n pytest processes at once on a bare run): keep
    the test files of shard k. Whole files, so a module's fixtures are built once; files are dealt largest first
    (seconds on 2 cores from tests/durations.json, the median for a file not listed) to the least loaded shard.
    Every process collects the same files, so the shards are disjoint and cover them all."""
    spec = os.environ.get("MSHARD_TEST_SHARD")
    if not spec:
        return
    import json
    import statistics
    k, n = (int(v) for v in spec.split("/"))
    with open(os.path.join(os.path.dirname(__file__), "durations.json")) as fh:
        weights = json.load(fh)
    files = sorted({item.nodeid.split("::")[0] for item in items})
    default = statistics.median(weights.values())
    load, owner = [0.0] * n, {}
    for f in sorted(files, key=lambda f: (-weights.get(f, default), f)):
        s = min(range(n), key=lambda i: (load[i], i))
        owner[f] = s
        load[s] += weights.get(f, default)
    keep = [item for item in items if owner[item.nodeid.split("::")[0]] == k]
    config.hook.pytest_deselected(items=[item for item in items if owner[item.nodeid.split("::")[0]] != k])
    items[:] = keep


# MSHARD_TEST_DURATIONS_OUT=<file>: write each test file's seconds (setup + call + teardown of its tests) as JSON
# when the session ends (``<file>.<k>`` per shard of scripts/test.sh), to refresh tests/durations.json from a run
# on 2 cores
_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if os.environ.get("MSHARD_TEST_DURATIONS_OUT"):
        f = report.nodeid.split("::")[0]
        _file_seconds[f] = _file_seconds.get(f, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("MSHARD_TEST_DURATIONS_OUT")
    if out and _file_seconds:
        import json
        shard = os.environ.get("MSHARD_TEST_SHARD")
        if shard:                                  # one file per shard: <out>.<k>
            out = f"{out}.{shard.split('/')[0]}"
        with open(out, "w") as fh:
            json.dump({k: round(v, 1) for k, v in sorted(_file_seconds.items())}, fh, indent=1)
