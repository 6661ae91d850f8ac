"""Every valid strategy of a single op is accepted (issue 36): MatMul (each transpose), BatchMatMul, Conv2D and an
elementwise binary op, on 2, 4 and 8 devices, each split of each loop dim a power of two whose product divides
device_num (MindSpore's validity rule: the op's device matrix divides the devices, shared dims agree). Each case
runs equal to one device (a reference written here in plain JAX, not through mshard.ops) and lands on the splits
it asked for, read from the compiled program: the dot's or convolution's per-device operand and result shapes
in the partitioned HLO, and the output's split counts from its sharding.

A refusal of any of these ("meet in op ... need disjoint mesh axes" included) is a bug.
"""

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import split_counts

import mshard as ms
from mshard import ops


def _r(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _conv_ref(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                        precision=jax.lax.Precision.HIGHEST)


def _hi(s):
    return lambda a, b: jnp.einsum(s, a, b, precision=jax.lax.Precision.HIGHEST)


# name -> (primitive factory, loop letters per input, output letters, loop sizes, reference, HLO op, letters whose
# operand extent in the HLO includes a halo (not checked there), letters that may not be split)
OPS = {
    "MatMul": (lambda: ops.MatMul(), ("mk", "kn"), "mn", dict(m=16, k=32, n=8), _hi("mk,kn->mn"), "dot", "", ""),
    "MatMul_ta": (lambda: ops.MatMul(transpose_a=True), ("km", "kn"), "mn", dict(m=16, k=32, n=8),
                  _hi("km,kn->mn"), "dot", "", ""),
    "MatMul_tb": (lambda: ops.MatMul(transpose_b=True), ("mk", "nk"), "mn", dict(m=16, k=32, n=8),
                  _hi("mk,nk->mn"), "dot", "", ""),
    "MatMul_ta_tb": (lambda: ops.MatMul(transpose_a=True, transpose_b=True), ("km", "nk"), "mn",
                     dict(m=16, k=32, n=8), _hi("km,nk->mn"), "dot", "", ""),
    "BatchMatMul": (lambda: ops.BatchMatMul(), ("bmk", "bkn"), "bmn", dict(b=8, m=16, k=32, n=8),
                    _hi("bmk,bkn->bmn"), "dot", "", ""),
    "BatchMatMul_tb": (lambda: ops.BatchMatMul(transpose_b=True), ("bmk", "bnk"), "bmn",
                       dict(b=8, m=16, k=32, n=8), _hi("bmk,bnk->bmn"), "dot", "", ""),
    # NCHW x OIHW, 3x3 kernel, pad_mode="same", stride 1: h and w may be split (halo exchange); kh, kw may not
    "Conv2D": (lambda: ops.Conv2D(16, 3, pad_mode="same"), ("nchw", "ocij"), "nohw",
               dict(n=8, c=8, h=16, w=16, o=16, i=3, j=3), _conv_ref, "convolution", "hw", "ij"),
    "Add": (lambda: ops.Add(), ("mn", "mn"), "mn", dict(m=16, n=8), lambda a, b: a + b, "add", "", ""),
    "Mul_broadcast": (lambda: ops.Mul(), ("mn", "n"), "mn", dict(m=16, n=8), lambda a, b: a * b, "multiply", "", ""),
}


def strategies(name, devices):
    """Every valid strategy of op ``name`` on ``devices`` devices, as {loop letter: split}."""
    _, ins, _, sizes, *_, fixed = OPS[name]
    letters = [l for l in dict.fromkeys("".join(ins)) if l not in fixed]
    powers = [2 ** e for e in range(int(math.log2(devices)) + 1)]
    for counts in itertools.product(powers, repeat=len(letters)):
        if devices % math.prod(counts) == 0 and all(sizes[l] % c == 0 for l, c in zip(letters, counts, strict=True)):
            yield dict(zip(letters, counts, strict=True))


def _shapes(text):
    """{computation-local instruction name: dims} for each computation of an HLO module's text."""
    comps, cur = [], {}
    for line in text.splitlines():
        if line.rstrip().endswith("{") and ("(" in line) and "=" not in line.split("(")[0]:
            cur = {}
            comps.append(cur)
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]", line)
        if m:
            cur[m.group(1)] = tuple(int(d) for d in m.group(2).split(",") if d)
            cur.setdefault("__lines__", []).append(line)
    return comps


def hlo_op_shapes(text, opname):
    """[(result dims, [operand dims])] of every ``opname`` instruction of the compiled module."""
    out = []
    for comp in _shapes(text):
        for line in comp.get("__lines__", []):
            m = re.match(rf"\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* {opname}\(([^)]*)\)", line)
            if m:
                operands = [comp.get(o.strip().lstrip("%")) for o in m.group(3).split(",")]
                out.append((comp[m.group(1)], operands))
    return out


