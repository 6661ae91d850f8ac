"""Where a pipelined step keeps its parameters, so that parameter memory drops with the stage count.

A parameter that one stage alone uses is *owned* by that stage and stored split over the stage mesh axes on its
dim 0: every device holds ``1/S`` of it (and, following it, of its optimizer state and gradient), in global view
an ordinary ``jax.Array`` of the parameter's own shape that the user reads, saves and calls eagerly as any other.
Inside the step (the pipeline's ``shard_map``, manual over the stage axes) one ``all_to_all`` over the stage axes
brings each stage its own parameters whole, and none of the other stages': the owned parameters are grouped by
(shape, dtype, in-stage layout) into slots, slot ``i`` of a group holding on stage ``s`` the ``i``-th parameter of
that group that stage ``s`` owns (a stage with fewer has zeros there). The gradients of the owned parameters
go back the same way, one ``all_to_all`` per step, and arrive split as the parameters are stored.

A parameter that several stages use (a tied embedding and head), that no stage uses, or whose dim 0 the stage count
does not divide is *shared*: stored whole on every stage, its gradient summed over the stages (``psum``), so every
stage holds the same value after the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax


@dataclass
class StageStorage:
    """Per parameter leaf: its owning stage (None: shared) and its slot ``(group, index)``; per group: the
    parameters' full shape, dtype and how many slots it has."""

    stages: int
    owner: list[int | None]
    slot: list[tuple[int, int] | None]
    groups: list[tuple[tuple[int, ...], Any]]
    counts: list[int]

    @classmethod
    def build(cls, readers: list[set[int]], avals: list[Any], specs: list[Any] | None, stages: int) -> StageStorage:
        """``readers[j]``: the (physical) stages that use parameter ``j``; ``avals[j]``: its shape and dtype;
        ``specs[j]``: its layout inside a stage (None: replicated inside the stage)."""
        owner: list[int | None] = []
        slot: list[tuple[int, int] | None] = []
        keys: dict[tuple, int] = {}
        groups: list[tuple[tuple[int, ...], Any]] = []
        counts: list[int] = []
        used: dict[tuple[int, int], int] = {}
        for j, (who, a) in enumerate(zip(readers, avals)):
            shape = tuple(a.shape)
            if len(who) != 1 or not shape or shape[0] % stages or stages == 1:
                owner.append(None)
                slot.append(None)
                continue
            (s,) = who
            key = (shape, jnp.dtype(a.dtype), None if specs is None else str(specs[j]))
            g = keys.setdefault(key, len(groups))
            if g == len(groups):
                groups.append((shape, jnp.dtype(a.dtype)))
                counts.append(0)
            i = used.get((g, s), 0)
            used[(g, s)] = i + 1
            counts[g] = max(counts[g], i + 1)
            owner.append(s)
            slot.append((g, i))
        return cls(stages, owner, slot, groups, counts)

    def split(self, j: int) -> bool:
        """Whether parameter ``j`` is stored split over the stage axes (owned by one stage)."""
        return self.owner[j] is not None

    def stored_bytes(self, j: int, nbytes: int) -> int:
        """Bytes of parameter ``j`` (``nbytes`` whole) one device stores, over the stage axes."""
        return nbytes // self.stages if self.split(j) else nbytes

    def _members(self, g: int) -> list[tuple[int, int, int]]:
        return [(j, self.owner[j], s[1]) for j, s in enumerate(self.slot) if s is not None and s[0] == g]

    def _local(self, g: int) -> tuple[int, ...]:
        shape = self.groups[g][0]
        return (shape[0] // self.stages,) + shape[1:]

    def gather(self, p: list, axes: tuple[str, ...]) -> list:
        """Inside the ``shard_map``: the owned parameters' local slices ``p`` -> per group ``[n, *shape]``, this
        stage's own parameters whole (one ``all_to_all`` per group)."""
        S, out = self.stages, []
        for g, ((shape, dt), n) in enumerate(zip(self.groups, self.counts)):
            loc = self._local(g)
            send = [[None] * n for _ in range(S)]
            for j, t, i in self._members(g):
                send[t][i] = p[j]
            send = jnp.stack([jnp.stack([x if x is not None else jnp.zeros(loc, dt) for x in row]) for row in send])
            recv = lax.all_to_all(send, axes, 0, 0)                   # [source stage, n, *loc]
            out.append(jnp.moveaxis(recv, 0, 1).reshape((n,) + shape))
        return out

    def params_for(self, s: int, own: list, p: list) -> list:
        """The parameter list stage ``s`` computes with: its own parameters from ``own``, the shared ones from
        ``p``, zeros (unused: removed as dead code) for the other stages' parameters."""
        out = []
        for j, x in enumerate(p):
            t = self.owner[j]
            if t is None:
                out.append(x)
            elif t == s:
                g, i = self.slot[j]
                out.append(own[g][i])
            else:
                out.append(jnp.zeros(self.groups[self.slot[j][0]][0], self.groups[self.slot[j][0]][1]))
        return out

    def own_grads(self, s: int, gp: list) -> list:
        """Stage ``s``'s gradient list ``gp`` (one per parameter) -> per group ``[n, *shape]`` of its own."""
        out = []
        for g, ((shape, dt), n) in enumerate(zip(self.groups, self.counts)):
            rows = [jnp.zeros(shape, dt)] * n
            for j, t, i in self._members(g):
                if t == s:
                    rows[i] = gp[j].astype(dt)
            out.append(jnp.stack(rows))
        return out

    def zeros_own(self) -> list:
        return [jnp.zeros((n,) + shape, dt) for (shape, dt), n in zip(self.groups, self.counts)]

    def scatter(self, own: list, axes: tuple[str, ...]) -> dict[int, Any]:
        """Per group ``[n, *shape]`` gradients of this stage's own parameters -> ``{j: local slice}`` of every
        owned parameter's gradient, split as it is stored (one ``all_to_all`` per group)."""
        S, out = self.stages, {}
        for g, x in enumerate(own):
            n, loc = self.counts[g], self._local(g)
            send = jnp.moveaxis(x.reshape((n, S) + loc), 1, 0)         # [destination stage, n, *loc]
            recv = lax.all_to_all(send, axes, 0, 0)                     # [owning stage, n, *loc]
            for j, t, i in self._members(g):
                out[j] = recv[t, i]
        return out
