"""Every public name has a short docstring a user can act on (issue 38): a summary of at most 10 lines, ``Args:``
for what it takes, ``Returns:`` for what a function gives back, and a runnable example (``>>>``; the examples run in
tests/package/test_doctests.py). Longer reasoning belongs in docs/, not in the docstring.

The public names are those the public face exports (``__all__`` of every module outside ``mshard/_src``)."""

from __future__ import annotations

import importlib
import inspect

import pytest

FACES = ("mshard", "mshard.nn", "mshard.ops", "mshard.parallel", "mshard.parallel.nn", "mshard.checkpoint", "mshard.errors", "mshard.common",
         "mshard.common.initializer", "mshard.runtime", "mshard.train",
         "mshard.context", "mshard.communication", "mshard.dataset", "mshard.fusion")


def _public() -> dict[str, object]:
    out: dict[str, object] = {}
    seen: set[int] = set()
    for face in FACES:
        mod = importlib.import_module(face)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or id(obj) in seen or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if inspect.isclass(obj) and issubclass(obj, (Exception, Warning)):
                continue                        # the error hierarchy: one line each, its use is in the raiser's doc
            if not getattr(obj, "__module__", "").startswith("mshard"):
                continue                        # a name of another library under MindSpore's name (ms.float32)
            seen.add(id(obj))
            out[f"{face}.{name}"] = obj
    return out


PUBLIC = _public()


def _takes_arguments(obj) -> bool:
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.name not in ("self", "cls") for p in params)


def _returns_something(obj) -> bool:
    if inspect.isclass(obj):
        return False
    ann = inspect.signature(obj).return_annotation
    return ann not in (None, "None", inspect.Signature.empty) or ann is inspect.Signature.empty


def problems(name: str, obj) -> list[str]:
    """What the docstring of one public name lacks (empty when it is complete)."""
    doc = inspect.getdoc(obj) or ""
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    out = []
    if not own:
        return [f"{name}: no docstring of its own"]
    lines = doc.splitlines()
    cut = next((i for i, ln in enumerate(lines) if ln.strip() in ("Args:", "Returns:", "Example:", "Examples:")
                or ln.lstrip().startswith(">>>")), len(lines))
    prose = [ln for ln in lines[:cut] if ln.strip()]
    if len(prose) > 10:
        out.append(f"{name}: the summary runs {len(prose)} lines (at most 10; move the reasoning to docs/)")
    if _takes_arguments(obj) and "Args:" not in doc:
        out.append(f"{name}: no Args: section")
    if _returns_something(obj) and "Returns:" not in doc:
        out.append(f"{name}: no Returns: section")
    if ">>>" not in doc:
        out.append(f"{name}: no runnable example")
    return out


def test_there_are_public_names():
    assert len(PUBLIC) > 100 and "mshard.nn.Cell" in PUBLIC and "mshard.ops.MatMul" in PUBLIC


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_docstring(name):
    assert problems(name, PUBLIC[name]) == []


def test_the_check_sees_a_bare_docstring():
    def f(x: int) -> int:
        """Doubles x."""
        return 2 * x

    assert problems("f", f) == ["f: no Args: section", "f: no Returns: section", "f: no runnable example"]
