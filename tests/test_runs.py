"""Whole runs: what a run leaves on disk (TensorBoard events, best/last checkpoints), how it is
restored (plain orbax, `load_ckpt`), and how it resumes (epoch boundary, SIGINT mid-epoch, crash).

The expensive runs are module-scoped fixtures that several tests read, so the file stays fast:
each `fit` call compiles its own step (~1-2 s on 2 CPU cores).
"""
import copy
import os
import signal
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import CNN, MLP, eval_step, loss_fn, make_state
from tensorboard.backend.event_processing import plugin_event_accumulator, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import metadata as hparams_metadata

import fit as fit_module
from fit import fit, load_ckpt

BATCH = 32
N_TRAIN = 256
SPE = N_TRAIN // BATCH  # 8 steps per epoch for the resume runs
LR = 1e-3
# Decays over 32 steps whatever num_epochs is, so a 2-epoch run resumed to 4 epochs and a 4-epoch
# run follow the same schedule; every step has its own rate, so train/lr's step can be checked.
SCHEDULE = optax.linear_schedule(LR, LR / 2, 32)
HPARAMS = {"lr": LR, "layers": [1, 2]}
ACCURACIES = [.9, .8, .7, .95, .6, .5]  # best (max) at epoch 4, last at epoch 6


# ----------------------------------------------------------------------------------------------
# Helpers

def ckpt_steps(ckpt_dir):
    """The committed checkpoint steps, read as orbax itself lists them and as directories."""
    dirs = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    mgr = ocp.CheckpointManager(ckpt_dir)
    try:
        assert sorted(mgr.all_steps()) == dirs, (mgr.all_steps(), dirs)
    finally:
        mgr.close()
    return dirs


def state_leaves(state):
    """Everything a run's result depends on: params, BatchNorm stats, optimizer state, step, rng."""
    return jax.tree.leaves(jax.device_get(
        (state.params, state.batch_stats, state.opt_state, state.step, state.rng)))


def assert_bitwise_equal(a, b):
    la, lb = state_leaves(a), state_leaves(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (i, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(x, y), f"leaf {i} differs: max |diff| {np.max(np.abs(x - y))}"


def params_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))))


def without_stopped(history):
    return {k: v for k, v in history.items() if k != "stopped"}


