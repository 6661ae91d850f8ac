"""The one jaxpr utility: the call table, sub-jaxprs and mark iteration that every module walking a jaxpr uses.

``planning.axis_assignment`` (axis assignment), ``jaxpr.op_graph`` (the search graph, via ``jaxpr.rules``) and
:mod:`mshard._src.runtime.emit` (re-emission) all see the same calls: an eqn in :data:`CALLS` has a body whose inputs map
one to one onto the eqn's operands, and is walked inline. The executor keeps the remat calls (:data:`REMAT`) as
calls, rebuilt around their re-emitted body, so the recomputation survives; everything else in :data:`CALLS` it
inlines where the body holds marks or planned ops.

>>> import jax, jax.numpy as jnp
>>> j = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * 2))(1.0).jaxpr
>>> [e.primitive.name for e in j.eqns], call_jaxpr(j.eqns[0]) is not None
(['remat2'], True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jax.extend import core as jcore

from mshard._src.jaxpr.marks import mark_p

# call-like primitive -> the param holding its body
CALLS: dict[str, str] = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr",
}
REMAT = frozenset({"checkpoint", "remat", "remat2"})


def as_jaxpr(j: Any) -> jcore.Jaxpr | None:
    """The open jaxpr of a ClosedJaxpr or Jaxpr (None for anything else)."""
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr
    if isinstance(j, jcore.Jaxpr):
        return j
    return None


def call_body(eqn) -> Any:
    """The body param (ClosedJaxpr or Jaxpr) of a call-like eqn, else None."""
    key = CALLS.get(eqn.primitive.name)
    return eqn.params.get(key) if key else None


def call_jaxpr(eqn) -> jcore.Jaxpr | None:
    """The open body of a call-like eqn whose invars map one to one onto the eqn's inputs."""
    return as_jaxpr(call_body(eqn))


def jaxpr_params(params: dict) -> list:
    """Every jaxpr (closed or open) among an eqn's params, tuples and lists included."""
    out = []
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                out.append(item)
    return out


def sub_jaxprs(eqn) -> Iterator[jcore.Jaxpr]:
    """The open jaxprs among an eqn's params (call bodies, loop and branch bodies)."""
    for j in jaxpr_params(eqn.params):
        yield as_jaxpr(j)


def iter_marks(jaxpr: jcore.Jaxpr) -> Iterator[Any]:
    """Every mark eqn, in program order, including those in nested jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is mark_p:
            yield eqn
        for sub in sub_jaxprs(eqn):
            yield from iter_marks(sub)


def has_marks(j: Any) -> bool:
    return next(iter_marks(as_jaxpr(j)), None) is not None


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts, args, bind) -> list:
    """Evaluate ``jaxpr`` equation by equation as ``jax.core.eval_jaxpr`` does, each equation by
    ``bind(eqn, invals)`` (its result, or its results for a multiple-results primitive)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        outs = bind(eqn, [read(v) for v in eqn.invars])
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def input_reads(jaxpr: jcore.Jaxpr, out_reads: list[int] | None = None) -> list[int]:
    """How many ops read each of ``jaxpr``'s inputs. A call's operand is read as often as the matching input
    of its body is, and a mark's operand as often as the matching mark result is (both pass values through).
    ``out_reads`` says how often each output is read outside (default: not at all). A parameter read more than
    once (a tied embedding) has a gradient that is a sum of as many contributions. A loop or branch (scan, while,
    cond) counts as one read of each operand, however often its body reads it.

    >>> import jax, jax.numpy as jnp
    >>> j = jax.make_jaxpr(jax.jit(lambda e, x: (x @ e) @ e.T))(jnp.ones((4, 2)), jnp.ones((3, 4))).jaxpr
    >>> input_reads(j)      # e by the first matmul and by the transpose; x once (through the jit call)
    [2, 1]
    """
    reads: dict = {}
    for v, n in zip(jaxpr.outvars, out_reads or [0] * len(jaxpr.outvars)):
        if isinstance(v, jcore.Var):
            reads[v] = reads.get(v, 0) + n
    for eqn in reversed(jaxpr.eqns):
        outs = [reads.get(v, 0) for v in eqn.outvars]
        body = call_jaxpr(eqn)
        if body is not None and len(body.invars) == len(eqn.invars):
            ins = input_reads(body, outs)
        elif eqn.primitive is mark_p and len(eqn.invars) == len(eqn.outvars):
            ins = outs
        else:
            ins = [1] * len(eqn.invars)
        for v, n in zip(eqn.invars, ins):
            if isinstance(v, jcore.Var):
                reads[v] = reads.get(v, 0) + n
    return [reads.get(v, 0) for v in jaxpr.invars]


def scanned_inputs(jaxpr: jcore.Jaxpr) -> list[bool]:
    """Whether each of ``jaxpr``'s inputs is read as a scanned operand of a ``scan`` (a stack of per-step slices,
    as the weights of a scan over layers are), through calls and marks.

    >>> import jax, jax.numpy as jnp
    >>> f = lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
    >>> scanned_inputs(jax.make_jaxpr(jax.jit(f))(jnp.ones((3, 4, 4)), jnp.ones((2, 4))).jaxpr)
    [True, False]
    """
    scanned: set = set()
    for eqn in reversed(jaxpr.eqns):
        body = call_jaxpr(eqn)
        if eqn.primitive.name == "scan":
            first = eqn.params["num_consts"] + eqn.params["num_carry"]
            flags = [i >= first for i in range(len(eqn.invars))]
        elif body is not None and len(body.invars) == len(eqn.invars):
            flags = scanned_inputs(body)
        elif eqn.primitive is mark_p and len(eqn.invars) == len(eqn.outvars):
            flags = [v in scanned for v in eqn.outvars]
        else:
            continue
        scanned.update(v for v, f in zip(eqn.invars, flags) if f and isinstance(v, jcore.Var))
    return [v in scanned for v in jaxpr.invars]
