"""examples/train_mlp.py, train_gpt.py and train_gpt_pipeline.py run and check themselves against one device."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT, xla_flags

pytestmark = pytest.mark.slow

ENV = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")


def run(script, *args):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                         env=ENV, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_train_mlp_example():
    text = run("train_mlp.py", "--steps", "3")
    assert "train_mlp OK" in text and text.count("parameters match one device") == 6
    assert "reduce-scatter" in text


def test_train_gpt_example_three_modes():
    text = run("train_gpt.py", "--steps", "3", "--layers", "2")      # the example's 4 layers: same code, slower
    assert "train_gpt OK" in text
    for mode in ("data_parallel", "semi_auto_parallel", "auto_parallel"):
        assert f"{mode}: loss" in text and "matches one device step for step" in text
    assert "mshard plan" in text and "collectives in compiled HLO" in text


def test_train_gpt_pipeline_example_megatron_in_two_stages():
    text = run("train_gpt_pipeline.py", "--steps", "3", "--layers", "2", "--megatron")
    assert "train_gpt_pipeline OK (1f1b, 2 stages, 4 micro-batches)" in text
    assert "stage 0 -> 1: float32[4, 32, 64]" in text and "collective-permute" in text
