"""Core behaviour of fit.py: the vendored-file run, golden numbers, the schedule, BatchNorm and
dropout, exact eval, 1 vs 8 devices, compile counts, the caller's state, data inputs, history
and learning-rate logging. Every fit call writes under pytest's tmp_path."""
import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from conftest import CNN, MLP, eval_step, flat, loss_fn, make_state

import fit as fit_module
from fit import TrainState, fit, lr_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIT_PY = os.path.join(REPO, "fit.py")


# ----------------------------------------------------------------------------------------------
# Helpers

def scalars(log_dir, tag):
    """[(step, value)] of one TensorBoard scalar tag in a run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def scalar_tags(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return set(acc.Tags()["scalars"])


def batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


class Vec(nn.Module):
    """A linear model on flat features, for regression-style synthetic data."""

    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(1)(x.reshape(x.shape[0], -1))


def mse_with_label_stats(out, y):
    """A loss whose metrics expose which examples a batch holds (labels are example ids)."""
    y = y.astype(jnp.float32)
    loss = jnp.mean(out[:, 0] ** 2)
    return loss, {"ymax": y.max(), "ysum": y.sum()}


def vec_state(tx=None, features=3):
    model = Vec()
    var = model.init(jax.random.key(0), np.zeros((1, features), np.float32), train=False)
    return TrainState.create(apply_fn=model.apply, params=var["params"], tx=tx or optax.sgd(0.01))


# ----------------------------------------------------------------------------------------------
# 1. The file alone in an empty folder

STANDALONE = r'''
import json, os, sys
import flax.linen as nn, jax, numpy as np, optax
import fit
from fit import TrainState, fit as run_fit

class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(2)(nn.relu(nn.Dense(16)(x)))

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype(np.float32)
y = (x.sum(1) > 0).astype(np.int32)
model = Net()
params = model.init(jax.random.key(0), x[:1], train=False)["params"]
state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

state, history = run_fit(state, (x, y), loss_fn=loss_fn, batch_size=32, num_epochs=3,
                         log_name="alone_copy")
print("RESULT " + json.dumps({"fit_file": os.path.abspath(fit.__file__), "loss": history["train/loss"],
                              "log_dir": history.log_dir, "ckpt_dir": history.ckpt_dir,
                              "devices": jax.device_count(), "nnx_imported": "flax.nnx" in sys.modules}))
'''


def _repo_outputs():
    """What this test's run could have written next to the repo's fit.py (only its own run
    name: other people's scripts may write their runs there meanwhile)."""
    found = {}
    for sub in ("logs", "checkpoints"):
        path = os.path.join(REPO, sub)
        found[sub] = sorted(d for d in os.listdir(path) if d.startswith("alone_copy")) if os.path.isdir(path) else []
    return found


def test_fit_py_alone_in_an_empty_folder(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(FIT_PY, project / "fit.py")
    (project / "train.py").write_text(STANDALONE)
    before = _repo_outputs()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "train.py"], cwd=project, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(line[-1][len("RESULT "):])
    assert result["fit_file"] == str(project / "fit.py")  # the copy, not the repo's file
    assert result["devices"] == 1
    assert not result["nnx_imported"]  # a linen run does not pay flax.nnx's import (~9 MB, ~0.3 s)
    losses = result["loss"]
    assert len(losses) == 3
    assert losses[-1] < 0.7 * losses[0], losses
    # The workdir defaults to the current directory.
    assert result["log_dir"] == str(project / "logs" / "alone_copy_1")
    assert result["ckpt_dir"] == str(project / "checkpoints" / "alone_copy_1")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(project / "logs" / "alone_copy_1"))
    steps = [d for d in os.listdir(project / "checkpoints" / "alone_copy_1") if d.isdigit()]
    assert steps == ["24"], steps  # 256 / 32 = 8 steps per epoch, 3 epochs; only the last kept
    assert sorted(os.listdir(project)) == ["checkpoints", "fit.py", "logs", "train.py"] or \
        sorted(os.listdir(project)) == ["__pycache__", "checkpoints", "fit.py", "logs", "train.py"]
    assert _repo_outputs() == before, "fit wrote next to the repo's fit.py instead of the cwd"


# ----------------------------------------------------------------------------------------------
# 2. One-step golden metrics

GOLDEN_LOSS = 2.310037136077881       # MLP(seed 0), default_rng(0) batch of 16, step 0
GOLDEN_ACCURACY = 0.125


