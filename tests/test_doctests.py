"""Every docstring example in mshard and in the shared example modules runs (on the 8 simulated devices)."""

import doctest
import importlib
import pathlib
import pkgutil
import sys

import pytest

import mshard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))


def _with_examples(names):
    finder = doctest.DocTestFinder()
    return [n for n in names if any(t.examples for t in finder.find(importlib.import_module(n)))]


MODULES = _with_examples(sorted(m.name for m in pkgutil.walk_packages(mshard.__path__, "mshard."))
                         + ["reference", "gpt"])


def test_the_public_modules_have_examples():
    for name in ("mshard.context", "mshard.layout", "mshard.plan", "mshard.region", "mshard.shard", "mshard.nn.train",
                 "mshard.fusion", "mshard.comm_report", "mshard.dataset", "mshard.checkpoint.api",
                 "mshard.checkpoint.manager", "mshard.checkpoint.checksum", "mshard.checkpoint.infer"):
        assert name in MODULES, f"{name} has no docstring example"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, \
        f"{name}: {result.failed} of {result.attempted} docstring examples failed"