def assert_same_history(a, b):
    """Same keys, same epochs/steps, same values. Train metrics are compared to float32
    precision: they are per-epoch means of on-device float32 sums, and a run that is fetched at
    other points (a save, a stop) adds its float32 partial sums in another order (seen: 2.2716423571
    vs 2.2716423273 with default log_every, while the parameters were bitwise equal)."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        if k.startswith("train/"):
            assert a[k] == pytest.approx(b[k], rel=1e-6), k
        else:
            assert a[k] == b[k], k


def tb_scalars(log_dir, tag):
    """[(step, value)] of `tag` as TensorBoard's classic EventAccumulator shows it: it reads every
    event file of the run and honours SessionLog.START (purge_step) by dropping earlier-written
    events at steps >= the restart step."""
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def plugin_tb_steps(log_dir, tag):
    """The steps of `tag` as the plugin accumulator shows them: what `tensorboard
    --load_fast=false` and the HParams dashboard read. It ignores a run's first SessionLog.START
    and purges only on a later one."""
    acc = plugin_event_accumulator.EventAccumulator(log_dir, tensor_size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors(tag)] if tag in acc.Tags()["tensors"] else []


def raw_steps(log_dir, tag):
    """Every step written for `tag`, in file order, with nothing purged."""
    steps = []
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("events.out.tfevents"):
            for event in EventFileLoader(os.path.join(log_dir, name)).Load():
                if event.HasField("summary"):
                    steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


def small_digits(digits, n_train=N_TRAIN, n_test=64):
    x, y, xt, yt = digits
    return x[:n_train], y[:n_train], xt[:n_test], yt[:n_test]


def batch_list(x, y):
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


class Batches:
    """A re-iterable list of batches (len() works, each epoch iterates it again) that, when it
    hands out its `at`-th batch overall (counting from 1), either sends
    this process a SIGINT, as Ctrl-C would, or raises, as a crash would."""

    def __init__(self, batches, at, crash=False):
        self.batches, self.at, self.crash, self.count = batches, at, crash, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.count += 1
            if self.count == self.at:
                if self.crash:
                    raise RuntimeError("simulated crash")
                send_sigint()
            yield batch


def send_sigint():
    # Without fit's handler the SIGINT would interrupt pytest itself: fail loudly instead.
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler, \
        "fit installed no SIGINT handler"
    os.kill(os.getpid(), signal.SIGINT)


def stop_step(history):
    (reason,) = history["stopped"]
    assert reason.startswith("SIGINT at step "), reason
    return int(reason.rsplit(" ", 1)[1])


def adam():
    """Adam on SCHEDULE, injected so that fit can read the rate and log it as train/lr."""
    return optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)


def fixed_eval(accuracies, spe):
    """An eval_step whose accuracy after epoch e is accuracies[e - 1], whatever the params."""
    def step(state, batch):
        return jnp.asarray(accuracies, jnp.float32)[state.step // spe - 1]
    return step


# ----------------------------------------------------------------------------------------------
# Runs shared by several tests

@pytest.fixture(scope="module")
def boundary(digits, tmp_path_factory):
    """CNN (BatchNorm + Dropout) on 256 digits, 8 steps/epoch: an uninterrupted 4-epoch run, and
    a 2-epoch run resumed with num_epochs=4 (an interruption at an epoch boundary)."""
    x, y, xt, yt = small_digits(digits)
    full_dir, split_dir = (str(tmp_path_factory.mktemp(n)) for n in ("full", "split"))
    common = dict(loss_fn=loss_fn, eval_step=eval_step, batch_size=BATCH, log_every=4,
                  hparams=HPARAMS)
    full, full_h = fit(make_state(CNN(), adam()), (x, y), (xt, yt), num_epochs=4,
                       workdir=full_dir, **common)
    first, first_h = fit(make_state(CNN(), adam()), (x, y), (xt, yt), num_epochs=2,
                         workdir=split_dir, **common)
    first_h_copy = copy.deepcopy(dict(first_h))
    first_ckpts = ckpt_steps(first_h.ckpt_dir)
    resumed, resumed_h = fit(make_state(CNN(), adam()), (x, y), (xt, yt), num_epochs=4,
                             workdir=split_dir, resume=True, **common)
    return types.SimpleNamespace(
        full=full, full_h=full_h, full_dir=full_dir, first=first, first_h=first_h,
        first_h_copy=first_h_copy, first_ckpts=first_ckpts, resumed=resumed,
        resumed_h=resumed_h, split_dir=split_dir, data=(x, y, xt, yt))


@pytest.fixture(scope="module")
def best_last(digits, tmp_path_factory):
    """MLP, 64 examples (2 steps/epoch), 6 epochs, plain optax.adam, an eval_step reporting
    ACCURACIES: the best epoch is the 4th (step 8), the last the 6th (step 12)."""
    x, y, xt, yt = small_digits(digits, 64, 32)
    workdir = str(tmp_path_factory.mktemp("best_last"))
    state, history = fit(make_state(MLP()), (x, y), (xt, yt), loss_fn=loss_fn,
                         eval_step=fixed_eval(ACCURACIES, 2), batch_size=BATCH, num_epochs=6,
                         workdir=workdir)
    return types.SimpleNamespace(state=state, history=history, workdir=workdir)


@pytest.fixture(scope="module")
def list_runs(digits, tmp_path_factory):
    """A re-iterable list of 8 batches, 2 epochs, log_every=1, ckpt_every=5: uninterrupted; SIGINT
    part-way through epoch 2, then resumed; crashed after step 10's checkpoint, then resumed."""
    x, y, xt, yt = small_digits(digits)
    batches = batch_list(x, y)
    common = dict(loss_fn=loss_fn, eval_step=eval_step, num_epochs=2, log_every=1)
    dirs = {n: str(tmp_path_factory.mktemp(n)) for n in ("list_full", "list_sigint", "list_crash")}
    out = types.SimpleNamespace(dirs=dirs)
    test = batch_list(xt, yt)
    out.full, out.full_h = fit(make_state(CNN(), adam()), batches, test,
                               workdir=dirs["list_full"], **common)

    # SIGINT when the 13th batch is handed out: the 8 of epoch 1, then the 5th of epoch 2.
    out.stopped, out.stopped_h = fit(make_state(CNN(), adam()), Batches(batches, at=13), test,
                                     workdir=dirs["list_sigint"], ckpt_every=5, **common)
    out.stopped_h_copy = copy.deepcopy(dict(out.stopped_h))
    out.stopped_ckpts = ckpt_steps(out.stopped_h.ckpt_dir)
    out.resumed, out.resumed_h = fit(make_state(CNN(), adam()), batches, test,
                                     workdir=dirs["list_sigint"], ckpt_every=5, resume=True, **common)

    # A crash (an exception, no clean stop) when the 16th batch is handed out: the loop has
    # logged train/loss past the last checkpoint (step 10), so the resumed run logs those steps
    # again.
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(make_state(CNN(), adam()), Batches(batches, at=16, crash=True), test,
            workdir=dirs["list_crash"], ckpt_every=5, **common)
    crash_ckpt = os.path.join(dirs["list_crash"], "checkpoints", "run_1")
    out.crash_ckpts = ckpt_steps(crash_ckpt)
    out.crash_log_steps = raw_steps(os.path.join(dirs["list_crash"], "logs", "run_1"), "train/loss")
    out.crash_resumed, out.crash_resumed_h = fit(make_state(CNN(), adam()), batches, test,
                                                 workdir=dirs["list_crash"], ckpt_every=5,
                                                 resume=True, **common)
    return out