def golden_batch():
    rng = np.random.default_rng(0)
    x = rng.random((16, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    return x, y


def test_one_step_golden_metrics(tmp_path, one_device_mesh):
    x, y = golden_batch()
    state0 = make_state(MLP(), optax.sgd(0.1), seed=0)
    state, history = fit(state0, [(x, y)], loss_fn=loss_fn, num_epochs=1, log_every=1,
                         mesh=one_device_mesh, workdir=str(tmp_path))
    got = history["train/loss"][0]
    assert abs(got - GOLDEN_LOSS) < 1e-5, (
        f"the one-step loss is {got!r}, the golden value is {GOLDEN_LOSS!r}; if this change was "
        f"intended, update the golden value (GOLDEN_LOSS in tests/test_core.py)")
    assert abs(history["train/accuracy"][0] - GOLDEN_ACCURACY) < 1e-6, (
        f"the one-step accuracy is {history['train/accuracy'][0]!r}, the golden value is "
        f"{GOLDEN_ACCURACY!r}; if this change was intended, update the golden value")
    # The logged loss is the loss at the initial params (before the update) ...
    def loss_at(params):
        return loss_fn(state0.apply_fn({"params": params}, x, train=True), y)[0]
    hand, grads = jax.value_and_grad(loss_at)(state0.params)
    assert abs(got - float(hand)) < 1e-6
    # ... and the update is one plain SGD step.
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, state0.params, grads)
    np.testing.assert_allclose(flat(state.params), flat(expected), atol=1e-6)
    assert int(state.step) == 1
    assert float(loss_at(state.params)) < got
    # TensorBoard has the same number at step 1 (the step count after the update).
    assert [(s, round(v, 5)) for s, v in scalars(history.log_dir, "train/loss")] == [(1, round(got, 5))]


# ----------------------------------------------------------------------------------------------
# 3. lr_schedule

def test_lr_schedule_values():
    base, init, end = 0.1, 0.01, 1e-5
    spe, epochs = 11, 4                     # 44 steps; warmup 11; cosine over steps 11..43
    sched = lr_schedule(base, spe, epochs, warmup_epochs=1, init_value=init, end_value=end)
    np.testing.assert_allclose(float(sched(0)), init, rtol=1e-6)
    np.testing.assert_allclose(float(sched(5)), init + (base - init) * 5 / 11, rtol=1e-5)
    np.testing.assert_allclose(float(sched(11)), base, rtol=1e-6)   # end of warmup
    np.testing.assert_allclose(float(sched(11 + 16)), (base + end) / 2, rtol=1e-5)  # cosine middle
    np.testing.assert_allclose(float(sched(43)), end, rtol=1e-4)    # the last step: exactly end
    assert float(sched(42)) > end * 1.5
    values = [float(sched(i)) for i in range(44)]
    assert all(a <= b for a, b in zip(values[:11], values[1:12]))   # rising during warmup
    assert all(a >= b for a, b in zip(values[11:-1], values[12:]))  # falling after
    # Default end_value is 0, reached at the last step.
    assert abs(float(lr_schedule(0.1, 10, 3)(29))) < 1e-9
    assert float(lr_schedule(0.1, 10, 3)(28)) > 0


def test_lr_schedule_without_warmup_starts_at_base():
    sched = lr_schedule(0.5, 10, 2, warmup_epochs=0, end_value=0.05)
    np.testing.assert_allclose(float(sched(0)), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(sched(19)), 0.05, rtol=1e-5)


@pytest.mark.parametrize("warmup", [4, 5])
def test_lr_schedule_warmup_not_shorter_than_epochs(warmup):
    with pytest.raises(ValueError, match=rf"warmup_epochs={warmup}\b.*epochs=4\b"):
        lr_schedule(0.1, 10, 4, warmup_epochs=warmup)


# ----------------------------------------------------------------------------------------------
# 4. BatchNorm statistics and dropout

def test_batch_stats_train_and_are_used_in_eval(digits, tmp_path, one_device_mesh):
    x, y, xt, yt = digits
    x, y, xt, yt = x[:256], y[:256], xt[:64], yt[:64]
    state0 = make_state(CNN(), optax.adam(1e-2))
    state, history = fit(state0, (x, y), (xt, yt), loss_fn=loss_fn, batch_size=64, num_epochs=2,
                         mesh=one_device_mesh, workdir=str(tmp_path))
    init_bs, bs = flat(state0.batch_stats), flat(state.batch_stats)
    assert bs.shape == init_bs.shape
    assert np.abs(bs - init_bs).max() > 1e-2, "batch_stats did not change during training"

    def eval_loss(batch_stats):
        logits = state.apply_fn({"params": state.params, "batch_stats": batch_stats}, xt, train=False)
        return float(loss_fn(logits, yt)[0])
    # The default eval (no eval_step) runs in inference mode with the trained statistics.
    np.testing.assert_allclose(history["eval/loss"][-1], eval_loss(state.batch_stats), rtol=1e-5)
    assert abs(eval_loss(state0.batch_stats) - eval_loss(state.batch_stats)) > 1e-3
    train_mode = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, xt,
                                train=True, mutable=["batch_stats"], rngs={"dropout": jax.random.key(1)})[0]
    assert abs(float(loss_fn(train_mode, yt)[0]) - history["eval/loss"][-1]) > 1e-4


