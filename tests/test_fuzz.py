"""The differential fuzzer (issue 13): random programs over every primitive of ``mshard.ops`` (the collectives
aside), with random strategies, in semi_auto, every auto_parallel search mode and data_parallel, full_batch and
data_parallel datasets, parameters as ``nnx.Param``, some under ``jax.checkpoint``; forward and gradient compared,
every value, with the same chain evaluated in float64 by the independent references of tests/references.py
(tests/fuzz_programs.py). Invalid strategies must raise an ``mshard.errors`` type.

Derandomized (a fixed sequence of seeds, no example database): a failure replays from its seed, and its message
carries a standalone script. ``bench/fuzz.py --cases 10000`` runs the long campaign.
"""

import inspect
import itertools

import pytest
from fuzz_programs import OPS, check_case, describe, make_case, script
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from mshard import ops

SEEDS = st.integers(0, 2**31 - 1)
FAST = settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))
# hybrid_parallel's hand-placed collectives take no strategy (tests/test_hybrid.py checks each against its definition)
COLLECTIVES = {"AllGather", "AllReduce", "AlltoAll", "Broadcast", "ReduceScatter", "SendReceive"}


def test_the_fuzzer_covers_every_primitive():
    """A primitive added to mshard.ops without a generator here would never be fuzzed."""
    prims = {n for n, c in vars(ops).items() if inspect.isclass(c) and issubclass(c, ops.Primitive)
             and c is not ops.Primitive} - COLLECTIVES
    assert prims - set(OPS) == set()


def _check(case, allowed):
    outcome, detail = check_case(case)
    assert outcome in allowed, f"{describe(case)}\n{detail}\n--- replay ---\n{script(case, detail)}"


# CI's share of the campaign (bench/fuzz.py runs thousands, 10,000 seeds in bench/out/fuzz-*.json): 20 programs
# keep the suite inside its 15 minutes
@pytest.mark.slow
@settings(FAST, max_examples=20)
@given(seed=SEEDS)
@example(seed=158)    # two valid strategies whose splits meet in an unannotated mul and cannot be disjoint
def test_random_programs_equal_one_device(seed):
    _check(make_case(seed), {"equal", "meeting"})


@settings(FAST, max_examples=400)
@given(seed=SEEDS)
def test_invalid_strategies_raise_mshard_errors(seed):
    _check(make_case(seed, invalid=True), {"refused"})


@pytest.mark.parametrize("seed", range(4))
def test_cases_are_plain_data_that_replays(seed):
    """A case is rebuilt from its repr alone (what bench/fuzz.py writes as a script)."""
    import ast
    case = make_case(seed)
    assert ast.literal_eval(repr(case)) == case


def _rows_reversed(orig):
    return lambda self, *a: orig(self, *a)[::-1]


def _softmax_axis0(orig):
    return lambda self, x: type(self).fn(x, axis=0)


def _first_case_with(kind: str) -> tuple[dict, str]:
    """The first seed's case that uses ``kind`` and is not a meeting of user splits (so its values are compared),
    with its outcome."""
    for seed in itertools.count():
        case = make_case(seed)
        if any(s["kind"] == kind for s in case["steps"]):
            outcome = check_case(case)[0]
            if outcome != "meeting":
                return case, outcome
    raise AssertionError("unreachable")


@pytest.mark.parametrize("kind, wrong", [("MatMul", _rows_reversed), ("Softmax", _softmax_axis0)],
                         ids=["matmul-rows-reversed", "softmax-wrong-axis"])
def test_a_wrong_primitive_is_a_finding(monkeypatch, kind, wrong):
    """The fuzzer's oracle is independent of mshard's primitives: a primitive made wrong everywhere (on one device
    too; the shapes still agree) is a finding in the first case that uses it, a case that holds without the plant."""
    case, outcome = _first_case_with(kind)
    assert outcome == "equal", describe(case)
    cls = OPS[kind][0]
    monkeypatch.setattr(cls, "compute", wrong(cls.compute))
    outcome, detail = check_case(case)
    assert outcome == "finding" and "differs from the float64 reference" in detail, (describe(case), outcome, detail)