# ----------------------------------------------------------------------------------------------
# 1. TensorBoard: scalars and hparams in the run's own directory

def test_tensorboard_scalars_and_hparams_in_the_run_dir(boundary):
    h, log_dir = boundary.full_h, boundary.full_h.log_dir
    assert log_dir == os.path.join(boundary.full_dir, "logs", "run_1")
    # One run, one directory: no sub-run for hparams (tensorboardX's add_hparams would make one).
    assert os.listdir(os.path.join(boundary.full_dir, "logs")) == ["run_1"]
    entries = os.listdir(log_dir)
    assert entries and all(os.path.isfile(os.path.join(log_dir, e)) for e in entries), entries
    assert all(e.startswith("events.out.tfevents") for e in entries), entries

    # train/loss every 4 steps; two 4-step intervals of equal batches average to the epoch mean.
    loss = tb_scalars(log_dir, "train/loss")
    assert [s for s, _ in loss] == list(range(4, 4 * SPE + 1, 4))
    for epoch, mean in zip(h["epoch"], h["train/loss"]):
        pair = [v for s, v in loss if s in (epoch * SPE - 4, epoch * SPE)]
        assert np.mean(pair) == pytest.approx(mean, rel=1e-5)
    lr = [v for _, v in tb_scalars(log_dir, "train/lr")]
    assert len(lr) == len(loss)
    assert all(LR / 2 <= v <= LR for v in lr) and lr == sorted(lr, reverse=True) and lr[0] > lr[-1]
    # What users expect beside the loss: norms and throughput at each log point, compile time.
    # Speeds (steps/s, and since #32 examples/s and TFLOP/s), and the compile time once: it is
    # not a curve.
    for tag in ("train/grad_norm", "train/param_norm", "perf/steps_per_s", "perf/data_wait_fraction",
                "perf/examples_per_s", "perf/tflops_per_s"):
        assert [s for s, _ in tb_scalars(log_dir, tag)] == [s for s, _ in loss], tag
    assert not tb_scalars(log_dir, "perf/seconds_per_step")
    compile_s = tb_scalars(log_dir, "perf/compile_s")
    assert len(compile_s) == 1 and compile_s[0][1] > 0  # includes the first step's compile
    acc = tb_scalars(log_dir, "eval/accuracy")
    assert [s for s, _ in acc] == h["eval/step"] == [SPE, 2 * SPE, 3 * SPE, 4 * SPE]
    assert [v for _, v in acc] == pytest.approx(h["eval/accuracy"], rel=1e-6)
    assert h["eval/accuracy"][-1] > 0.3  # it learned something (chance is 0.1)

    # hparams: the session info (values), same directory. No experiment summary: with one per run,
    # TensorBoard shows the first it finds and hides other runs' columns; without, it infers them.
    ea = EventAccumulator(log_dir)
    ea.Reload()
    content = ea.PluginTagToContent("hparams")
    assert set(content) == {hparams_metadata.SESSION_START_INFO_TAG,
                            hparams_metadata.SESSION_END_INFO_TAG}  # the run ended: its session too
    session = hparams_metadata.parse_session_start_info_plugin_data(
        content[hparams_metadata.SESSION_START_INFO_TAG])
    hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in session.hparams.items()}
    assert hp["lr"] == pytest.approx(LR)
    assert hp["layers"] == "[1, 2]"  # lists are stored stringified (TensorBoard drops them else)
    assert hp["num_epochs"] == 4 and hp["batch_size"] == BATCH
    assert hp["monitor"] == "eval/accuracy"

    # What the HParams dashboard reads: one run, holding both hparams and the scalars it charts.
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(os.path.join(boundary.full_dir, "logs"))
    mux.Reload()
    assert set(mux.Runs()) == {"run_1"}
    assert set(mux.PluginRunToTagToContent("hparams")) == {"run_1"}
    assert {"train/loss", "eval/accuracy"} <= set(mux.PluginRunToTagToContent("scalars")["run_1"])


