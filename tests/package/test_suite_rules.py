"""Rules the suite keeps about itself (issue 37), read from its own source: comparisons that cannot stop early,
expected failures that name their signal, skips that say why, and tiers that are markers on the tests."""

import ast

import pytest
from helpers import TESTS

SOURCES = sorted(p for p in TESTS.rglob("*.py"))


def _calls(name: str):
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                dotted = f.id if isinstance(f, ast.Name) else (
                    f"{getattr(f.value, 'attr', getattr(f.value, 'id', ''))}.{f.attr}" if isinstance(f, ast.Attribute)
                    else "")
                if dotted == name:
                    yield path.relative_to(TESTS), node


def test_every_zip_is_strict():
    """A zip of two leaf lists stops at the shorter one: a model with a parameter missing would compare the rest and
    pass. Every zip in tests/ says strict=True."""
    loose = [f"{p}:{c.lineno}" for p, c in _calls("zip") if not any(k.arg == "strict" for k in c.keywords)]
    assert not loose, f"zip without strict=True: {loose}"


def test_expected_failures_name_their_signal_and_skips_say_why():
    """An xfail must be strict and say which exception it expects (raises=), or an import error passes for the bug
    it documents; a skip must give its reason."""
    bad = []
    for p, c in _calls("mark.xfail"):
        kw = {k.arg for k in c.keywords}
        if not {"strict", "raises", "reason"} <= kw:
            bad.append(f"{p}:{c.lineno} xfail without strict/raises/reason")
    for name in ("mark.skip", "mark.skipif"):
        for p, c in _calls(name):
            if "reason" not in {k.arg for k in c.keywords}:
                bad.append(f"{p}:{c.lineno} {name} without reason")
    for p, c in _calls("pytest.skip"):
        if not c.args and not c.keywords:
            bad.append(f"{p}:{c.lineno} pytest.skip() without a reason")
    assert not bad, bad


def test_tiers_are_markers_on_the_tests(pytestconfig):
    """conftest holds no lists of test paths (a renamed test would move between tiers silently), and pytest refuses
    an unregistered marker, so a misspelt @pytest.mark.slwo cannot put a test in the fast tier."""
    conftest = ast.parse((TESTS / "conftest.py").read_text())
    paths = [n.value for n in ast.walk(conftest) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and n.value.startswith("tests/")]
    assert not paths, f"tests/conftest.py names test paths: {paths}"
    assert pytestconfig.getoption("strict_markers") or "--strict-markers" in pytestconfig.getini("addopts")


@pytest.mark.parametrize("marker", ["slow", "heavy"])
def test_the_tier_markers_are_registered(pytestconfig, marker):
    assert any(line.startswith(f"{marker}") for line in pytestconfig.getini("markers"))


def test_every_planted_bug_still_finds_its_code():
    """bench/mutate.py plants each bug by replacing one exact text: when the code moves, the bug is reported n/a and
    the suite's check against it is silently lost. Each anchor must match exactly once in its file, and the test files
    it runs first must exist."""
    import importlib.util
    import sys

    from helpers import ROOT
    spec = importlib.util.spec_from_file_location("_mutate", ROOT / "bench" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)
    sys.modules["_mutate"] = mutate     # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mutate)
    finally:
        del sys.modules["_mutate"]
    stale = [f"{b.name}: {b.path} holds its anchor {(ROOT / b.path).read_text().count(b.old)} times"
             for b in mutate.BUGS if (ROOT / b.path).read_text().count(b.old) != 1]
    stale += [f"{b.name}: its first test file {f} is gone" for b in mutate.BUGS for f in b.first
              if not (ROOT / f).is_file()]
    assert not stale, stale
