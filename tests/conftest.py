"""Simulate 8 CPU devices before JAX is imported (DESIGN §6) and reset mshard's global state per test."""

import os

# --xla_backend_optimization_level=0: LLVM compiles the CPU kernels without its optimisation passes (about 20% less
# compile time per test, which is most of the suite's time). The HLO program, its collectives and its buffer
# assignment (the memory tests' figures) are XLA's, unchanged, and LLVM does not reorder float arithmetic at any
# level (no fast-math), so results are the same; only the kernels run slower, on the tests' tiny inputs. bench/
# measures speed and does not set it. MSHARD_TEST_XLA_OPT=1 compiles as users do.
# The test's subprocesses (examples, multi-process workers) add MSHARD_TEST_XLA_EXTRA to their own XLA_FLAGS.
os.environ["MSHARD_TEST_XLA_EXTRA"] = ("" if os.environ.get("MSHARD_TEST_XLA_OPT") == "1"
                                       else " --xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           + os.environ["MSHARD_TEST_XLA_EXTRA"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit
import shutil
import tempfile

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
    yield
    ms.reset_auto_parallel_context()
    ms.reset_algo_parameters()
    ms.reset_cost_model_context()


# The slow tier: multi-process runs, notebooks, examples and benchmarks run as scripts, and the tests that compile whole training
# steps for longer than a few seconds on a 2-core CPU. CI runs everything; a developer runs the fast tier with
# `bash scripts/test.sh -m "not slow"` (under 3 minutes). Module paths mark every test in them; node ids one test.
SLOW = (
    "tests/test_multiprocess.py",
    "tests/test_pipeline_multiprocess.py",
    "tests/test_train_multiprocess.py",
    "tests/test_checkpoint_multiprocess.py",
    "tests/test_launch.py::test_two_processes",
    "tests/test_launch.py::test_a_fault",
    "tests/test_launch.py::test_mismatched",
    "tests/test_launch.py::test_dry_run",
    "tests/test_examples.py",
    "tests/test_train_examples.py",
    "tests/test_bench_smoke.py",
    "tests/test_train_memory.py",
    "tests/test_reshard_model.py::test_every_pair_sample_on_the_planner_mesh_rank2",
    "tests/test_plan_program.py::test_predicted_communication_is_the_compiled_programs_and_replays[transformer-",
    "tests/test_reshard_model.py::test_every_pair_sample_on_the_planner_mesh_rank3",
    "tests/test_searchers_e2e.py::test_plan_executes_and_matches_one_device[transformer-",
    "tests/test_train.py::test_megatron_gpt_semi_auto_matches_one_device",
    "tests/test_train.py::test_searched_megatron_step_communicates_no_more_than_its_strategies_alone",
    "tests/test_train.py::test_recompute_transformer_matches_one_device",
    "tests/test_train_fusion.py::test_fusion_buckets_in_a_searched",
    "tests/test_propagation_e2e.py::test_propagated_plans_match_one_device_forward_and_grad",
    "tests/test_user_axes.py::test_any_prefix_before_a_megatron_pair",
    "tests/searchers/test_dynamic_programming.py::test_training_graph_through_the_fallback_beats_propagation",
    "tests/test_fuzz.py::test_random_programs_equal_one_device",
    "tests/test_pipeline.py::test_gpt_trains",
    "tests/test_pipeline.py::test_interleaved",
    "tests/test_pipeline.py::test_megatron_inside",
    "tests/test_pipeline.py::test_the_plan_shows",
    "tests/test_pipeline.py::test_composes_with",
    "tests/test_pipeline.py::test_stage_helper",
    "tests/test_pipeline.py::test_a_parameter_two_stages",
    "tests/test_pipeline.py::test_pipeline_form",
    "tests/test_pipeline.py::test_stages_keep",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier (multi-process, notebooks, examples, whole training "
                                       "steps); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "heavy(seconds): a case whose search alone takes tens of seconds on 2 cores, "
                                       "beyond CI's 15-minute budget; skipped (and listed as skipped) unless "
                                       "MSHARD_HEAVY=1")


# heavy by node id (seconds on 2 cores): a case too slow for CI's budget, covered there by a cheaper case of the same
# path. The MiniGPT's ~390-op training step under ilp: HiGHS runs to its 60 s time limit, then dynamic_programming
# (the MiniGPT's dynamic_programming case, and the CNN's ilp case, run in CI). The GPT on 4 stages under 1f1b with 8
# micro-batches: CI runs 1f1b on 2 stages and 4 stages under gpipe; the schedule's tables for every S, M are
# tests/test_pipeline_schedule.py's, which compiles nothing.
HEAVY: dict[str, int] = {
    "tests/test_plain_models_train.py::test_a_plain_flax_model_trains_as_on_one_device[minigpt-ilp]": 80,
    "tests/test_pipeline.py::test_gpt_trains_as_on_one_device[4-4-8-1f1b]": 30,
    # the three slowest benchmark smoke runs (bench/step.py's two modes, fused step and memory routes; bench/launch.py's
    # 2-process jobs; bench/pipeline.py's schedules): with them the suite ran 25.7 min on 2 cores, over CI's budget.
    # The other 15 bench scripts' smoke runs stay in CI
    "tests/test_bench_smoke.py::test_bench_smoke_writes_its_json[step]": 140,
    "tests/test_bench_smoke.py::test_bench_smoke_writes_its_json[launch]": 25,
    "tests/test_bench_smoke.py::test_bench_smoke_writes_its_json[pipeline]": 22,
}


def pytest_collection_modifyitems(config, items):
    heavy = os.environ.get("MSHARD_HEAVY") == "1"
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if item.nodeid in HEAVY:
            item.add_marker(pytest.mark.heavy(HEAVY[item.nodeid]))
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
