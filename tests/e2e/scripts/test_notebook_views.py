"""What a notebook shows (issue 16): a plan's summary, a communication report and a plan's strategy graph render as
one clean HTML table or SVG (no ANSI escapes, names escaped), and as plain text from str()."""

import jax.numpy as jnp
import pytest

import mshard as ms
from mshard.errors import PlanError

ANSI = "\x1b["


def _region():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    # tanh keeps the product's (2, 4) layout; the second product asks (8, 1) x (1, 1): a redistribution
    f = ms.shard(lambda x, w, v: jnp.tanh(x @ w) @ v, in_strategy=((2, 1), (1, 4), None))
    args = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 8)))
    return f, args


def test_summary_and_comm_report_render_as_one_clean_table():
    f, args = _region()
    plan = f.region().plan(*args)
    s = plan.summary()
    html = s._repr_html_()
    assert html.count("<table>") == 1 and ANSI not in html and ANSI not in str(s)
    assert all(f"<td>{op.name}</td>" in html for op in plan.ops)
    grouped = plan.summary(group_by="module")._repr_html_()
    assert "<th>module</th>" in grouped and "<th>op</th>" not in grouped
    rep = ms.comm_report(f.region(), *args)
    rh = rep._repr_html_()
    assert rh.count("<table>") == 1 and ANSI not in rh and ANSI not in str(rep)
    for kind, v in rep.by_kind.items():
        assert f"<td>{kind}</td><td>{v['count']}</td>" in rh


def test_show_draws_every_op_its_inputs_and_the_redistributed_edges():
    f, args = _region()
    plan = f.region().plan(*args)
    g = plan.show()
    names = [n for n, *_ in g.nodes]
    assert {op.name for op in plan.ops} <= set(names) and {"arg0", "arg1", "arg2"} <= set(names)
    svg = g._repr_svg_()
    assert svg.startswith("<svg") and svg.count("<rect") == len(g.nodes) and svg.count("<line") == len(g.edges)
    # every redistribution the plan lists is a red edge into its op, saying what it moves
    reds = [(d, r) for _, d, r in g.edges if r]
    assert len(reds) >= len({r.op for r in plan.redistributions}) > 0
    assert all(any(d == r.op for d, _ in reds) for r in plan.redistributions)
    assert "#c0392b" in svg and str(g).count("->") >= len(g.edges)


def test_a_loaded_plan_or_a_huge_one_says_what_to_use_instead(tmp_path):
    f, args = _region()
    plan = f.region().plan(*args)
    plan.save(tmp_path / "p.json")
    with pytest.raises(PlanError, match="loaded from a file"):
        ms.load_plan(tmp_path / "p.json").show()
