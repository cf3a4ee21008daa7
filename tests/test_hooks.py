"""Hooks: the moments they are called at, stopping, EarlyStopping and Profiler."""
import glob
import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MLP, eval_step, flat, loss_fn, make_state
from fit import EarlyStopping, Profiler, fit, load_ckpt


def _data(n_batches, seed=0, size=16):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, size).astype(np.int32)) for _ in range(n_batches)]


def test_hook_moments_in_order(tmp_path, one_device_mesh):
    calls = []

    def hook(event, run):
        calls.append((event, run.step, sorted(run.metrics)))

    fit(make_state(MLP()), _data(10), _data(2, 1), loss_fn=loss_fn, eval_step=eval_step,
        num_epochs=2, log_every=4, hooks=[hook], workdir=str(tmp_path), mesh=one_device_mesh)
    events = [(e, s) for e, s, _ in calls]
    # `save` comes before each checkpoint (#14 adds it; the TensorBoard hook writes its events to
    # disk there): the first eval enters the kept best, and the end always saves.
    assert events == [
        ("train_start", 0),
        ("log", 4), ("log", 8), ("log", 10), ("epoch_end", 10), ("eval", 10), ("save", 10),
        ("log", 12), ("log", 16), ("log", 20), ("epoch_end", 20), ("eval", 20), ("save", 20),
        ("train_end", 20)], events
    metrics = {e: m for e, _, m in calls}
    assert "train/loss" in metrics["log"] and "train/grad_norm" in metrics["log"]
    # #16: the norms are their values at log steps (multiples of log_every), not epoch means
    logs = {s: m for e, s, m in calls if e == "log"}
    assert all(("train/param_norm" in m) == (s % 4 == 0) for s, m in logs.items()), logs
    assert metrics["epoch_end"] == ["train/accuracy", "train/loss"]
    assert metrics["eval"] == ["eval/accuracy"]


def test_a_hook_can_stop_and_replace_the_returned_state(tmp_path, one_device_mesh):
    def stop_at_6(event, run):
        if event == "log" and run.step >= 6:
            run.stop = True
        if event == "train_end":
            run.state = run.state.replace(step=run.state.step * 0 + 12345)

    state, history = fit(make_state(MLP()), _data(10), loss_fn=loss_fn, num_epochs=3, log_every=2,
                         hooks=[stop_at_6], workdir=str(tmp_path), mesh=one_device_mesh)
    # The log at step 6 is read one step later (the host never waits on the device), so the stop
    # lands after step 7; a checkpoint there makes it resumable.
    assert history["stopped"] == ["stop_at_6 at step 7"]
    assert int(state.step) == 12345
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir).step) == 7


def test_early_stopping_stops_and_restores_the_best(tmp_path, one_device_mesh):
    accuracies = jnp.array([0.5, 0.7, 0.6, 0.65, 0.68, 0.9, 0.95])

    def scripted_eval(state, batch):  # eval accuracy per epoch, from the step (5 steps/epoch)
        return accuracies[state.step // 5 - 1]

    seen = {}

    def record(event, run):
        if event == "epoch_end":
            seen[run.step] = flat(run.state.params)

    state, history = fit(make_state(MLP()), _data(5), _data(1, 1), loss_fn=loss_fn,
                         eval_step=scripted_eval, num_epochs=7, hooks=[record, EarlyStopping(patience=3)],
                         workdir=str(tmp_path), mesh=one_device_mesh)
    # best at epoch 2 (0.7); epochs 3, 4, 5 do not beat it: stop after epoch 5
    assert history["eval/accuracy"] == pytest.approx([0.5, 0.7, 0.6, 0.65, 0.68])
    assert history["stopped"] == ["EarlyStopping at step 25"]
    assert int(state.step) == 10
    np.testing.assert_array_equal(flat(state.params), seen[10])


def test_early_stopping_checks_its_monitor(tmp_path, one_device_mesh):
    with pytest.raises(ValueError, match="EarlyStopping: monitor='eval/loss' differs from fit's monitor='eval/accuracy'"):
        fit(make_state(MLP()), _data(2), _data(1, 1), loss_fn=loss_fn, eval_step=eval_step,
            hooks=[EarlyStopping(monitor="eval/loss")], workdir=str(tmp_path), mesh=one_device_mesh)


def test_profiler_writes_a_trace_into_the_run(tmp_path, one_device_mesh):
    _, history = fit(make_state(MLP()), _data(12), loss_fn=loss_fn, log_every=2,
                     hooks=[Profiler(start_step=2, num_steps=4)], workdir=str(tmp_path),
                     mesh=one_device_mesh)
    traces = glob.glob(os.path.join(history.log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    assert traces, os.listdir(history.log_dir)


def test_hooks_must_be_functions(tmp_path):
    with pytest.raises(TypeError, match="hooks must be a list of functions"):
        fit(make_state(MLP()), _data(2), loss_fn=loss_fn, hooks=["nope"], workdir=str(tmp_path))
    assert not os.listdir(tmp_path)
