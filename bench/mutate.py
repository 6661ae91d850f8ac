"""Does the suite catch a wrong program? Plant one deliberate bug at a time in a scratch copy of the repository and
run the fast tier on it (``-m "not slow"``, stopping at the first failure); print which bugs it caught, by which
test, in how many seconds.

Each bug is a textual replacement in one file of ``mshard/`` (it must match exactly once, or the bug is reported
``n/a``: the code moved). The tests run in order: the files most likely to see the bug first, then every other
fast test, so a caught bug costs a minute and a missed one a whole fast tier (about 10 minutes on 2 cores).

    .venv/bin/python bench/mutate.py                     # every bug, against the working tree
    .venv/bin/python bench/mutate.py --only grad_doubled --rev 41da81c --out mutate.json
    .venv/bin/python bench/mutate.py --smoke             # one bug, one targeted file (a check that the tool runs)

``--rev``: the package *and* tests of that commit (``git archive``), to compare the suite before and after a
change. JSON (``--out``): ``{"rev", "results": [{"bug", "what", "caught", "applied", "test", "seconds"}],
"caught", "total"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    path: str
    old: str
    new: str
    first: tuple[str, ...]          # test files to run before the rest of the fast tier


BUGS = [
    Bug("search_replicated", "every search returns the replicated plan (user strategies kept)",
        "mshard/_src/planning/search.py",
        "    notes.extend(result.notes)\n    return result\n",
        "    if searcher.name != \"data_parallel\":\n"
        "        from searchers.graph import replicated as _replicated\n"
        "        result = dataclasses.replace(result, strategies={\n"
        "            op.id: result.strategies[op.id] if op.fixed is not None else _replicated(op) for op in graph.ops})\n"
        "    notes.extend(result.notes)\n    return result\n",
        ("tests/e2e/search/test_searchers_on_models.py", "tests/e2e/search/test_plan_program.py")),
    Bug("constraint_dropped", "the planned layout of every dot_general's output is not emitted",
        "mshard/_src/runtime/emit.py",
        "        outs_lay = self.eqn_out.get(key)\n",
        "        outs_lay = self.eqn_out.get(key) if prim.name != \"dot_general\" else None\n",
        ("tests/e2e/search/test_plan_program.py", "tests/e2e/strategies/test_strategies.py")),
    Bug("grad_doubled", "the data-parallel gradient reduction counts every replica twice",
        "mshard/_src/training/train_cells.py",
        "        reduced = [g / dp for g in reduced]       # the mean over the replicas",
        "        reduced = [2 * g / dp for g in reduced]       # the mean over the replicas",
        ("tests/e2e/training/test_train.py",)),
    Bug("checksum_passes", "a checkpoint's content checksum accepts any data",
        "mshard/_src/edges/checkpoint/api.py",
        "        if np.array_equal(total(w), want):\n",
        "        if True:\n",
        ("tests/unit/edges/test_checkpoint.py",)),
    Bug("pipeline_wrong_microbatch", "a stage stores the activation it receives under the next micro-batch's slot",
        "mshard/_src/training/pipeline/run.py",
        "            ring_f = store(ring_f, recv_f, ok_f, jnp.where(s == 0, c_f + 1, c_f), i_f)\n",
        "            ring_f = store(ring_f, recv_f, ok_f, jnp.where(s == 0, c_f + 1, c_f), i_f + 1)\n",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("zero_stale_shard", "optimizer parallel gathers each parameter's shard from before the update",
        "mshard/_src/training/train_cells.py",
        "                out, token = fusion.all_gather_buckets([new[i] for i in key], buckets, mesh,\n",
        "                out, token = fusion.all_gather_buckets([p_in[i] for i in key], buckets, mesh,\n",
        ("tests/e2e/training/test_train.py",)),
    Bug("direct_reshard_wrong_block", "the executor's own all-to-all sends its rows in reverse order",
        "mshard/_src/runtime/redistribute.py",
        "                x = jax.lax.all_to_all(x, group, split_axis=m.dim, concat_axis=m.src_dim, tiled=True)\n",
        "                x = jax.lax.all_to_all(x[::-1], group, split_axis=m.dim, concat_axis=m.src_dim, tiled=True)\n",
        ("tests/unit/runtime/test_redistribute.py", "tests/e2e/strategies/test_direct_redistribution.py")),
    Bug("scan_stack_whole", "a scan's stacked results are kept whole: a scan over layers stacks every layer's gradient "
        "whole before reducing it", "mshard/_src/runtime/emit.py",
        "    return [None if j >= num_carry and lay is not None and not any(lay) else lay for j, lay in enumerate(outs_lay)]\n",
        "    return list(outs_lay)\n",
        ("tests/e2e/training/test_fsdp_scan_layers.py",)),
    Bug("partial_sum_table_per_device", "a scatter-add's per-device part adds the table on every device, so the "
        "summed parts count it once per device", "mshard/_src/runtime/partial_sums.py",
        "        operand = jnp.where(first, operand, jnp.zeros_like(operand))\n",
        "        operand = operand\n",
        ("tests/unit/runtime/test_partial_sums.py", "tests/e2e/training/test_tied_parameters.py")),
    Bug("interleave_copies_swapped", "an interleaved_parallel op's copies are put back in reverse order, so each "
        "device's block has its halves swapped", "mshard/_src/frontend/interleave.py",
        "        flat = [o[j] for j in range(len(out_dims)) for o in outs]\n",
        "        flat = [o[j] for j in range(len(out_dims)) for o in outs[::-1]]\n",
        ("tests/e2e/strategies/test_interleaved_parallel.py",)),
    Bug("fused_sum_priced_twice", "the plan takes no reduction out for partial sums the emitter adds before one "
        "all-reduce", "mshard/_src/planning/fused_sums.py",
        "            out[free] = kept\n",
        "            pass\n",
        ("tests/unit/planning/test_fused_sums.py", "tests/e2e/training/test_tied_parameters.py")),
    Bug("scatter_on_dim_0", "a partial sum reduce-scattered into a split of any dim is scattered on dim 0",
        "mshard/_src/runtime/partial_sums.py",
        "            v = jax.lax.psum_scatter(v, axes, scatter_dimension=d, tiled=True)\n",
        "            v = jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True)\n",
        ("tests/e2e/strategies/test_scattered_sums.py",)),
    Bug("scatter_priced_as_all_reduce", "the plan prices a reduce-scattered partial sum as the all-reduce it was",
        "mshard/_src/planning/plan_build.py",
        "        costs[oid] = costs[oid] + rescaled[oid]\n",
        "        rescaled[oid] = Cost.sum([])\n",
        ("tests/e2e/strategies/test_scattered_sums.py", "tests/e2e/search/test_plan_program.py")),
    Bug("scatter_pairs_dropped", "the searchers' pairwise problem prices a reduce-scattered partial sum as an "
        "all-reduce", "searchers/pairwise_problem.py",
        "        self._add_scatter_pairs(graph, params)\n",
        "",
        ("tests/searchers/test_scatter_pricing.py",)),
    Bug("scatter_chain_not_relaid", "the ops that pass a reduce-scattered partial sum on keep their old layout, so "
        "the scattered result is gathered back", "mshard/_src/planning/scattered_sums.py",
        "            strategies.update(relaid)\n",
        "            pass\n",
        ("tests/e2e/strategies/test_storage_layouts.py",)),
    Bug("recompute_reads_shared", "the program's price shares a recomputed layer's redistributions with the "
        "forward's, which XLA runs again", "searchers/graph.py",
        "    return (tid, op.share_scope)\n",
        "    return (tid, 0)\n",
        ("tests/e2e/training/test_fsdp_layer_loop.py",)),
    Bug("merged_dim_minor_first", "a dim made of several loop dims (a reshape's merged run) is laid out over its "
        "minor loop dim's axes first", "searchers/graph.py",
        "    return tuple(a for d in label for a in where[d])\n",
        "    return tuple(a for d in reversed(label) for a in where[d])\n",
        ("tests/searchers/test_merged_dims.py", "tests/e2e/search/test_reshape_layouts.py")),
    Bug("joined_copies_swapped", "interleaved copies' partial sums are put back in the wrong order before their "
        "one reduce-scatter", "mshard/_src/runtime/partial_sums.py",
        "    v = jnp.concatenate([p.value for p in parts], axis=eqn.params[\"dimension\"] + 1)\n",
        "    v = jnp.concatenate([p.value for p in parts[::-1]], axis=eqn.params[\"dimension\"] + 1)\n",
        ("tests/e2e/strategies/test_interleaved_parallel.py",
         "tests/e2e/search/test_mindspore_out_strategy_propagation.py")),
    Bug("scan_body_unpriced", "the plan leaves out the collectives of a planned scan body's steps",
        "mshard/_src/planning/plan_build.py",
        "        rescaled[oid] = body\n        costs[oid] = costs[oid] + body\n",
        "        pass\n",
        ("tests/e2e/training/test_fsdp_scan_layers.py",)),
    Bug("scan_carry_kept_whole", "a scan's boundary stays where the search left it though its body computes its "
        "carry split and moves it back every step, and reads its constants split", "mshard/_src/planning/scan_bodies.py",
        "    return best\n",
        "    return None\n",
        ("tests/e2e/search/test_scan_bodies.py", "tests/e2e/training/test_accumulation_plans.py")),
    Bug("zero_buckets_sum_model_parallel_copies", "a fused step's optimizer-parallel buckets sum a gradient over "
        "the model-parallel devices that hold the same copy of it", "mshard/_src/runtime/fusion.py",
        "        red = jax.lax.psum_scatter(x, keep, scatter_dimension=0, tiled=True) if keep else x\n",
        "        red = jax.lax.psum_scatter(f, tuple(shard_axes), scatter_dimension=0, tiled=True)\n",
        ("tests/e2e/training/test_accumulation_plans.py", "tests/e2e/training/test_fsdp_compositions.py")),
    Bug("accumulation_reduced_per_micro_batch", "a GradAccumulationCell's model-parallel step leaves its gradient "
        "reductions to XLA, which reduces every micro-batch's gradient inside the loop", "mshard/_src/training/grads.py",
        "    if fusion.is_default(ctx) and not plan.tied and not plan.accumulated:\n",
        "    if fusion.is_default(ctx) and not plan.tied:\n",
        ("tests/e2e/training/test_accumulation_plans.py",)),
    Bug("probe_loads_strategy_file", "a training step's forward probe applies the step's strategy file, whose op "
        "names meet its own by chance", "mshard/_src/training/train_cells.py",
        '        self.probe = Region(lambda *a: a[-1](*a[:-1]), name=f"{name}.forward", strategy_file=False)\n',
        '        self.probe = Region(lambda *a: a[-1](*a[:-1]), name=f"{name}.forward")\n',
        ("tests/e2e/training/test_accumulation_plans.py",)),
    Bug("shard_map_inputs_dead", "the moves into a shard_map's inputs (a gradient bucket's in_specs) are priced as "
        "dead code", "searchers/graph.py",
        '_SINKS = frozenset({"writeback", "shard_map_in", "shard_map_in_partial"})',
        '_SINKS = frozenset({"writeback", "shard_map_in_partial"})',
        ("tests/unit/jaxpr/test_manual_collectives.py",)),
    Bug("loop_constants_not_tried_at_user_layouts", "a loop's constants are not tried where the user's strategies "
        "lay them out (marks inside a searched step's accumulation loop)", "mshard/_src/planning/scan_bodies.py",
        '    for consts in ("arrive", "whole", "user"):\n',
        '    for consts in ("arrive", "whole"):\n',
        ("tests/e2e/training/test_accumulation_plans.py",)),
    Bug("pipeline_grads_priced_once", "a pipelined step's plan prices the gradient reductions XLA runs in each "
        "backward branch once per step instead of once per micro-batch", "mshard/_src/training/pipeline/price.py",
        "                    moves += _reduced(M * nbytes[j], [a for a in dp if a not in _spec_axes(specs[j])], sizes)\n",
        "                    moves += _reduced(nbytes[j], [a for a in dp if a not in _spec_axes(specs[j])], sizes)\n",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("write_back_tie_not_restored", "a searched step's write-backs keep the layout the search gave them after a "
        "later step moves the parameter they are tied to", "mshard/_src/planning/search.py",
        "        if op.follow_operand is not None and op.fixed is None:\n",
        "        if op.follow_operand is not None and op.fixed is None and False:\n",
        ("tests/e2e/training/test_searched_step_prices.py",)),
    Bug("nesting_not_kept", "semi_auto's default follows an operand's split of the minor part of a merged dim alone "
        "(a reshape whose result no layout can say)", "searchers/follow.py",
        "    _keep_nesting(where, spec.nested, shape, spec.unsplittable, spec.sizes)\n",
        "    pass\n",
        ("tests/searchers/test_follow.py", "tests/e2e/training/test_searched_step_prices.py")),
    Bug("shard_map_ins_left_to_xla", "a fully manual shard_map's operands are moved into its in_specs by XLA at its "
        "boundary while the plan prices the executor's direct collectives", "mshard/_src/runtime/emit.py",
        "        if ins is None and prim.name == \"shard_map\" and self.planned:\n",
        "        if ins is None and prim.name == \"shard_map\" and self.planned and False:\n",
        ("tests/e2e/training/test_searched_step_prices.py",)),
    Bug("fused_replicas_vmapped", "a fused step whose devices are all replicas runs them under jax.vmap (a conv's "
        "weight gradient a grouped conv, kept whole: the batch gathered)", "mshard/_src/training/train_cells.py",
        "        if set(rax) == set(plan.mesh.names):\n",
        "        if set(rax) == set(plan.mesh.names) and False:\n",
        ("tests/e2e/training/test_train_fusion.py",)),
    Bug("rp_enumerates_fixed_loops", "recursive_programming enumerates the strategies of a loop fixed whole for the "
        "search (millions on a GPT's accumulation: the search does not end)", "searchers/recursive_programming.py",
        "            if sid not in searched and (sum(not u for u in spec.unsplittable) + 1) ** self.n_axes > _ENUMERATED:\n",
        "            if False:\n",
        ("tests/e2e/training/test_accumulation_plans.py",)),
    Bug("pipeline_reduced_per_micro_batch", "a data-parallel stage's gradients are left to XLA, reduced in every "
        "backward branch (M times per step)", "mshard/_src/training/pipeline/cells.py",
        "        specs = data_specs\n",
        "        specs, split = data_specs, None\n",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("pipeline_megatron_reduced_per_micro_batch", "a stage with operator strategies leaves its data-parallel "
        "gradient sums to XLA, in every backward branch", "mshard/_src/training/pipeline/cells.py",
        "            if a not in used and rows and rows % (n * rmesh.axis_size(a)) == 0:\n",
        "            if False:\n",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("stage_all_to_all_left_to_xla", "the all-to-all that brings a stage its own weights runs on whole pieces "
        "(XLA gathers each model-parallel slice first)", "mshard/_src/training/pipeline/storage.py",
        "        if not inner or lay[self.dims[g]]:",
        "        if True:",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("stage_dim_always_0", "a parameter is split over the stages on dim 0 even where its in-stage layout splits "
        "dim 0", "mshard/_src/training/pipeline/storage.py",
        "    free = next((k for k, n in enumerate(shape) if n % stages == 0 and not split[k]), None)\n",
        "    free = None\n",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("pipeline_replicas_summed", "a pipeline's replica gradients are summed, not averaged (dp times too large)",
        "mshard/_src/training/pipeline/run.py",
        "        return y / self.n if self.n > 1 else y\n",
        "        return y\n",
        ("tests/e2e/pipeline/test_pipeline.py",)),
    Bug("cond_branches_replicated", "a cond's operands are replicated again (its branches read the weights whole)",
        "mshard/_src/jaxpr/rules.py",
        '@register("cond")\n',
        '@register("cond_unused")\n',
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("while_trip_count_ignored", "a while loop is priced once whatever its trip count",
        "mshard/_src/planning/scan_bodies.py",
        "    trips = trip_count(te.eqn) if nk else 1\n",
        "    trips = None if nk else 1\n",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("branch_bodies_priced_cheapest", "a cond is priced as its cheapest branch, not its costlier",
        "mshard/_src/planning/scan_bodies.py",
        "    body = max(planned, key=lambda b: b.cost.total)\n",
        "    body = min(planned, key=lambda b: b.cost.total)\n",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("cond_results_from_first_branch", "a cond's results are left where its first branch leaves them (a "
        "differentiated cond's residual placeholders whole)", "mshard/_src/planning/scan_bodies.py",
        "        for b in bodies:\n            _, made = _plan_body(te, ins, [None] * len(outs)",
        "        for b in bodies[:1]:\n            _, made = _plan_body(te, ins, [None] * len(outs)",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("branch_reduce_scattered", "a cond's branch reduce-scatters its partial sums (XLA adds a gather the plan "
        "does not price)", "mshard/_src/planning/scan_bodies.py",
        "if te.eqn.primitive.name != \"cond\"\n",
        "if True\n",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("nested_loops_unplanned", "a loop inside a loop's body is left to XLA, unpriced",
        "mshard/_src/planning/scan_bodies.py",
        "    inner = plan_scan_bodies(body, strats, params, base, [])\n",
        "    inner = {}\n",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("while_condition_unplanned", "a while's condition is left to XLA, unpriced",
        "mshard/_src/planning/scan_bodies.py",
        "    if nk:\n        _with_condition(",
        "    if False:\n        _with_condition(",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("wide_conds_enumerated", "a cond with thousands of strategies is enumerated by the searchers (only a wide "
        "scan is searched whole)", "mshard/_src/planning/search.py",
        "        if op.kind not in OPAQUE_KINDS or op.fixed is not None:\n",
        "        if op.kind != \"scan\" or op.fixed is not None:\n",
        ("tests/e2e/search/test_branch_bodies.py",)),
    Bug("dataset_off_by_one", "each device's rows of a host batch are the next device's (the last keeps its own)",
        "mshard/_src/runtime/dataset.py",
        "        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])\n",
        "        def _next(idx):\n"
        "            s = idx[0] if idx and isinstance(idx[0], slice) else slice(None)\n"
        "            a, b = s.start or 0, host.shape[0] if s.stop is None else s.stop\n"
        "            a2 = min(b, host.shape[0] - (b - a))\n"
        "            return (slice(a2, a2 + b - a),) + tuple(idx[1:])\n"
        "        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[_next(idx)])\n",
        ("tests/e2e/training/test_train_data.py", "tests/e2e/training/test_train.py")),
]


def scratch_copy(dest: Path, rev: str | None) -> None:
    """The repository's tracked files (the working tree's, or those of ``rev``) under ``dest``."""
    if rev:
        data = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        tmp = dest.parent / "rev.tar"
        tmp.write_bytes(data)
        with tarfile.open(tmp) as tf:
            tf.extractall(dest, filter="data")
        tmp.unlink()
        return
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def plant(tree: Path, bug: Bug) -> bool:
    p = tree / bug.path
    src = p.read_text()
    if src.count(bug.old) != 1:
        return False
    p.write_text(src.replace(bug.old, bug.new))
    return True


def run_fast_tier(tree: Path, first: tuple[str, ...], timeout: float, only_first: bool) -> tuple[bool, str, float]:
    """-> (caught, the first failing test or the reason, seconds). Two pytest runs: the targeted files, then (if
    they pass) the rest of the fast tier without them (pytest merges a file named beside its folder into the
    folder's own order, so one run cannot put them first)."""
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    env.pop("MSHARD_TEST_SHARD", None)
    first = tuple(f for f in first if (tree / f).exists())
    base = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    runs = [base + list(first)] + ([] if only_first else [base + ["tests"] + [f"--ignore={f}" for f in first]])
    t0 = time.time()
    for cmd in runs:
        left = timeout - (time.time() - t0)
        try:
            r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s", time.time() - t0
        if r.returncode not in (0, 5):          # 5: no tests collected (a targeted file with only slow tests)
            out = r.stdout + r.stderr
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
            return True, failed[0] if failed else f"pytest exit {r.returncode}: {out.strip().splitlines()[-1:]}", \
                time.time() - t0
    return False, "", time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="run only this bug (repeatable)")
    ap.add_argument("--rev", help="the package and tests of this commit instead of the working tree")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per bug")
    ap.add_argument("--smoke", action="store_true", help="one bug, its targeted test files only")
    ap.add_argument("--first-only", action="store_true", help="each bug's targeted test files only (a quick look)")
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args(argv)
    bugs = [b for b in BUGS if not a.only or b.name in a.only]
    if a.smoke:
        bugs = [next(b for b in BUGS if b.name == "checksum_passes")]
    results = []
    with tempfile.TemporaryDirectory(prefix="mshard-mutate-") as td:
        base = Path(td) / "base"
        base.mkdir()
        scratch_copy(base, a.rev)
        for bug in bugs:
            tree = Path(td) / bug.name
            shutil.copytree(base, tree)
            applied = plant(tree, bug)
            caught, test, dt = (run_fast_tier(tree, bug.first, a.timeout, a.smoke or a.first_only) if applied
                                else (False, "n/a: the code to change is not there", 0.0))
            shutil.rmtree(tree, ignore_errors=True)
            results.append({"bug": bug.name, "what": bug.what, "applied": applied, "caught": caught, "test": test,
                            "seconds": round(dt, 1)})
            mark = "caught" if caught else ("n/a" if not applied else "MISSED")
            print(f"{bug.name:28s} {mark:7s} {dt:7.1f} s  {test}", flush=True)
    n = sum(r["caught"] for r in results)
    print(f"caught {n} of {len(results)} planted bugs ({a.rev or 'working tree'})")
    doc = {"rev": a.rev or "working tree", "results": results, "caught": n, "total": len(results)}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