def test_no_lr_scalar_without_a_known_learning_rate(best_last):
    # best_last trains with plain optax.adam(1e-3): the learning rate cannot be known, and a flat
    # 0.0 curve (what an earlier fit.py wrote) would be wrong, not just missing.
    assert tb_scalars(best_last.history.log_dir, "train/loss")
    assert tb_scalars(best_last.history.log_dir, "train/lr") == []


def test_tensorboard_lr_is_the_rate_of_the_logged_step(boundary, digits, tmp_path):
    # TensorBoard step s is logged after s steps; the last of them (step index s-1) used
    # SCHEDULE(s - 1). An earlier fit.py read inject_hyperparams' rate from the state before the
    # update, which still holds the previous update's rate: the curve lagged one step.
    lr = tb_scalars(boundary.full_h.log_dir, "train/lr")
    assert [v for _, v in lr] == pytest.approx([float(SCHEDULE(s - 1)) for s, _ in lr], rel=1e-6)
    # The same with a plain optimizer and lr_fn=.
    x, y, _, _ = small_digits(digits, 64, 32)
    _, h = fit(make_state(MLP(), optax.adam(SCHEDULE)), (x, y), loss_fn=loss_fn, batch_size=BATCH,
               num_epochs=2, log_every=1, lr_fn=SCHEDULE, workdir=str(tmp_path))
    lr = tb_scalars(h.log_dir, "train/lr")
    assert [s for s, _ in lr] == [1, 2, 3, 4]
    assert [v for _, v in lr] == pytest.approx([float(SCHEDULE(s - 1)) for s in range(1, 5)], rel=1e-6)


# ----------------------------------------------------------------------------------------------
# 2. Checkpoints: exactly the best and the last

