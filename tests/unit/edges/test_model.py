"""MindSpore's Model (mshard._src.edges.model) with its callbacks and metrics: training in data_parallel over 8
devices equals the same training written by hand on one device; LossMonitor, ModelCheckpoint, request_stop,
predict, eval and the argument errors.

Tolerance (test_train_data_parallel_matches_one_device): float32; the 8 replicas' gradients are averaged in another
order than one device's batch sums (16-row batches, 4/16-term dot products): ~1e-7 relative per op, compounded over
4 SGD-with-momentum steps (lr 0.1); measured <= 6e-8 absolute on parameters of size ~0.1-1. rtol=1e-5, and
atol=1e-6 for entries near 0 (a gradient summed instead of averaged over the replicas moves them by ~0.1).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mshard as ms
from mshard import nn
from mshard._src.edges.callbacks import Callback, CheckpointConfig, LossMonitor, ModelCheckpoint, TimeMonitor
from mshard._src.edges.metrics import Accuracy, Loss
from mshard._src.edges.model import Model
from mshard._src.runtime.data_sources import NumpySlicesDataset
from mshard._src.values.errors import CellError, CellTypeError, CheckpointTypeError, DatasetStrategyError

RTOL, ATOL = 1e-5, 1e-6
LR, MOMENTUM = 0.1, 0.9


class MLP(nn.Cell):
    def __init__(self, seed=0, dropout=0.0):
        rngs = nnx.Rngs(seed)
        self.fc1 = nn.Dense(4, 16, activation="relu", rngs=rngs)
        self.fc2 = nn.Dense(16, 2, rngs=rngs)
        self.drop = nn.Dropout(p=dropout, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(self.fc1(x)))


def data(rows=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 4)).astype(np.float32), rng.normal(size=(rows, 2)).astype(np.float32)


def dataset(rows=32, batch=16, seed=0):
    x, y = data(rows, seed)
    return NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False).batch(batch)


def params(net):
    return nnx.to_pure_dict(nnx.state(net, nnx.Param))


class Record(Callback):
    """Every stage called and every step's loss."""

    def __init__(self, stop_at=None):
        self.calls, self.losses, self.stop_at = [], [], stop_at

    def on_train_begin(self, rc):
        self.calls.append("begin")

    def on_train_epoch_begin(self, rc):
        self.calls.append(f"epoch_begin {rc.original_args().cur_epoch_num}")

    def on_train_step_end(self, rc):
        p = rc.original_args()
        self.losses.append(float(p.net_outputs))
        self.calls.append(f"step {p.cur_step_num}")
        if p.cur_step_num == self.stop_at:
            rc.request_stop()

    def on_train_epoch_end(self, rc):
        self.calls.append(f"epoch_end {rc.original_args().cur_epoch_num}")

    def on_train_end(self, rc):
        self.calls.append("end")


