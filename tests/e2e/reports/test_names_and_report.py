import jax
import jax.numpy as jnp
from flax import nnx

import mshard as ms
from mshard import nn, ops


class Net(nn.Cell):
    def __init__(self, rngs):
        self.dense1 = nn.Dense(8, 16, rngs=rngs)
        self.dense2 = nn.Dense(16, 8, rngs=rngs)
        self.mul = ops.Mul(name="scale")

    def __call__(self, x):
        with jax.named_scope("head"):
            y = self.dense2(jax.nn.relu(self.dense1(x)))
        y = self.mul(y, 2.0)
        return ops.ReLU()(ops.ReLU()(y))


def test_op_names_follow_scopes_cell_paths_and_name_argument():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    names = ms.jit(lambda n, x: n(x)).layouts(Net(nnx.Rngs(0)), jnp.ones((8, 8))).op_names
    assert list(names.values()) == ["head/dense1/MatMul", "head/dense1/BiasAdd", "head/dense2/MatMul",
                                    "head/dense2/BiasAdd", "scale/Mul", "ReLU", "ReLU_1"]


TUPLE_HLO = """
  %all-reduce.3 = (f32[16,32]{1,0}, f32[32]{0}, bf16[8]{0}) all-reduce(%a, %b, %c), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ag = f32[64,8]{1,0} all-gather(%p), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
  %ags = f32[64,8]{1,0} all-gather-start(%p), channel_id=5, replica_groups=mesh['x'=2,'y'=4] {'y'}, dimensions={0}
  %agd = f32[64,8]{1,0} all-gather-done(%ags)
  %rs = f32[4,8]{1,0} reduce-scatter(%q), channel_id=6, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
"""


def test_comm_report_parses_tuple_async_and_iota_forms():
    rep = ms.CommReport.from_hlo(TUPLE_HLO)
    assert rep.count("all-reduce") == 1                          # one combined (tuple-shaped) all-reduce
    assert rep.bytes("all-reduce") == 16 * 32 * 4 + 32 * 4 + 8 * 2
    assert rep.count("all-gather") == 2                           # the async pair counts once
    assert rep.bytes("all-gather") == 2 * 64 * 8 * 4
    assert [c.group_size for c in rep.collectives] == [8, 4, 4, 2]
    assert rep.moved("all-reduce") == rep.bytes("all-reduce") * 2 * 7 / 8
    assert rep.count("reduce-scatter") == 1 and rep.moved("reduce-scatter") == 4 * 8 * 4
    text = str(rep)
    assert "all-reduce" in text and "reduce-scatter" in text
    assert "<table>" in rep._repr_html_()


def test_comm_report_accepts_every_mshard_callable():
    ms.set_auto_parallel_context(parallel_mode="data_parallel")
    net = Net(nnx.Rngs(0))
    x = jnp.ones((8, 8))
    loss = ms.jit(lambda n, x: jnp.mean(nnx.grad(lambda n, x: jnp.sum(n(x)))(n, x)["dense1"]["weight"][...]))
    assert ms.comm_report(loss, net, x).count("all-reduce") >= 1       # data-parallel gradient reduction
    assert ms.comm_report(net, x).total_count == 0                      # forward of a replicated model on split data
    assert ms.comm_report(lambda x: x.sum(), x).count("all-reduce") == 1
    assert ms.comm_report(jax.jit(lambda x: x * 2), x).total_count == 0


def _compiles(f) -> int:
    """How many programs reach XLA's compile step while ``f()`` runs: backend compiles plus hits of the tests'
    persistent compilation cache (a hit is a compile request too)."""
    import jax.monitoring as mon
    seen = []

    def listen(event, duration, **kw):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            seen.append(event)
    mon.register_event_duration_secs_listener(listen)
    try:
        f()
    finally:
        mon.unregister_event_duration_listener(listen)
    return len(seen)


def test_comm_report_after_a_call_reads_the_program_the_call_compiled():
    """jax.jit compiles an uncommitted argument apart from a committed one; a region lowered on placeholders of the
    planned shardings compiled the whole program a second time for every comm_report after a training step. The
    uncommitted data a user passes, the step, then its report: the report compiles nothing (and reports the step's
    one data-parallel gradient reduction). A new input shape still compiles, so the count can see a compile."""
    import optax
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    net = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, lambda y, t: ((y - t) ** 2).mean()), optax.sgd(0.1))
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 16))
    assert not x.committed
    step(x, y)
    step(x, y)                                      # the fast path
    reports = []
    assert _compiles(lambda: reports.append(ms.comm_report(step, x, y))) == 0
    assert reports[0].count("all-reduce") >= 1
    region = ms.jit(lambda a: a * 2)
    region(x)
    assert _compiles(lambda: region.lower(x).compile()) == 0
    z = jnp.ones((16, 16))
    assert _compiles(lambda: region.lower(z).compile()) == 1


def test_collective_groups_match_the_mesh_axes_reduced_over():
    """``Collective.groups`` read from the compiled HLO (whatever replica_groups form XLA prints) are the device
    sets that differ only along the mesh axes a shard_map psum names; also the explicit and iota text forms."""
    import numpy as np
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    from jax.sharding import NamedSharding as NS
    for axes in (("a",), ("c",), ("b", "c"), ("a", "c")):
        psum = jax.jit(jax.shard_map(lambda x, axes=axes: jax.lax.psum(x, axes), mesh=mesh,
                                     in_specs=P(("a", "b", "c")), out_specs=P(("a", "b", "c"))))
        # the same reduction inserted by the SPMD partitioner (a matmul contracting a dim split over ``axes``)
        matmul = jax.jit(lambda x, w: x @ w, in_shardings=(NS(mesh, P(None, axes)), NS(mesh, P(axes, None))),
                         out_shardings=NS(mesh, P()))
        over = [mesh.axis_names.index(a) for a in axes]
        keep = [i for i in range(3) if i not in over]
        expect = {frozenset(int(x) for x in row) for row in ids.transpose(keep + over).reshape(-1, 2 ** len(over))}
        for f, args in ((psum, (jnp.ones(8),)), (matmul, (jnp.ones((8, 16)), jnp.ones((16, 4))))):
            (c,) = [c for c in ms.comm_report(f, *args).collectives if c.kind == "all-reduce"]
            assert {frozenset(g) for g in c.groups} == expect and c.group_size == 2 ** len(over)
    from mshard._src.edges.comm_report import Collective
    assert Collective("all-reduce", 4, 2, "y = f32[1] all-reduce(x), replica_groups={{0,2},{1,3}}").groups == \
        ((0, 2), (1, 3))
    assert Collective("all-reduce", 4, 4, "y = f32[1] all-reduce(x), replica_groups=[2,4]<=[8]").groups == \
        ((0, 1, 2, 3), (4, 5, 6, 7))
