"""The quickstart script and notebook run and check themselves against one device."""

import os
import subprocess
import sys

import nbformat
import pytest
from helpers import ROOT, xla_flags
from nbclient import NotebookClient

pytestmark = pytest.mark.slow



def test_quickstart_script_runs():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "quickstart OK" in out.stdout
    assert out.stdout.count("matches one device") == 3


def test_quickstart_notebook_executes():
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("8 devices" in o.get("text", "") for o in outputs)
    html = [o for o in outputs if "text/html" in o.get("data", {})]
    assert len(html) == 3 and "all-reduce" in html[0]["data"]["text/html"]


def test_infer_gpt_example_generates_like_one_device():
    """Train dp x mp 2x4 + optimizer parallel, save, load into mp 8, decode with a head-split KV cache (the
    example asserts the tokens equal one device's full forward and the decode step's collectives)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "infer_gpt.py"), "--steps", "20", "--new", "8"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "infer_gpt OK" in out.stdout and "same 8 tokens as one device" in out.stdout


def test_search_and_plan_notebook_executes():
    """notebooks/02: a plain flax MiniGPT through the four searchers beside data parallel, the pictures, and a few
    training steps equal to one device (the notebook asserts that itself). A notebook shows clean HTML/SVG: no
    ANSI escapes, no empty blocks."""
    nb = nbformat.read(ROOT / "notebooks" / "02_search_and_plan.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    table = next(h for h in html if "<th>search s</th>" in h)
    for name in ("data_parallel", "recursive_programming", "sharding_propagation", "dynamic_programming", "ilp"):
        assert f"<td>{name}</td>" in table
    assert any("<th>module</th>" in h for h in html)                      # summary(group_by="module")
    assert any("8 shard(s)" in h for h in html)                           # ms.visualize of a (2, 4) layout
    assert any("image/svg+xml" in o.get("data", {}) for o in outputs)     # plan.show()
    assert all("\x1b[" not in h and h.strip() and "<pre" not in h for h in html)
    assert any("match one device" in o.get("text", "") for o in outputs)


def test_pipeline_notebook_executes():
    """notebooks/03: the GPT in 2 stages trains equal to one device (the notebook asserts it, also with Megatron
    inside the stages), its per-stage plan and the three schedules render as HTML with the bubble equal to its
    formula, and the compiled step sends the stage boundary with a collective-permute."""
    nb = nbformat.read(ROOT / "notebooks" / "03_pipeline.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    report = next(h for h in html if h.startswith("<b>pipeline</b>"))
    from train_gpt import BATCH, HIDDEN, SEQ
    # what crosses the boundary: one block's output for one of the 4 micro-batches, [BATCH / 4, SEQ, HIDDEN]
    assert "backbone.blocks.0" in report and f"float32[{BATCH // 4}, {SEQ}, {HIDDEN}]" in report
    # the bubble of each schedule, from its table, against (S-1)/(M+S-1) and (S-1)/(v*M+S-1) for S=2, M=4, v=2
    for name, bubble in (("gpipe", "0.200"), ("1f1b", "0.200"), ("interleaved", "0.111")):
        assert any(h.startswith(f"<b>{name}</b>") and f"bubble {bubble} (formula {bubble})" in h for h in html)
    assert any("<td>collective-permute</td>" in h for h in html)
    assert all("\x1b[" not in h for h in html)
    text = "".join(o.get("text", "") for o in outputs)
    assert "match one device" in text and "dp x mp x pp losses match one device" in text