def test_batch_stats_reach_a_custom_eval_step(digits, tmp_path, one_device_mesh):
    x, y, xt, yt = digits
    x, y, xt, yt = x[:256], y[:256], xt[:64], yt[:64]

    def bs_eval(state, batch):  # logs the running mean it was given
        leaf = jax.tree.leaves(state.batch_stats["BatchNorm_0"]["mean"])[0]
        return {"bs_mean_sum": leaf.sum()}

    state, history = fit(make_state(CNN(), optax.adam(1e-2)), (x, y), (xt, yt), loss_fn=loss_fn,
                         eval_step=bs_eval, batch_size=64, num_epochs=1, mesh=one_device_mesh,
                         mode="max", workdir=str(tmp_path))  # (no direction in the name: say it)
    expected = float(np.asarray(state.batch_stats["BatchNorm_0"]["mean"]).sum())
    assert abs(expected) > 1e-3  # initial running mean is all zeros
    np.testing.assert_allclose(history["eval/bs_mean_sum"][-1], expected, rtol=1e-5)


class DropoutProbe(nn.Module):
    """Outputs Dropout(0.5) applied to ones (times a parameter that SGD(0) leaves at 1)."""

    @nn.compact
    def __call__(self, x, train):
        w = self.param("w", nn.initializers.ones, (16,))
        return nn.Dropout(0.5, deterministic=not train)(jnp.ones((x.shape[0], 16))) * w


def mask_code(out, y):
    """The dropout mask of example 0 as an integer (exact in float32), plus a dummy loss."""
    bits = (out[0] != 0).astype(jnp.float32)
    return jnp.mean(out) * 0.0, {"mask": (bits * 2.0 ** jnp.arange(16)).sum()}


def test_dropout_mask_differs_per_step_and_uses_fold_in(tmp_path, one_device_mesh):
    model = DropoutProbe()
    x = np.zeros((4, 3), np.float32)
    y = np.zeros((4,), np.int32)
    params = model.init(jax.random.key(0), x, train=False)["params"]
    state0 = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0))
    # One batch per epoch: the per-epoch means in history are the per-step values.
    state, history = fit(state0, [(x, y)], loss_fn=mask_code, num_epochs=5, seed=3,
                         mesh=one_device_mesh, workdir=str(tmp_path))
    masks = history["train/mask"]
    assert len(masks) == 5
    assert len(set(masks)) == 5, f"dropout masks repeat across steps: {masks}"
    # The documented contract: step n draws its dropout key as fold_in(key(seed), n).
    for n, got in enumerate(masks):
        out = model.apply({"params": params}, x, train=True,
                          rngs={"dropout": jax.random.fold_in(jax.random.key(3), n)})
        assert got == float(mask_code(out, y)[1]["mask"]), f"step {n}"
    np.testing.assert_array_equal(np.asarray(state.rng), np.asarray(jax.random.key_data(jax.random.key(3))))


# ----------------------------------------------------------------------------------------------
# 5. Exact eval with a smaller last batch

def acc_and_loss(state, batch):
    x, y = batch
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, x, train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return {"accuracy": (logits.argmax(-1) == y).mean(), "loss": loss}


@pytest.mark.parametrize("devices", [1, 8])
def test_eval_is_exact_with_a_small_last_batch(digits, tmp_path, devices, one_device_mesh,
                                               eight_device_mesh):
    x, y, xt, yt = digits
    assert len(xt) == 357
    test_batches = batches(xt, yt, 32)
    assert len(test_batches) == 12 and len(test_batches[-1][0]) == 5
    mesh = one_device_mesh if devices == 1 else eight_device_mesh
    state, history = fit(make_state(CNN(), optax.adam(3e-3)), (x[:512], y[:512]), test_batches,
                         loss_fn=loss_fn, eval_step=acc_and_loss, batch_size=64, num_epochs=1,
                         mesh=mesh, workdir=str(tmp_path))
    whole = jax.device_get(acc_and_loss(state, (xt, yt)))
    assert 0.3 < whole["accuracy"] < 1.0  # trained a bit, so batches disagree
    np.testing.assert_allclose(history["eval/accuracy"][-1], whole["accuracy"], atol=1e-6)
    np.testing.assert_allclose(history["eval/loss"][-1], whole["loss"], rtol=1e-5)
    # A plain mean of batch means would be measurably off: the test can tell the two apart.
    naive = np.mean([float(acc_and_loss(state, b)["loss"]) for b in test_batches])
    assert abs(naive - float(whole["loss"])) > 1e-4


