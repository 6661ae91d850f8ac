"""Where a pipelined step keeps its parameters, so that parameter memory drops with the stage count.

A parameter that one stage alone uses is *owned* by that stage and stored split over the stage mesh axes on one dim
(its *stage dim*: the first dim the stage count divides that its in-stage layout does not split, so that joining the
stages' pieces is a concatenation of whole blocks on every device): every device holds ``1/S`` of it (and, following
it, of its optimizer state and gradient), in global view an ordinary ``jax.Array`` of the parameter's own shape that
the user reads, saves and calls eagerly as any other. Inside the step (the pipeline's ``shard_map``, manual over the
stage axes) one ``all_to_all`` over the stage axes brings each stage its own parameters whole, and none of the other
stages': the owned parameters are grouped by (shape, dtype, in-stage layout) into slots, slot ``i`` of a group
holding on stage ``s`` the ``i``-th parameter of that group that stage ``s`` owns (a stage with fewer has zeros
there). The gradients of the owned parameters go back the same way, one ``all_to_all`` per step, and arrive split as
the parameters are stored.

A parameter that several stages use (a tied embedding and head), that no stage uses, or that has no stage dim is
*shared*: stored whole on every stage, its gradient summed over the stages (``psum``), so every
stage holds the same value after the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mshard._src.values.layout import dims_of


def stage_dim(shape: tuple[int, ...], spec: Any, stages: int) -> int | None:
    """The dim a parameter of ``shape`` with in-stage layout ``spec`` (a PartitionSpec or None) is split on over
    the stages: the first the stage count divides that ``spec`` does not split (on a dim split inside the stage
    too, the stages' pieces interleave with its own slices on each device, so the all-to-all that joins them runs
    on whole pieces: :meth:`StageStorage._a2a`), else dim 0 if the stage count divides it; None where neither."""
    split = dims_of(spec, len(shape)) if spec is not None else ((),) * len(shape)
    free = next((k for k, n in enumerate(shape) if n % stages == 0 and not split[k]), None)
    return free if free is not None else 0 if shape and shape[0] % stages == 0 else None


@dataclass
class StageStorage:
    """Per parameter leaf: its owning stage (None: shared) and its slot ``(group, index)``; per group: the
    parameters' full shape, dtype and how many slots it has."""

    stages: int
    owner: list[int | None]
    slot: list[tuple[int, int] | None]
    groups: list[tuple[tuple[int, ...], Any]]
    counts: list[int]
    dims: list[int]                 # per group: the stage dim its parameters are split on
    specs: list[Any]                # per group: its parameters' in-stage layout (None: replicated in the stage)

    @classmethod
    def build(cls, readers: list[set[int]], avals: list[Any], specs: list[Any] | None, stages: int) -> StageStorage:
        """``readers[j]``: the (physical) stages that use parameter ``j``; ``avals[j]``: its shape and dtype;
        ``specs[j]``: its layout inside a stage (None: replicated inside the stage)."""
        owner: list[int | None] = []
        slot: list[tuple[int, int] | None] = []
        keys: dict[tuple, int] = {}
        groups: list[tuple[tuple[int, ...], Any]] = []
        counts: list[int] = []
        dims: list[int] = []
        lays: list[Any] = []
        used: dict[tuple[int, int], int] = {}
        for j, (who, a) in enumerate(zip(readers, avals)):
            shape = tuple(a.shape)
            k = stage_dim(shape, None if specs is None else specs[j], stages)
            if len(who) != 1 or k is None or stages == 1:
                owner.append(None)
                slot.append(None)
                continue
            (s,) = who
            key = (shape, jnp.dtype(a.dtype), None if specs is None else str(specs[j]), k)
            g = keys.setdefault(key, len(groups))
            if g == len(groups):
                groups.append((shape, jnp.dtype(a.dtype)))
                counts.append(0)
                dims.append(k)
                lays.append(None if specs is None else specs[j])
            i = used.get((g, s), 0)
            used[(g, s)] = i + 1
            counts[g] = max(counts[g], i + 1)
            owner.append(s)
            slot.append((g, i))
        return cls(stages, owner, slot, groups, counts, dims, lays)

    def split(self, j: int) -> bool:
        """Whether parameter ``j`` is stored split over the stage axes (owned by one stage)."""
        return self.owner[j] is not None

    def dim(self, j: int) -> int:
        """Parameter ``j``'s stage dim (it is owned: :meth:`split`)."""
        return self.dims[self.slot[j][0]]

    def spec(self, j: int, axes: tuple[str, ...]) -> P:
        """Parameter ``j``'s layout over the stage ``axes``: split on its stage dim if owned, else whole."""
        return P(*(None,) * self.dim(j), tuple(axes)) if self.split(j) else P()

    def stored_bytes(self, j: int, nbytes: int) -> int:
        """Bytes of parameter ``j`` (``nbytes`` whole) one device stores, over the stage axes."""
        return nbytes // self.stages if self.split(j) else nbytes

    def _members(self, g: int) -> list[tuple[int, int, int]]:
        return [(j, self.owner[j], s[1]) for j, s in enumerate(self.slot) if s is not None and s[0] == g]

    def _local(self, g: int) -> tuple[int, ...]:
        shape, k = self.groups[g][0], self.dims[g]
        return shape[:k] + (shape[k] // self.stages,) + shape[k + 1:]

    def _a2a(self, g: int, x, axes: tuple[str, ...], mesh):
        """``lax.all_to_all`` of ``x`` (``[S, n, *shape]``: its stage pieces, group ``g``'s parameter dims) over
        the stage ``axes`` on dim 0. Where the group's in-stage layout splits the parameters over axes inside the
        stage, the all-to-all runs in a ``shard_map`` manual over those axes too, on each device's slices: left to
        XLA's partitioner, the operand of an all-to-all in a ``shard_map`` manual over the stage axes only was
        gathered whole over the others first (the Megatron blocks of a dp 2 x mp 2 x pp 2 GPT: 394,752 B
        all-gathered per device)."""
        sp = self.specs[g]
        lay = dims_of(sp, len(self.groups[g][0])) if sp is not None and mesh is not None else ()
        inner = {a for d in lay for a in d}
        if not inner or lay[self.dims[g]]:       # no split inside the stage, or on the stage dim: XLA's way
            return lax.all_to_all(x, axes, 0, 0)
        spec = P(None, None, *sp)
        # nested in the pipeline's shard_map: on its context mesh (the stage axes already Manual)
        return jax.shard_map(lambda y: lax.all_to_all(y, axes, 0, 0), mesh=jax.sharding.get_abstract_mesh(),
                             in_specs=spec, out_specs=spec,
                             axis_names=inner, check_vma=False)(x)

    def gather(self, p: list, axes: tuple[str, ...], mesh=None) -> list:
        """Inside the ``shard_map``: the owned parameters' local slices ``p`` -> per group ``[n, *shape]``, this
        stage's own parameters whole (one ``all_to_all`` per group)."""
        S, out = self.stages, []
        for g, ((shape, dt), n) in enumerate(zip(self.groups, self.counts)):
            loc = self._local(g)
            send = [[None] * n for _ in range(S)]
            for j, t, i in self._members(g):
                send[t][i] = p[j]
            send = jnp.stack([jnp.stack([x if x is not None else jnp.zeros(loc, dt) for x in row]) for row in send])
            recv = self._a2a(g, send, axes, mesh)                        # [source stage, n, *loc]
            k = self.dims[g]                                            # the stages' pieces joined on dim k
            out.append(jnp.moveaxis(recv, 0, k + 1).reshape((n,) + shape))
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

    def scatter(self, own: list, axes: tuple[str, ...], mesh=None) -> dict[int, Any]:
        """Per group ``[n, *shape]`` gradients of this stage's own parameters -> ``{j: local slice}`` of every
        owned parameter's gradient, split as it is stored (one ``all_to_all`` per group)."""
        S, out = self.stages, {}
        for g, x in enumerate(own):
            n, loc, k = self.counts[g], self._local(g), self.dims[g]
            cut = x.reshape((n,) + loc[:k] + (S,) + loc[k:])           # dim k cut into the stages' pieces
            send = jnp.moveaxis(cut, k + 1, 0)                          # [destination stage, n, *loc]
            recv = self._a2a(g, send, axes, mesh)                        # [owning stage, n, *loc]
            for j, t, i in self._members(g):
                out[j] = recv[t, i]
        return out