def _run(name, devices, counts, via):
    factory, ins, out, sizes, ref_fn, hlo, halo, _ = OPS[name]
    strategy = tuple(tuple(counts.get(l, 1) for l in letters) for letters in ins)
    args = [jnp.asarray(_r(i, tuple(sizes[l] for l in letters))) for i, letters in enumerate(ins)]
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=devices, dataset_strategy="full_batch"):
        if via == "primitive":
            op = factory().shard(strategy)
            f = ms.jit(lambda *a: op(*a))
        else:                                          # a shard-wrapped function: in_strategy lays out its inputs
            f = ms.shard(lambda *a: ref_fn(*a), in_strategy=strategy)
        y = f(*args)
        text = (f.lower(*args) if via == "primitive" else ms.jit(f).lower(*args)).compile().as_text()
    ref = jax.jit(ref_fn)(*[jax.device_put(a, jax.devices()[0]) for a in args])
    # float32: each output is one sum of n <= 72 products (k = 32; Conv2D's c*i*j = 72) of N(0, 1) values, reordered
    # by the split into partial sums; the worst case of the reordering is n * 2**-24 * sum|products|, with
    # E|x*w| = 2/pi: 72 * 6e-8 * 72 * 0.64 = 2.0e-4 (random-signed roundings make it ~1e-5 in practice)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=0, atol=2.0e-4)
    want_out = tuple(counts.get(l, 1) for l in out)
    if via == "primitive":
        assert split_counts(y) == want_out, f"output split {split_counts(y)} != {want_out}"
    computed = dict(counts)
    if name == "Conv2D" and (counts.get("h", 1) > 1 or counts.get("w", 1) > 1):
        # XLA's partitioner computes wrong values for a windowed h/w split together with an out-channel split
        # (tests/unit/planning/test_xla_guards.py keeps checking it): the convolution computes with the whole kernel, then the output
        # is sliced to the asked out-channel split (checked above on the output's sharding)
        computed["o"] = 1
    local_out = tuple(sizes[l] // computed.get(l, 1) for l in out)
    local_in = [tuple(sizes[l] // computed.get(l, 1) for l in letters) for letters in ins]
    found = hlo_op_shapes(text, hlo)
    assert found, f"no {hlo} in the compiled program"

    def contains(got, want):
        """``want``'s dims (but size 1, which XLA may squeeze) are among ``got``'s, as a multiset (XLA may
        transpose an operand; a halo letter's operand extent is its block plus the halo, so it is left out)."""
        rest = [g for g in got if g != 1]
        for d in (d for d in want if d != 1):
            if d not in rest:
                return False
            rest.remove(d)
        return True

    def lands(res, operands):
        if len(operands) != len(ins) or not contains(res, local_out) or not contains(local_out, res):
            return False
        for got, want, letters in zip(operands, local_in, ins, strict=True):
            if len(letters) < len(out):        # a broadcast operand reaches the op already broadcast
                continue
            keep = [d for d, l in zip(want, letters, strict=True) if l not in halo]
            if got is None or not contains(got, keep) or (not halo and not contains(keep, got)):
                return False
        return True
    assert any(lands(r, o) for r, o in found), (
        f"{name} {strategy} on {devices}: no {hlo} computes on per-device operands {local_in} -> {local_out}; "
        f"the compiled program has {found}")


CASES = [(name, d) for name in OPS for d in (2, 4, 8)]


@pytest.mark.parametrize("name,devices", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_every_valid_strategy_of_a_primitive_is_accepted_and_lands(name, devices):
    failures = []
    todo = list(strategies(name, devices))
    assert todo, "the enumeration produced no strategy"
    for counts in todo:
        try:
            _run(name, devices, counts, "primitive")
        except Exception as e:  # collect every failing strategy, so one run lists them all
            failures.append(f"{counts}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, f"{len(failures)} of {len(todo)} valid strategies failed:\n" + "\n".join(failures)


SHARD = ["MatMul", "MatMul_tb", "BatchMatMul", "Add"]


@pytest.mark.parametrize("name", SHARD)
def test_every_valid_in_strategy_of_a_shard_wrapped_op_is_accepted_and_lands(name):
    """``ms.shard(lambda x, w: x @ w, in_strategy=((2, 2), (2, 2)))`` on 8 devices was refused with a LayoutError
    ("meet in op 'dot_general' ... no free axes for both") while two mesh axes were free."""
    failures, n = [], 0
    for devices in (2, 4, 8):
        for counts in strategies(name, devices):
            n += 1
            try:
                _run(name, devices, counts, "shard")
            except Exception as e:
                failures.append(f"{devices} devices {counts}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, f"{len(failures)} of {n} valid strategies failed:\n" + "\n".join(failures)