# ----------------------------------------------------------------------------------------------
# 6. One device and eight devices train the same model

def test_one_and_eight_devices_agree(digits, tmp_path, one_device_mesh, eight_device_mesh):
    x, y, _, _ = digits
    x, y = x[:516], y[:516]  # 8 batches of 64 and a last one of 4 (< 8 devices: run whole)
    out = {}
    for name, mesh in (("one", one_device_mesh), ("eight", eight_device_mesh)):
        state, history = fit(make_state(CNN(), optax.sgd(0.1)), (x, y), loss_fn=loss_fn,
                             batch_size=64, num_epochs=2, mesh=mesh, workdir=str(tmp_path / name))
        out[name] = (state, history)
    (s1, h1), (s8, h8) = out["one"], out["eight"]
    assert int(s1.step) == int(s8.step) == 18
    assert np.abs(flat(s1.params) - flat(make_state(CNN()).params)).max() > 1e-2  # it trained
    np.testing.assert_allclose(flat(s8.params), flat(s1.params), atol=1e-5)
    np.testing.assert_allclose(flat(s8.batch_stats), flat(s1.batch_stats), atol=1e-5)
    np.testing.assert_allclose(h8["train/loss"], h1["train/loss"], rtol=1e-5)
    assert len(s8.params["Dense_0"]["kernel"].sharding.device_set) == 8


# ----------------------------------------------------------------------------------------------
# 7. Compile count

def test_one_compile_per_batch_shape(digits, tmp_path, one_device_mesh, compile_log):
    x, y, _, _ = digits          # 1440 = 22 * 64 + 32: two batch shapes
    traces = []

    def counting_loss(logits, labels):
        traces.append(logits.shape[0])
        return loss_fn(logits, labels)

    state, history = fit(make_state(MLP()), (x, y), loss_fn=counting_loss, batch_size=64,
                         num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path))
    assert history["step"] == [23, 46]
    assert compile_log.count() == 2, compile_log.shapes()
    # One trace per batch shape: the compile of the first shape reuses the shape-only trace
    # (jax.eval_shape) that fit makes to learn the metric names.
    assert traces == [64, 32], traces


def test_a_run_compiles_its_steps_and_no_eager_op(digits, tmp_path, one_device_mesh, compile_log):
    # Each eager jnp op compiles once per new shape (20-50 ms on CPU): the accumulators' zeros
    # are made in numpy. Caches are cleared so that an op compiled by an earlier test cannot hide.
    x, y, xt, yt = digits
    state = make_state(MLP())
    jax.clear_caches()
    jax.random.key(0)  # fit seeds its rng this way: what that compiles is jax's, not fit's
    start = len(compile_log.messages)
    fit(state, (x[:256], y[:256]), (xt[:64], yt[:64]), loss_fn=loss_fn, eval_step=eval_step,
        batch_size=64, num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path))
    compiled = [re.match(r"Compiling jit\((\w+)\)", m).group(1)
                for m in compile_log.messages[start:] if m.startswith("Compiling")]
    # (_param_norm: the check of the state before each save, #16. It compiles with the first
    # step, inside the compile's timing, not at the first save, where the steady rate counted it;
    # since #41 it is lowered first and compiles in a thread beside the step's compile.)
    assert compiled == ["_param_norm", "_train_and_accumulate", "_eval_and_accumulate"], compiled


def test_resume_compiles_once_per_shape(digits, tmp_path, one_device_mesh, compile_log):
    x, y, _, _ = digits
    kwargs = dict(loss_fn=loss_fn, batch_size=64, mesh=one_device_mesh, workdir=str(tmp_path))
    _, h1 = fit(make_state(MLP()), (x, y), num_epochs=1, **kwargs)
    assert compile_log.count() == 2, compile_log.shapes()
    state, h2 = fit(make_state(MLP()), (x, y), num_epochs=2, resume=True, **kwargs)
    assert h2.run == h1.run and h2["step"] == [23, 46]
    assert int(state.step) == 46
    assert compile_log.count() == 4, (
        "the resumed run must compile the train step once per batch shape (2), not again for a "
        "restored state with other dtypes/weak types:\n" + "\n".join(compile_log.shapes()))


