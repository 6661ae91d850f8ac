"""The searchers package: its doctests pass and it never imports JAX."""

import doctest
import importlib
import pkgutil
import subprocess
import sys

import pytest

import searchers

MODULES = sorted(m.name for m in pkgutil.iter_modules(searchers.__path__, "searchers."))


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_searchers_never_import_jax():
    code = ("import sys, importlib, pkgutil, searchers\n"
            "for m in pkgutil.iter_modules(searchers.__path__, 'searchers.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