def test_keeps_the_best_and_the_last_checkpoint(best_last):
    h = best_last.history
    assert h["eval/accuracy"] == pytest.approx(ACCURACIES)
    assert h["eval/step"] == [2, 4, 6, 8, 10, 12]
    assert h.ckpt_dir == os.path.join(best_last.workdir, "checkpoints", "run_1")
    assert ckpt_steps(h.ckpt_dir) == [8, 12]  # epoch 4 (.95) and epoch 6 (the last)
    # TensorBoard's best/ curve follows the running best.
    best = tb_scalars(h.log_dir, "best/eval/accuracy")
    assert [v for _, v in best] == pytest.approx([.9, .9, .9, .95, .95, .95])


def test_mode_min_keeps_the_lowest_and_the_last(digits, tmp_path):
    x, y, xt, yt = small_digits(digits, 64, 32)
    accuracies = [.6, .5, .7, .95, .8, .9]  # min at epoch 2 (step 4); max would be epoch 4
    _, h = fit(make_state(MLP()), (x, y), (xt, yt), loss_fn=loss_fn,
               eval_step=fixed_eval(accuracies, 2), batch_size=BATCH, num_epochs=6, mode="min",
               workdir=str(tmp_path))
    assert h["eval/accuracy"] == pytest.approx(accuracies)
    assert ckpt_steps(h.ckpt_dir) == [4, 12]


def test_monitor_train_loss_keeps_the_lowest_loss_and_the_last(digits, tmp_path):
    x, y, _, _ = small_digits(digits, 64, 32)
    losses = [.5, .4, .3, .45, .35, .6]  # lowest at epoch 3 (step 6)

    def train_step(state, batch):  # a step whose loss is fixed per epoch (2 steps/epoch)
        loss = jnp.asarray(losses, jnp.float32)[state.step // 2]
        return state.replace(step=state.step + 1), {"loss": loss}

    # Train metrics never force a save: checkpoints every epoch (ckpt_every) are ranked by them.
    _, h = fit(make_state(MLP()), (x, y), train_step=train_step, batch_size=BATCH, num_epochs=6,
               monitor="train/loss", ckpt_every=2, workdir=str(tmp_path))
    assert h["train/loss"] == pytest.approx(losses)
    assert "eval/step" not in h
    assert ckpt_steps(h.ckpt_dir) == [6, 12]


# ----------------------------------------------------------------------------------------------
# 3. Restoring: plain orbax (no fit.py) and load_ckpt

PLAIN_ORBAX = textwrap.dedent("""
    import sys, jax, numpy as np, orbax.checkpoint as ocp
    ckpt_dir, step, out, one_device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    mgr = ocp.CheckpointManager(ckpt_dir, item_handlers=handlers)
    if one_device:
        # Another device count than the run's: orbax needs a target saying where arrays go.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        tree = mgr.item_metadata(step)["state"].tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
        restored = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    else:
        restored = mgr.restore(step)  # the same device count: a plain restore, no arguments
    params = jax.tree_util.tree_flatten_with_path(restored["state"]["params"])[0]
    np.savez(out, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in params})
    print("RESULT", len(jax.devices()), int(restored["state"]["step"]), restored["meta"]["epoch"],
          "fit" in sys.modules)
""")


def keyed(params):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]}