def test_timing_leaves_compiles_saves_and_the_last_commit_out_of_the_rate(tmp_path, one_device_mesh):
    x = np.random.default_rng(0).random((256, 8, 8, 1), np.float32)
    _, h = fit(make_state(MLP()), (x, np.zeros(256, np.int32)), loss_fn=loss_fn, batch_size=64,
               num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path))
    t = h.timing
    counts = ("steps", "compile_count", "eval_count", "save_count", "finish_count")
    # One save: checkpoints come on a wall-time schedule (ckpt_interval), when the monitored
    # value enters the kept best, and at the end; a run without a test set or monitor= keeps no
    # best (#48), so this 2-epoch run saves at its end alone.
    assert tuple(t[k] for k in counts) == (8, 1, 0, 1, 1), t
    assert t["finish_s"] > 0  # waiting for the last checkpoint's commit, once, at the end
    left_out = t["compile_s"] + t["eval_s"] + t["save_s"] + t["finish_s"] + t["close_s"]
    assert t["steady_steps_per_s"] == pytest.approx(7 / (t["wall_s"] - left_out), rel=0.05), t


# ----------------------------------------------------------------------------------------------
# 8. The caller's state survives fit

@pytest.mark.parametrize("devices", [1, 8])
def test_callers_state_survives_and_refit_is_deterministic(digits, tmp_path, devices,
                                                           one_device_mesh, eight_device_mesh):
    x, y, _, _ = digits
    x, y = x[:256], y[:256]
    mesh = one_device_mesh if devices == 1 else eight_device_mesh
    state0 = make_state(CNN(), optax.adam(1e-2))
    before = flat((state0.params, state0.batch_stats, state0.opt_state))
    results = []
    for i in range(2):
        state, history = fit(state0, (x, y), loss_fn=loss_fn, batch_size=64, num_epochs=1,
                             mesh=mesh, workdir=str(tmp_path / str(i)))
        results.append((flat((state.params, state.batch_stats)), history["train/loss"]))
        # Not deleted (donation) and not changed.
        np.testing.assert_array_equal(flat((state0.params, state0.batch_stats, state0.opt_state)), before)
        assert int(state0.step) == 0
    assert np.abs(results[0][0] - before[:results[0][0].size]).max() > 1e-3  # it did train
    np.testing.assert_allclose(results[1][0], results[0][0], atol=1e-7)
    assert results[1][1] == results[0][1]
    # The caller's state still works with the model.
    out = state0.apply_fn({"params": state0.params, "batch_stats": state0.batch_stats}, x[:4], train=False)
    assert out.shape == (4, 10)


