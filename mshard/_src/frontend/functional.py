"""MindSpore's functional training style: ``ms.value_and_grad(fn, None, weights)`` and an ``@ms.jit`` step that
closes over the network and the optimizer and updates them in place.

JAX functions are pure: a jitted function that reads a Variable it closed over would bake its value in, and one
that writes it would leak a tracer. ``jit`` therefore finds the Modules, Variables and optimizer Cells the function
reaches (its closure and the globals it names, through the functions and containers they hold), passes them to the
region as its parameters, and while the function runs points each original Variable at the region's traced value,
so reads and writes inside the function are the region's own. ``value_and_grad`` does the same for ``weights``
under ``jax.value_and_grad``. The swap uses two private attributes of flax's Variable (its raw value and its trace
state): the one place mshard touches flax's internals.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from flax.nnx import tracers

from mshard._src.jaxpr import marks
from mshard._src.runtime.region import Region
from mshard._src.values.errors import CellTypeError

# -- pointing Variables at traced values ----------------------------------------------------------------


@contextlib.contextmanager
def swapped(variables: Sequence[nnx.Variable], values: Sequence[Any]) -> Iterator[None]:
    """While inside, each Variable holds the matching value and may be written at the current trace level; after,
    each holds what it held before (read what the body wrote with :func:`raw` inside)."""
    saved = [(object.__getattribute__(v, "_raw_value"), object.__getattribute__(v, "_trace_state")) for v in variables]
    try:
        for v, x in zip(variables, values, strict=True):
            object.__setattr__(v, "_raw_value", x)
            object.__setattr__(v, "_trace_state", tracers.TraceState())
        yield
    finally:
        for v, (x, ts) in zip(variables, saved, strict=True):
            object.__setattr__(v, "_raw_value", x)
            object.__setattr__(v, "_trace_state", ts)


def raw(v: nnx.Variable) -> Any:
    """The value a Variable holds now (inside :func:`swapped`: the traced one, or what the body wrote)."""
    return object.__getattribute__(v, "_raw_value")


# -- what a function reaches ----------------------------------------------------------------------------
def _state_of(obj: Any) -> list[nnx.Variable] | None:
    """The Variables of an object that keeps its state outside nnx (an optimizer Cell), or None."""
    get = getattr(type(obj), "state_variables", None)
    return list(obj.state_variables()) if callable(get) else None


def reachable(fn: Callable) -> dict[str, Any]:
    """The Modules, Variables and stateful objects ``fn`` reaches, by the name it reaches them under: its closure
    cells and the globals its code names, followed through functions, bound methods, partials, lists, tuples and
    dicts (not through arbitrary objects)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(name: str, obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 12:
            return
        seen.add(id(obj))
        if isinstance(obj, (nnx.Module, nnx.Variable)) or _state_of(obj) is not None:
            key, k = name, 1
            while key in found:
                key, k = f"{name}_{k}", k + 1
            found[key] = obj
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                visit(f"{name}_{i}", x, depth + 1)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                visit(f"{name}_{k}", x, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(name, obj.func, depth + 1)
            visit(f"{name}_args", list(obj.args) + list(obj.keywords.values()), depth + 1)
        elif isinstance(obj, types.MethodType):
            visit(name, obj.__self__, depth + 1)
            visit(name + "_fn", obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            for var, cell in zip(code.co_freevars, obj.__closure__ or (), strict=True):
                with contextlib.suppress(ValueError):       # an empty cell (a name bound later)
                    visit(var, cell.cell_contents, depth + 1)
            for gname in _names(code):
                if gname in obj.__globals__:
                    visit(gname, obj.__globals__[gname], depth + 1)

    visit(getattr(fn, "__name__", "fn"), fn, 0)
    return found


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


class _Held(nnx.Module):
    """What a jitted function reaches, as one Module: the region's parameters."""

    def __init__(self, objs: dict[str, Any]):
        for name, obj in objs.items():
            state = _state_of(obj)
            setattr(self, _attr(name), nnx.List(state) if state is not None else obj)


def _attr(name: str) -> str:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name if name and not name[0].isdigit() else f"v_{name}"


def _variables(m: nnx.Module) -> list[nnx.Variable]:
    out, seen = [], set()
    for _, v in nnx.iter_graph(m):
        if isinstance(v, nnx.Variable) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


# -- jit ------------------------------------------------------------------------------------------------
class ClosureRegion:
    """An ``ms.jit`` function that reaches Modules, Variables or optimizer Cells through its closure or globals:
    one region whose parameters are those objects (placed, updated in place, written back after each call)."""

    def __init__(self, fn: Callable, held: dict[str, Any]):
        self.fn = fn
        self.held = _Held(held)
        self.originals = _variables(self.held)
        self.region = Region(self._body, name=getattr(fn, "__name__", "jit"))
        functools.update_wrapper(self, fn)

    def _body(self, held: _Held, *args):
        record = marks.current_region()
        if record is not None:          # a PipelineCell called in here runs its schedule (training.pipeline.cells)
            record.hand_written = True
        inner = _variables(held)
        with swapped(self.originals, [raw(v) for v in inner]):
            out = self.fn(*args)
            after = [raw(v) for v in self.originals]
        for v, x, before in zip(inner, after, [raw(v) for v in inner], strict=True):
            if x is not before:
                v[...] = x
        return out

    def __call__(self, *args):
        return self.region(self.held, *args)

    def plan(self, *args):
        """The region's :class:`~mshard.Plan` for these inputs."""
        return self.region.plan(self.held, *args)

    def lower(self, *args):
        """The lowered program for these inputs (``.compile()`` it)."""
        return self.region.lower(self.held, *args)


def jit(function: Callable | None = None, **options: Any) -> Any:
    """MindSpore's ``ms.jit``: compile ``function`` into one region, planned under the current parallel context.

    nnx Module arguments are parameters and array arguments data. A function that reaches a network, Variables or
    an optimizer Cell through its closure or globals (MindSpore's ``train_step`` over ``net``, ``grad_fn`` and
    ``optimizer``) gets them as parameters too, and their updates are written back after each call. MindSpore's
    options (``jit_config``, ``capture_mode``, ``jit_level``, ...) are accepted; XLA compiles either way.

    Args:
        function: the function; ``@ms.jit`` and ``@ms.jit(...)`` both work.
        **options: MindSpore's jit options (no effect).

    Returns:
        The compiled function (a :class:`~mshard.Region`, or a closure region), called like ``function``.

    >>> import jax.numpy as jnp, mshard as ms
    >>> w = ms.Parameter(jnp.ones(2))
    >>> @ms.jit
    ... def step(x):
    ...     w[...] = w[...] + x
    ...     return w[...].sum()
    >>> float(step(jnp.ones(2))), w[...].tolist()
    (4.0, [2.0, 2.0])
    """
    if function is None:
        return lambda f: jit(f, **options)
    if isinstance(function, (Region, ClosureRegion)):
        return function
    held = reachable(function) if isinstance(function, types.FunctionType) else {}
    return ClosureRegion(function, held) if held else Region(function)


# -- value_and_grad -------------------------------------------------------------------------------------
def value_and_grad(fn: Callable, grad_position: int | Sequence[int] | None = 0,
                   weights: Any = None, has_aux: bool = False) -> Callable:
    """MindSpore's ``ms.value_and_grad``: a function returning ``fn``'s value and its gradients.

    Gradients are taken with respect to the positional inputs ``grad_position`` (an int, a tuple, or None for none)
    and the Parameters ``weights`` (a list, e.g. ``net.trainable_params()``, or None). With both, the gradients are
    ``(input_grads, weight_grads)``; with one, that one. With ``has_aux`` the function returns ``(loss, *aux)``, only
    ``loss`` is differentiated and the value is the whole tuple. Works eagerly and inside ``ms.jit``.

    Args:
        fn: the function of the loss.
        grad_position: the positional inputs to differentiate, or None.
        weights: the Parameters to differentiate (a list of ``nnx.Param``), or None.
        has_aux: whether ``fn`` returns ``(loss, *aux)``.

    Returns:
        A function of ``fn``'s inputs returning ``(value, gradients)``.

    >>> import jax.numpy as jnp, mshard as ms
    >>> w = ms.Parameter(jnp.array([1.0, 2.0]))
    >>> value, (gx, gw) = ms.value_and_grad(lambda x: (w[...] * x).sum(), 0, [w])(jnp.array([3.0, 4.0]))
    >>> float(value), gx.tolist(), [g.tolist() for g in gw]
    (11.0, [1.0, 2.0], [[3.0, 4.0]])
    """
    if grad_position is None and weights is None:
        raise CellTypeError("value_and_grad: grad_position and weights are both None; say what to differentiate.")
    ws = [] if weights is None else list(weights) if isinstance(weights, (list, tuple)) else [weights]
    for i, w in enumerate(ws):
        if not isinstance(w, nnx.Variable):
            raise CellTypeError(f"value_and_grad: weights[{i}] is a {type(w).__name__}, not a Parameter; pass "
                                f"net.trainable_params().")
    positions = () if grad_position is None else (
        (grad_position,) if isinstance(grad_position, int) else tuple(grad_position))

    def run(*args):
        def pure(wvals, xs):
            full = list(args)
            for p, x in zip(positions, xs, strict=True):
                full[p] = x
            with swapped(ws, wvals):
                out = fn(*full)
            loss = out[0] if has_aux else out
            return loss, out

        (_, out), (gw, gx) = jax.value_and_grad(pure, argnums=(0, 1), has_aux=True)(
            [raw(w) for w in ws], [args[p] for p in positions])
        gx = gx[0] if isinstance(grad_position, int) else tuple(gx)
        if weights is None:
            return out, gx
        if grad_position is None:
            return out, tuple(gw)
        return out, (gx, tuple(gw))

    return run


class GradOperation:
    """MindSpore's ``ops.GradOperation(get_all=False, get_by_list=False, sens_param=False)``: ``grad(fn, weights)``
    is a function of ``fn``'s inputs returning gradients, as :func:`value_and_grad` computes them.

    Neither flag: the gradient of the first input. ``get_all``: a tuple, one per input. ``get_by_list``: a tuple, one
    per weight. Both: ``(inputs' tuple, weights' tuple)``. ``sens_param``: the last input is the output's
    sensitivity (the cotangent), as in MindSpore; otherwise the output must be a scalar.

    Args:
        get_all: differentiate every positional input.
        get_by_list: differentiate the ``weights`` given at the call.
        sens_param: the gradient function takes the output's sensitivity as its last argument.

    >>> import jax.numpy as jnp, mshard as ms
    >>> from mshard import ops
    >>> w = ms.Parameter(jnp.array([2.0]))
    >>> g = ops.GradOperation(get_all=True, get_by_list=True)(lambda x: (w[...] * x * x).sum(), [w])
    >>> gx, gw = g(jnp.array([3.0]))
    >>> gx[0].tolist(), gw[0].tolist()
    ([12.0], [9.0])
    """

    def __init__(self, get_all: bool = False, get_by_list: bool = False, sens_param: bool = False):
        self.get_all, self.get_by_list, self.sens_param = get_all, get_by_list, sens_param

    def __call__(self, fn: Callable, weights: Any = None) -> Callable:
        if self.get_by_list and weights is None:
            raise CellTypeError("GradOperation(get_by_list=True): pass the weights, grad_op(fn, net.trainable_params()).")

        def grad_fn(*args):
            args = list(args)
            sens = args.pop() if self.sens_param else None
            f = fn if sens is None else (lambda *a: jax.numpy.sum(fn(*a) * sens))
            position = tuple(range(len(args))) if self.get_all else (None if self.get_by_list else 0)
            _, grads = value_and_grad(f, position, weights if self.get_by_list else None)(*args)
            return grads

        return grad_fn