def reference_training(init, batches, epochs):
    """One device, by hand: relu(x W1^T + b1) W2^T + b2, mean squared error, jax.grad, SGD with momentum
    (optax.sgd's rule: trace = g + momentum * trace; p -= lr * trace)."""
    dev = jax.devices()[0]
    p = jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), dev), init)
    trace = jax.tree.map(jnp.zeros_like, p)

    def loss_fn(p, x, y):
        h = jax.nn.relu(x @ p["fc1"]["weight"].T + p["fc1"]["bias"])
        return jnp.mean((h @ p["fc2"]["weight"].T + p["fc2"]["bias"] - y) ** 2)

    @jax.jit
    def step(p, trace, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        trace = jax.tree.map(lambda t, gi: gi + MOMENTUM * t, trace, g)
        return jax.tree.map(lambda w, t: w - LR * t, p, trace), trace, loss

    losses = []
    for _ in range(epochs):
        for x, y in batches:
            p, trace, loss = step(p, trace, jax.device_put(x, dev), jax.device_put(y, dev))
            losses.append(float(loss))
    return p, trace, losses


def test_train_data_parallel_matches_one_device():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    net = MLP()
    init = jax.tree.map(np.asarray, params(net))
    x, y = data()
    ref, ref_trace, ref_losses = reference_training(init, [(x[:16], y[:16]), (x[16:], y[16:])], epochs=2)
    rec = Record()
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=optax.sgd(LR, momentum=MOMENTUM))
    model.train(2, dataset(), callbacks=[rec])

    assert rec.calls == ["begin", "epoch_begin 1", "step 1", "step 2", "epoch_end 1",
                         "epoch_begin 2", "step 3", "step 4", "epoch_end 2", "end"]
    np.testing.assert_allclose(rec.losses, ref_losses, rtol=RTOL)
    got, want = jax.tree.leaves_with_path(params(net)), jax.tree.leaves_with_path(ref)
    assert len(got) == len(want) == 4
    for (path, a), (ref_path, b) in zip(got, want, strict=True):
        assert path == ref_path
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL, err_msg=str(path))
    # the optimizer state: the momentum trace of every parameter (WithLossCell adds a "backbone" level)
    trace = model.train_network.opt_state[0].trace["backbone"]
    got, want = jax.tree.leaves_with_path(trace), jax.tree.leaves_with_path(ref_trace)
    assert len(got) == len(want) == 4
    for (path, a), (ref_path, b) in zip(got, want, strict=True):
        assert path == ref_path
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL, err_msg=str(path))
    assert int(model.train_network.optimizer.step[...]) == 4
    assert len(net.fc1.weight[...].sharding.device_set) == 8


def test_loss_monitor_prints_each_steps_loss(capsys):
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    rec = Record()
    Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(2, dataset(), callbacks=[rec, LossMonitor()])
    lines = capsys.readouterr().out.splitlines()
    assert len(rec.losses) == 4
    assert lines == [f"epoch: {e} step: {s}, loss is {loss}"
                     for (e, s), loss in zip([(1, 1), (1, 2), (2, 1), (2, 2)], rec.losses, strict=True)]
    Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(2, dataset(), callbacks=[LossMonitor(per_print_times=3),
                                                                            TimeMonitor()])
    out = capsys.readouterr().out.splitlines()
    timing = r"Train epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms"
    assert len(out) == 3 and out[1].startswith("epoch: 2 step: 1, loss is ")   # step 3 of 4, printed every 3
    assert re.fullmatch(timing, out[0]) and re.fullmatch(timing, out[2])