@pytest.mark.parametrize("devices", [1, 8])
def test_placing_the_state_copies_every_leaf_without_compiling(devices, one_device_mesh,
                                                                 eight_device_mesh, compile_log):
    # fit's private copy of the state comes from the transfer itself: a jnp copy first compiled
    # an eager op per leaf shape (~13 MB more peak memory on a small CNN). Shapes no other test
    # uses, so a compile could not hide in jax's cache.
    mesh = one_device_mesh if devices == 1 else eight_device_mesh
    params = {"w": jnp.ones((37, 53)), "b": np.zeros(41, np.float32)}
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    placed = fit_module._place_state(state, 0, NamedSharding(mesh, P()))
    compiled = [m for m in compile_log.messages if m.startswith("Compiling") and
                ("37,53" in m or "[41]" in m)]
    if devices == 1:  # (onto 8, device_put reuses the caller's buffers: fit copies those again)
        assert not compiled, compiled
    # Every leaf is a strong-typed copy on every device of the mesh, sharing no buffer with the
    # caller's, which donation would delete.
    buffers = lambda x: {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    parts = lambda s: jax.tree.leaves((s.step, s.params, s.opt_state))
    for mine, theirs in zip(parts(placed), parts(state), strict=True):
        assert len(mine.addressable_shards) == devices and not mine.weak_type
        if isinstance(theirs, jax.Array):
            assert not buffers(mine) & buffers(theirs)
    assert placed.step.dtype == jnp.int32 and placed.rng.dtype == jnp.uint32


# ----------------------------------------------------------------------------------------------
# 9. Data inputs

def id_data(n=64):
    """Inputs are zeros; labels are example ids, so metrics reveal which examples a batch holds."""
    return np.zeros((n, 3), np.float32), np.arange(n, dtype=np.int32)


def test_arrays_are_shuffled_per_epoch_from_seed(tmp_path, one_device_mesh):
    x, y = id_data(64)
    kwargs = dict(loss_fn=mse_with_label_stats, batch_size=8, num_epochs=2, log_every=1,
                  mesh=one_device_mesh)

    def batch_sums(name, **kw):
        """Per step, the sum of the example ids in the batch (from TensorBoard), per epoch."""
        _, h = fit(vec_state(), (x, y), workdir=str(tmp_path / name), **kwargs, **kw)
        logged = scalars(h.log_dir, "train/ysum")
        assert [s for s, _ in logged] == list(range(1, 17))
        return h, [[v for _, v in logged[:8]], [v for _, v in logged[8:]]]

    h, sums = batch_sums("a")
    _, same = batch_sums("b")
    _, other = batch_sums("c", seed=1)
    # Every example exactly once per epoch: the batch sums add up to sum(0..63).
    assert [sum(e) for e in sums] == [2016, 2016]
    np.testing.assert_allclose(h["train/ysum"], [2016 / 8] * 2)
    unshuffled = [sum(range(8 * i, 8 * i + 8)) for i in range(8)]
    assert sums[0] != unshuffled and sums[1] != unshuffled, "arrays were not shuffled"
    assert sums[0] != sums[1], "both epochs saw the same batches in the same order"
    assert sorted(sums[0]) != sorted(sums[1]), "both epochs grouped the examples the same way"
    assert same == sums, "the same seed must give the same order"
    assert other[0] != sums[0] and other[1] != sums[1], "another seed must give another order"


def _train_params(tmp_path, data, name, **kw):
    state, history = fit(vec_state(), data, loss_fn=mse_with_label_stats, num_epochs=1,
                         workdir=str(tmp_path / name), **kw)
    return flat(state.params), history


def test_list_generator_dict_and_array_like_batches_agree(tmp_path, one_device_mesh):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = np.arange(40, dtype=np.int32)
    listed = batches(x, y, 16)  # 16, 16, 8
    ref, h = _train_params(tmp_path, listed, "list", mesh=one_device_mesh)
    assert h["step"] == [3]
    np.testing.assert_allclose(h["train/ysum"], [np.mean([120, 376, 284])])
    assert np.abs(ref - flat(vec_state().params)).max() > 1e-4

    gen, hg = _train_params(tmp_path, (b for b in listed), "gen", mesh=one_device_mesh)
    np.testing.assert_allclose(gen, ref, atol=1e-7)
    assert hg["step"] == [3]

    dicts = [{"image": a, "label": b} for a, b in listed]
    dict_params, _ = _train_params(tmp_path, dicts, "dict", batch_keys=("image", "label"),
                                   mesh=one_device_mesh)
    np.testing.assert_allclose(dict_params, ref, atol=1e-7)

    class Tensor:  # torch-like: not a numpy array, but converts with __array__
        def __init__(self, a):
            self._a = a

        def __array__(self, dtype=None, copy=None):
            return self._a if dtype is None else self._a.astype(dtype)

    tensors = [(Tensor(a), Tensor(b)) for a, b in listed]
    tensor_params, _ = _train_params(tmp_path, tensors, "tensor", mesh=one_device_mesh)
    np.testing.assert_allclose(tensor_params, ref, atol=1e-7)

    # On 8 devices too (16 shards evenly; the last batch of 8 too).
    eight, _ = _train_params(tmp_path, listed, "eight")
    np.testing.assert_allclose(eight, ref, atol=1e-6)


def test_a_generator_is_one_epoch(tmp_path, one_device_mesh):
    x, y = id_data(32)
    # Refused at the start, not at epoch 2: a generator can be read only once.
    with pytest.raises(ValueError, match=r"one-shot iterator.*num_epochs=2.*steps_per_epoch"):
        fit(vec_state(), (b for b in batches(x, y, 8)), loss_fn=mse_with_label_stats,
            num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path))


def test_dict_batches_without_batch_keys_raise(tmp_path, one_device_mesh):
    x, y = id_data(16)
    with pytest.raises(TypeError, match=r"batch_keys"):
        fit(vec_state(), [{"image": x, "label": y}], loss_fn=mse_with_label_stats,
            mesh=one_device_mesh, workdir=str(tmp_path))
    assert not os.listdir(tmp_path)  # refused before writing anything


def test_custom_train_step(tmp_path, one_device_mesh):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    t = rng.normal(size=(16,)).astype(np.float32)
    state0 = vec_state(optax.sgd(0.1))

    def my_step(state, batch):  # dict batches are fine: fit does not unpack them
        def loss_of(params):
            out = state.apply_fn({"params": params}, batch["x"], train=True)
            return jnp.mean((out[:, 0] - batch["t"]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "answer": jnp.float32(42.0)}

    state, history = fit(state0, [{"x": x, "t": t}], train_step=my_step, num_epochs=2,
                         mesh=one_device_mesh, workdir=str(tmp_path))
    assert history["train/answer"] == [42.0, 42.0]
    # Two hand-made SGD steps give the same params and losses.
    params, losses = state0.params, []
    for _ in range(2):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((state0.apply_fn({"params": p}, x, train=True)[:, 0] - t) ** 2))(params)
        losses.append(float(loss))
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    np.testing.assert_allclose(history["train/loss"], losses, rtol=1e-5)
    np.testing.assert_allclose(flat(state.params), flat(params), atol=1e-6)
    assert losses[1] < losses[0]


