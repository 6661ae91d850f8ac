"""Every docstring example in mshard and in the shared example modules runs (on the 8 simulated devices)."""

import doctest
import importlib
import pkgutil

import pytest

import mshard


def _with_examples(names):
    finder = doctest.DocTestFinder()
    return [n for n in names if any(t.examples for t in finder.find(importlib.import_module(n)))]


MODULES = _with_examples(["mshard"] + sorted(m.name for m in pkgutil.walk_packages(mshard.__path__, "mshard."))
                         + ["reference", "gpt"])


def test_the_public_modules_have_examples():
    for name in ("mshard", "mshard.context", "mshard.errors", "mshard.communication", "mshard.dataset", "mshard.fusion",
                 "mshard._src.values.layout", "mshard._src.values.plan", "mshard._src.runtime.region",
                 "mshard._src.frontend.shard", "mshard._src.training.train_cells", "mshard._src.edges.comm_report",
                 "mshard._src.edges.checkpoint.api", "mshard._src.edges.checkpoint.manager",
                 "mshard._src.edges.checkpoint.checksum", "mshard._src.edges.checkpoint.infer"):
        assert name in MODULES, f"{name} has no docstring example"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, \
        f"{name}: {result.failed} of {result.attempted} docstring examples failed"
