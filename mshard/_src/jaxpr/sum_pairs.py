"""Where a program adds two partial sums: the pairs the emitter reduces once (``mshard._src.runtime.partial_sums``)
and the planner prices once (``mshard._src.planning.fused_sums``).

A partial sum here is the result of a ``dot_general`` or a ``scatter-add`` (whether it is partial depends on the
layouts, which the readers of this module check); between it and the ``add_any`` there may be transposes and dtype
casts, each read by nothing else.
"""

from __future__ import annotations

from collections import Counter

from jax.extend import core as jcore

ROOTS = frozenset({"dot_general", "scatter-add"})
CHAIN = frozenset({"transpose", "convert_element_type"})


def partial_sum_pairs(jaxpr: jcore.Jaxpr) -> dict[int, str]:
    """``id(eqn)`` -> its role: ``"root"`` (an op that makes a partial sum), ``"chain"`` (a transpose or cast
    between it and the sum), ``"sum"`` (an ``add_any`` of two such chains). A chain's values are read by nothing
    else; an ``add_any`` already a sum may be the root of another (a parameter read three times).

    ``e`` read twice: its gradient adds the transposed contribution of ``x @ e`` (a dot_general, transposed
    twice on its way) to that of ``e.T`` (a dot_general, transposed back).

    >>> import jax, jax.numpy as jnp
    >>> j = jax.make_jaxpr(jax.grad(lambda e, x: jnp.sum((x @ e) @ e.T)))(jnp.ones((4, 2)), jnp.ones((3, 4)))
    >>> roles = partial_sum_pairs(j.jaxpr)
    >>> [(roles[id(e)], e.primitive.name) for e in j.jaxpr.eqns if id(e) in roles]  # doctest: +NORMALIZE_WHITESPACE
    [('root', 'dot_general'), ('chain', 'transpose'), ('chain', 'transpose'), ('root', 'dot_general'),
     ('chain', 'transpose'), ('sum', 'add_any')]
    """
    uses = Counter(v for e in jaxpr.eqns for v in e.invars if isinstance(v, jcore.Var))
    uses.update(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    roles: dict[int, str] = {}
    for e in jaxpr.eqns:
        if e.primitive.name != "add_any":
            continue
        chains = [_chain(v, uses, producer, roles) for v in e.invars]
        if all(c is not None for c in chains):
            for c in chains:
                roles.setdefault(id(c[-1]), "root")
                roles.update((id(p), "chain") for p in c[:-1])
            roles[id(e)] = "sum"
    return roles


def _chain(v, uses: Counter, producer: dict, roles: dict[int, str]) -> list | None:
    chain = []
    while isinstance(v, jcore.Var) and uses[v] == 1 and v in producer:
        p = producer[v]
        chain.append(p)
        if p.primitive.name in ROOTS or roles.get(id(p)) == "sum":
            return chain
        if p.primitive.name not in CHAIN:
            return None
        v = p.invars[0]
    return None