# ----------------------------------------------------------------------------------------------
# 10. Eval without eval_step, and no eval at all

def test_no_eval_without_test_ds(tmp_path, one_device_mesh):
    x, y = id_data(32)
    _, history = fit(vec_state(), (x, y), loss_fn=mse_with_label_stats, eval_step=None,
                     batch_size=8, num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path))
    assert not [k for k in history if k.startswith("eval/")], list(history)
    assert history["epoch"] == [1, 2]
    assert not [t for t in scalar_tags(history.log_dir) if t.startswith("eval/")]


def test_eval_without_eval_step_uses_loss_fn(digits, tmp_path):
    x, y, xt, yt = digits
    xt, yt = xt[:100], yt[:100]  # batches of 32: 32, 32, 32, 4 (< 8 devices)
    state, history = fit(make_state(MLP(), optax.adam(1e-2)), (x[:256], y[:256]), (xt, yt),
                         loss_fn=loss_fn, batch_size=32, num_epochs=2, workdir=str(tmp_path))
    assert sorted(k for k in history if k.startswith("eval/")) == [
        "eval/accuracy", "eval/epoch", "eval/loss", "eval/step"]
    logits = state.apply_fn({"params": state.params}, xt, train=False)
    loss, metrics = loss_fn(logits, yt)
    np.testing.assert_allclose(history["eval/loss"][-1], float(loss), rtol=1e-5)
    np.testing.assert_allclose(history["eval/accuracy"][-1], float(metrics["accuracy"]), atol=1e-6)
    assert history["eval/loss"][-1] < history["eval/loss"][0]


# ----------------------------------------------------------------------------------------------
# 11. History contents

def test_history_contents(digits, tmp_path, one_device_mesh):
    x, y, xt, yt = digits
    x, y = x[:128], y[:128]  # 4 steps of 32 per epoch
    state, history = fit(make_state(MLP(), optax.adam(1e-2)), (x, y), (xt[:64], yt[:64]),
                         loss_fn=loss_fn, eval_step=eval_step, batch_size=32, num_epochs=3,
                         eval_freq=2, log_every=1, mesh=one_device_mesh, workdir=str(tmp_path))
    assert history["epoch"] == [1, 2, 3]
    assert history["step"] == [4, 8, 12]
    assert history["eval/epoch"] == [2, 3]  # every 2nd epoch, and always the last
    assert history["eval/step"] == [8, 12]
    assert len(history["eval/accuracy"]) == 2
    assert "stopped" not in history
    assert {"epoch", "step", "train/loss", "train/accuracy", "eval/epoch", "eval/step",
            "eval/accuracy"} <= set(history)
    assert {k for k in history if k.startswith("eval/")} == {"eval/epoch", "eval/step", "eval/accuracy"}
    assert all(len(history[k]) == 3 for k in history if k.startswith("train/")), history
    assert history.run == "run_1"
    assert history.log_dir == str(tmp_path / "logs" / "run_1")
    assert history.ckpt_dir == str(tmp_path / "checkpoints" / "run_1")
    # train/<metric> per epoch is the mean of that epoch's steps (logged one by one to TensorBoard).
    per_step = scalars(history.log_dir, "train/loss")
    assert [s for s, _ in per_step] == list(range(1, 13))
    values = np.array([v for _, v in per_step])
    np.testing.assert_allclose(history["train/loss"], values.reshape(3, 4).mean(1), rtol=1e-5)
    assert history["train/loss"][2] < history["train/loss"][0]
    ev = scalars(history.log_dir, "eval/accuracy")
    assert [s for s, _ in ev] == [8, 12]
    np.testing.assert_allclose([v for _, v in ev], history["eval/accuracy"], rtol=1e-6)
    # The eval at the last epoch is of the returned state.
    direct = float(eval_step(state, (xt[:64], yt[:64])))
    np.testing.assert_allclose(history["eval/accuracy"][-1], direct, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# 12. Learning-rate logging

LR_SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 12)