def test_restorable_by_plain_orbax_without_fit(best_last, tmp_path):
    h, state = best_last.history, best_last.state
    script = tmp_path / "restore.py"
    script.write_text(PLAIN_ORBAX)
    env_8 = dict(os.environ, JAX_PLATFORMS="cpu",
                 XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env_1 = {k: v for k, v in env_8.items() if k != "XLA_FLAGS"}
    jobs = {(step, one): subprocess.Popen(
        [sys.executable, str(script), h.ckpt_dir, str(step), str(tmp_path / f"{step}_{one}.npz"),
         str(one)], env=env_1 if one else env_8, cwd=str(tmp_path),  # cwd: fit.py not importable
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for step, one in ((12, 0), (8, 1))}
    outputs = {key: job.communicate(timeout=120)[0] for key, job in jobs.items()}
    for (step, one), job in jobs.items():
        assert job.returncode == 0, outputs[step, one][-3000:]
        result = [l for l in outputs[step, one].splitlines() if l.startswith("RESULT")][-1].split()
        assert result[1:] == [str(1 if one else 8), str(step), str(step // 2), "False"], result

    last = dict(np.load(tmp_path / "12_0.npz"))
    assert set(last) == set(keyed(state.params))
    for k, v in keyed(state.params).items():
        assert np.array_equal(last[k], v), k
    best = dict(np.load(tmp_path / "8_1.npz"))
    for k, v in keyed(load_ckpt(state, h.ckpt_dir, step="best").params).items():
        assert np.array_equal(best[k], v), k


def test_load_ckpt_last_best_step_and_missing_step(best_last):
    h, state = best_last.history, best_last.state
    last = load_ckpt(make_state(MLP()), h.ckpt_dir)
    assert int(last.step) == 12 and params_equal(last.params, state.params)
    assert params_equal(last.opt_state, state.opt_state)
    best = load_ckpt(make_state(MLP()), h.ckpt_dir, step="best")
    assert int(best.step) == 8
    assert not params_equal(best.params, state.params)  # training moved on after the best epoch
    by_number = load_ckpt(make_state(MLP()), h.ckpt_dir, step=8)
    assert int(by_number.step) == 8 and params_equal(by_number.params, best.params)
    assert int(load_ckpt(make_state(MLP()), h.ckpt_dir, step="last").step) == 12
    with pytest.raises(ValueError, match=r"step 7\b.*\[8, 12\]"):
        load_ckpt(make_state(MLP()), h.ckpt_dir, step=7)


# ----------------------------------------------------------------------------------------------
# 4. Resume is exact: at an epoch boundary, after SIGINT mid-epoch, after a crash

def test_resume_at_epoch_boundary_is_bitwise_exact(boundary):
    assert_bitwise_equal(boundary.resumed, boundary.full)
    assert int(boundary.resumed.step) == 4 * SPE
    resumed = dict(boundary.resumed_h)
    # (the resumed call asked for more epochs: said in the history, #40)
    assert resumed.pop("options_changed") == [f"step {2 * SPE}: num_epochs 2 -> 4"]
    assert resumed == dict(boundary.full_h)  # every epoch and eval, same values
    assert boundary.resumed_h.run == boundary.first_h.run == "run_1"


# 6. (Observed, not asserted, as they may change: the resumed run's TensorBoard hparams still say
# num_epochs=2, written once at step 0; a schedule built for the first num_epochs is not
# stretched, e.g. lr_schedule(..., epochs=2) stays at end_value (0) for epochs 3-4; with
# eval_freq=3 the 2-epoch run's final eval at epoch 2 stays in history, so eval/epoch is [2, 3, 4]
# where an uninterrupted 4-epoch run has [3, 4].)
def test_resume_with_more_epochs_extends_the_run(boundary):
    first, resumed = boundary.first_h_copy, boundary.resumed_h
    assert first["epoch"] == [1, 2] and first["eval/epoch"] == [1, 2]
    assert resumed["epoch"] == [1, 2, 3, 4] and resumed["step"] == [8, 16, 24, 32]
    assert resumed["eval/epoch"] == [1, 2, 3, 4]
    for key, values in first.items():  # the first two epochs are kept as they were
        assert resumed[key][:len(values)] == values, key
    # Continued in place: the same run directories, no new run, the latest checkpoint is the end.
    assert resumed.log_dir == boundary.first_h.log_dir
    assert os.listdir(os.path.join(boundary.split_dir, "logs")) == ["run_1"]
    assert os.listdir(os.path.join(boundary.split_dir, "checkpoints")) == ["run_1"]
    assert 2 * SPE in boundary.first_ckpts
    assert max(ckpt_steps(resumed.ckpt_dir)) == 4 * SPE


def test_sigint_mid_epoch_with_arrays_then_resume_is_exact(boundary, tmp_path, monkeypatch):
    """Arrays are batched inside fit, so the SIGINT comes from fit's host-side batch placement:
    the 4th train batch of epoch 2 (after 8 train + 2 eval placements)."""
    x, y, xt, yt = boundary.data
    calls = []

    def putter(*args, **kwargs):
        real_put = real_putter(*args, **kwargs)

        def put(*args, **kwargs):
            calls.append(1)
            if len(calls) == 14:
                send_sigint()
            return real_put(*args, **kwargs)
        return put
    real_putter = fit_module._putter
    monkeypatch.setattr(fit_module, "_putter", putter)
    common = dict(loss_fn=loss_fn, eval_step=eval_step, batch_size=BATCH, num_epochs=2,
                  ckpt_every=5, workdir=str(tmp_path))
    _, h = fit(make_state(CNN(), adam()), (x, y), (xt, yt), **common)
    monkeypatch.undo()
    n = stop_step(h)
    assert SPE < n < 2 * SPE, n  # part-way through epoch 2
    assert h["epoch"] == [1]
    assert n in ckpt_steps(h.ckpt_dir)
    state, resumed_h = fit(make_state(CNN(), adam()), (x, y), (xt, yt), resume=True, **common)
    assert resumed_h.run == h.run
    # Same result as the uninterrupted 2-epoch run (no ckpt_every there).
    assert_bitwise_equal(state, boundary.first)
    assert_same_history(without_stopped(resumed_h), boundary.first_h_copy)
    assert resumed_h["stopped"] == [f"SIGINT at step {n}"]  # the interruption stays on record


def test_sigint_mid_epoch_with_a_list_then_resume_is_exact(list_runs):
    h = list_runs.stopped_h_copy
    n = stop_step(h)
    assert SPE < n < 2 * SPE, n
    assert h["epoch"] == [1] and h["eval/epoch"] == [1]
    assert n in list_runs.stopped_ckpts
    assert_bitwise_equal(list_runs.resumed, list_runs.full)
    assert without_stopped(list_runs.resumed_h) == dict(list_runs.full_h)
    assert list_runs.resumed_h["epoch"] == [1, 2] and list_runs.resumed_h["eval/epoch"] == [1, 2]


def test_crash_resumes_from_the_last_checkpoint_exactly(list_runs):
    # ckpt_every=5: saves at 5 (mid-epoch, dropped later), 8 (epoch end, best), 10 (mid-epoch).
    assert list_runs.crash_ckpts == [8, 10]
    assert max(list_runs.crash_log_steps) > 10  # it logged past its last checkpoint
    assert_bitwise_equal(list_runs.crash_resumed, list_runs.full)
    assert dict(list_runs.crash_resumed_h) == dict(list_runs.full_h)


# ----------------------------------------------------------------------------------------------
# 5. Fresh runs never touch earlier ones; resume picks the latest

def snapshot(root):
    # (fit.lock aside: every call that opens a run, even one with nothing to do, takes its lock
    # and writes its own host and pid into it, #24)
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(root) for f in files if f != "fit.lock"}


def test_fresh_runs_get_new_dirs_and_resume_picks_the_latest(digits, tmp_path):
    x, y, _, _ = small_digits(digits, 64, 32)
    workdir = str(tmp_path)
    run = lambda seed, **kw: fit(make_state(MLP(), seed=seed), (x, y), loss_fn=loss_fn,
                                 batch_size=BATCH, log_name="exp", workdir=workdir, **kw)
    s1, h1 = run(0)
    before = snapshot(workdir)
    s2, h2 = run(1)
    assert (h1.run, h2.run) == ("exp_1", "exp_2")
    for sub in ("logs", "checkpoints"):
        assert sorted(os.listdir(os.path.join(workdir, sub))) == ["exp_1", "exp_2"]
    assert h2.log_dir == os.path.join(workdir, "logs", "exp_2")
    assert h2.ckpt_dir == os.path.join(workdir, "checkpoints", "exp_2")
    after = snapshot(workdir)
    assert {k: v for k, v in after.items() if "exp_1" in k} == before  # run 1 untouched
    assert not params_equal(s1.params, s2.params)

    # resume=True on a finished run: nothing trains, nothing is written, its result comes back.
    s3, h3 = run(2, resume=True)
    assert h3.run == "exp_2"
    assert params_equal(s3.params, s2.params) and int(s3.step) == int(s2.step) == 2
    assert dict(h3) == dict(h2)
    assert snapshot(workdir) == after
    assert ckpt_steps(h2.ckpt_dir) == [2]

    # resume=True with no earlier run of that name starts one.
    s4, h4 = fit(make_state(MLP()), (x, y), loss_fn=loss_fn, batch_size=BATCH, log_name="other",
                 workdir=workdir, resume=True)
    assert h4.run == "other_1" and h4["epoch"] == [1] and int(s4.step) == 2
    assert ckpt_steps(h4.ckpt_dir) == [2]


# ----------------------------------------------------------------------------------------------
# 7. TensorBoard after a resume: each step once

def test_tensorboard_has_no_duplicate_steps_after_a_crash_resume(list_runs):
    # The crashed run wrote train/loss past its last checkpoint (10), and the resumed run writes
    # those steps again: the raw files hold duplicates ...
    log_dir = list_runs.crash_resumed_h.log_dir
    raw = raw_steps(log_dir, "train/loss")
    assert len(raw) > len(set(raw))
    # ... and the resumed writer's purge_step (a SessionLog.START) makes TensorBoard's reader drop
    # the stale ones: each step once, each value the uninterrupted run's (training is bitwise
    # equal, so the logged losses are too).
    shown = tb_scalars(log_dir, "train/loss")
    steps = [s for s, _ in shown]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
    full = dict(tb_scalars(list_runs.full_h.log_dir, "train/loss"))
    assert all(full[s] == v for s, v in shown)
    assert [s for s in steps if s > 10] == list(range(11, 2 * SPE + 1))


@pytest.mark.parametrize("reader, case", [
    ("EventAccumulator", "epoch_boundary"),
    ("EventAccumulator", "sigint"),
    ("EventAccumulator", "crash"),
    ("plugin", "epoch_boundary"),
    ("plugin", "sigint"),
    ("plugin", "crash"),
])
def test_tensorboard_after_resume_shows_every_step_once(reader, case, boundary, list_runs):
    """The resumed run's TensorBoard steps are exactly the uninterrupted run's, each once.

    Readers: the classic EventAccumulator (purges on every SessionLog.START), and the plugin
    accumulator (`--load_fast=false`, HParams), which ignores a run's first START: fit writes one
    at a fresh run's start (purge_step=0) so the resumed run's START purges, and purges from the
    step after the checkpoint, so the first run's points at that step stay.
    """
    if case == "epoch_boundary":
        resumed, full, tags = boundary.resumed_h, boundary.full_h, ("train/loss", "eval/accuracy")
    else:
        resumed = list_runs.resumed_h if case == "sigint" else list_runs.crash_resumed_h
        full, tags = list_runs.full_h, ("train/loss",)
    steps = (lambda d, t: [s for s, _ in tb_scalars(d, t)]) if reader == "EventAccumulator" \
        else plugin_tb_steps
    for tag in tags:
        expected = [s for s, _ in tb_scalars(full.log_dir, tag)]
        assert expected and expected == list(range(expected[0], expected[-1] + 1, expected[0]))
        assert steps(resumed.log_dir, tag) == expected, tag


def test_best_is_loadable_when_a_later_eval_ties(tmp_path, one_device_mesh):
    """Equal eval scores: orbax keeps the later checkpoint, so 'best' must point at it."""
    from conftest import MLP, make_state, loss_fn
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32))
            for _ in range(4)]
    state, history = fit(make_state(MLP()), data, data[:1], loss_fn=loss_fn,
                         eval_step=lambda s, b: 0.5, num_epochs=3, workdir=str(tmp_path),
                         mesh=one_device_mesh)
    best = load_ckpt(make_state(MLP()), history.ckpt_dir, "best")
    assert int(best.step) == 12