def test_model_checkpoint_saves_checkpoints_load_checkpoint_reads(tmp_path):
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    net = MLP()
    cfg = CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=2, integrated_save=False,
                           append_info=["epoch_num", "step_num", {"run": "a"}])
    ckpt = ModelCheckpoint(prefix="mlp", directory=tmp_path, config=cfg)
    Model(net, nn.MSELoss(), optax.sgd(LR)).train(3, dataset(rows=48), callbacks=[ckpt])   # 9 steps
    assert ckpt.latest_ckpt_file_name == str(tmp_path / "mlp")
    mgr = ms.CheckpointManager(ckpt.latest_ckpt_file_name)
    assert mgr.all_steps() == [8, 9]                     # saved at 4 and 8, and the last step at the end; keep 2
    fresh = MLP(seed=1)
    result = ms.load_checkpoint(ckpt.latest_ckpt_file_name, fresh)
    assert result.step == 9 and result.metadata == {"run": "a", "epoch_num": 3, "step_num": 9}
    for a, b in zip(jax.tree.leaves(params(fresh)), jax.tree.leaves(params(net)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a second run into the same directory and prefix goes to mlp_1, as MindSpore renames its files
    again = ModelCheckpoint(prefix="mlp", directory=tmp_path, config=CheckpointConfig(save_checkpoint_steps=2))
    Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(1, dataset(), callbacks=again)
    assert again.latest_ckpt_file_name == str(tmp_path / "mlp_1")
    assert ms.CheckpointManager(again.latest_ckpt_file_name).all_steps() == [2]


def test_request_stop_ends_training_after_the_step():
    rec = Record(stop_at=3)
    model = Model(MLP(), nn.MSELoss(), optax.sgd(LR))
    model.train(3, dataset(), callbacks=[rec])
    assert rec.calls == ["begin", "epoch_begin 1", "step 1", "step 2", "epoch_end 1",
                         "epoch_begin 2", "step 3", "epoch_end 2", "end"]
    assert int(model.train_network.optimizer.step[...]) == 3


def test_sink_size_makes_an_epoch_that_many_steps_going_on_through_the_data():
    seen = []

    class Rows(Callback):
        def step_begin(self, rc):
            seen.append(float(rc.original_args().train_dataset_element[0][0, 0]))

    x, _ = data(48)
    model = Model(MLP(), nn.MSELoss(), optax.sgd(LR))
    model.train(2, dataset(rows=48), callbacks=Rows(), dataset_sink_mode=True, sink_size=4)
    assert int(model.train_network.optimizer.step[...]) == 8
    assert seen == [float(x[r, 0]) for r in (0, 16, 32, 0, 16, 32, 0, 16)]


def test_predict_is_the_networks_output_in_inference_mode():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    net = MLP(dropout=0.5)
    x, _ = data(16)
    out = Model(net).predict(x)
    assert net.drop.deterministic is False               # the mode is restored after the call
    net.set_train(False)
    want = net(jnp.asarray(x))
    net.set_train(True)
    # float32: the same 4/16-term dot products, planned over 8 devices (rows split): equal up to reassociation
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=RTOL, atol=ATOL)
    assert Model(net).infer_predict_layout(x)["fc1.weight"].spec == jax.sharding.PartitionSpec(None, None)


def test_eval_returns_every_metric():
    net = nn.Dense(2, 2, weight_init="ones", bias_init="zeros")
    x = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 2.0]], np.float32)
    x[:, 0] += 1e-3                                      # the argmax is class 0 for every row
    y = np.array([0, 1, 0, 0], np.int32)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    model = Model(net, loss, metrics={"accuracy": Accuracy(), "loss": Loss()})
    out = model.eval(NumpySlicesDataset((x, y), shuffle=False).batch(2))
    assert out["accuracy"] == 0.75
    assert out["loss"] == pytest.approx(np.log(2.0), rel=1e-3)
    assert model.eval([(x, y)])["accuracy"] == 0.75        # cleared between evals


@pytest.mark.parametrize("call, error, match", [
    (lambda: Model("net"), CellTypeError, "network must be a Cell or an nnx Module, got str"),
    (lambda: Model(MLP(), nn.MSELoss(), optax.sgd(LR), amp_level="O2"), CellError, "amp_level='O2' is not offered"),
    (lambda: Model(MLP(), metrics={"accuracy"}), CellError, "neither eval_network nor loss_fn"),
    (lambda: Model(MLP(), nn.MSELoss(), metrics={"f1"}), CellError, r"metrics names \['f1'\] are not offered"),
    (lambda: Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(0, dataset()), CellError, "epoch=0 must be an int >= 1"),
    (lambda: Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(1, dataset(), sink_size=0), CellError, "sink_size=0"),
    (lambda: Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(2, dataset(), initial_epoch=2), CellError,
     r"initial_epoch=2 must be an int in \[0, epoch\)"),
    (lambda: Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(1, dataset(), callbacks=[print]), CellTypeError,
     "callbacks holds"),
    (lambda: Model(MLP(), nn.MSELoss(), optax.sgd(LR)).train(2, iter([data(16)])), CellTypeError,
     "runs out after one epoch"),
    (lambda: Model(MLP()).eval(dataset()), CellError, "the Model has no metrics"),
    (lambda: ModelCheckpoint(prefix="a/b"), CheckpointTypeError, "prefix='a/b' must be a non-empty str"),
    (lambda: CheckpointConfig(save_checkpoint_seconds=60), CheckpointTypeError, "time-based checkpoints"),
    (lambda: LossMonitor(-1), CellError, "per_print_times=-1"),
])
def test_bad_arguments_name_the_parameter_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_batch_that_does_not_split_over_the_devices_says_drop_remainder():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    model = Model(MLP(), nn.MSELoss(), optax.sgd(LR))
    with pytest.raises(DatasetStrategyError, match=r"epoch 1 step 3: .*drop_remainder=True"):
        model.train(1, dataset(rows=36))