@pytest.mark.parametrize("how", ["inject_hyperparams", "lr_fn"])
def test_logged_lr_is_the_schedule_of_the_step(digits, tmp_path, one_device_mesh, how):
    x, y, _, _ = digits
    if how == "inject_hyperparams":
        tx, kw = optax.inject_hyperparams(optax.adam)(learning_rate=LR_SCHEDULE), {}
    else:
        tx, kw = optax.adam(LR_SCHEDULE), {"lr_fn": LR_SCHEDULE}
    _, history = fit(make_state(MLP(), tx), (x[:128], y[:128]), loss_fn=loss_fn, batch_size=32,
                     num_epochs=3, log_every=3, mesh=one_device_mesh, workdir=str(tmp_path), **kw)
    logged = scalars(history.log_dir, "train/lr")
    # Log points: every 3rd step and every epoch end (step 4, 8, 12). The value at log step k is
    # the rate of the last step trained, whose state.step was k - 1.
    assert [s for s, _ in logged] == [3, 4, 6, 8, 9, 12]
    for s, v in logged:
        np.testing.assert_allclose(v, float(LR_SCHEDULE(s - 1)), rtol=1e-5, err_msg=f"step {s}")


def test_unknown_lr_is_not_logged_as_zero(tmp_path, one_device_mesh):
    x, y = id_data(32)
    _, history = fit(vec_state(optax.adam(1e-3)), (x, y), loss_fn=mse_with_label_stats,
                     batch_size=8, log_every=1, mesh=one_device_mesh, workdir=str(tmp_path))
    assert "train/loss" in scalar_tags(history.log_dir)
    assert scalars(history.log_dir, "train/lr") == [], scalars(history.log_dir, "train/lr")


def test_a_second_call_with_the_same_functions_compiles_nothing(digits, tmp_path, one_device_mesh,
                                                                 compile_log):
    # #16: a notebook cell run again (the same loss_fn, eval_step, apply_fn and optimizer, the
    # same shapes and mesh) reuses the first call's jitted steps, so JAX's cache serves them.
    x, y, xt, yt = digits
    model, tx = MLP(), optax.adam(1e-3)
    var = model.init(jax.random.key(0), x[:1], train=False)
    kwargs = dict(loss_fn=loss_fn, eval_step=eval_step, batch_size=64, num_epochs=1,
                  mesh=one_device_mesh, workdir=str(tmp_path))
    compiles = lambda: compile_log.count() + compile_log.count("_eval_and_accumulate")
    start = compiles()
    fit(TrainState.create(apply_fn=model.apply, params=var["params"], tx=tx),
        (x[:256], y[:256]), (xt[:64], yt[:64]), **kwargs)
    first = compiles() - start
    assert first >= 2, compile_log.shapes()  # the train step and the eval step
    state, history = fit(TrainState.create(apply_fn=model.apply, params=var["params"], tx=tx),
                         (x[:256], y[:256]), (xt[:64], yt[:64]), **kwargs)
    assert compiles() - start == first, compile_log.messages[-3:]
    assert int(state.step) == 4 and history["eval/accuracy"]
    # A new optimizer object is another static part of the state: it compiles again.
    fit(TrainState.create(apply_fn=model.apply, params=var["params"], tx=optax.adam(1e-3)),
        (x[:256], y[:256]), (xt[:64], yt[:64]), **kwargs)
    assert compiles() - start > first


def test_a_learning_rate_sweep_through_inject_hyperparams_compiles_once(digits, tmp_path,
                                                                        one_device_mesh,
                                                                        compile_log):
    # #16: the README's sweep. One optax object (tx is static: a new one compiles again), each
    # run with its own learning rate set in opt_state.hyperparams: only the first run compiles.
    x, y, _, _ = digits
    model = MLP()
    var = model.init(jax.random.key(0), x[:1], train=False)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    state0 = TrainState.create(apply_fn=model.apply, params=var["params"], tx=tx)
    start, counts, lrs = compile_log.count(), [], []
    for lr in (1e-2, 3e-3, 1e-3):
        hyperparams = {**state0.opt_state.hyperparams, "learning_rate": np.float32(lr)}
        state = state0.replace(opt_state=state0.opt_state._replace(hyperparams=hyperparams))
        seen = []
        fit(state, (x[:256], y[:256]), loss_fn=loss_fn, batch_size=64, log_every=2,
            mesh=one_device_mesh, workdir=str(tmp_path), log_name=f"lr{lr}",
            hooks=[lambda event, run: event == "log" and seen.append(run.metrics["train/lr"])])
        counts.append(compile_log.count() - start)
        lrs.append(seen[-1])
    assert counts[0] >= 1 and counts == [counts[0]] * 3, compile_log.shapes()
    np.testing.assert_allclose(lrs, [1e-2, 3e-3, 1e-3], rtol=1e-6)  # each run used its own
