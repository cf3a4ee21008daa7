"""Issue #14's newcomer list: HParams per run, hparam values, verbose=, the bar's postfix, early
stop and resume, stops in the history, runs with nothing to do, error messages, tx=None, threads,
one-shot iterators, schedule warnings, perf tags, monitor inference, models without train=,
Options, and when checkpoints are written."""
import dataclasses
import os
import signal
import threading
import time
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tqdm._monitor import TMonitor

import fit as fit_module
from conftest import MLP, eval_step, loss_fn, make_state
from fit import EarlyStopping, TrainState, fit, load_ckpt, lr_schedule


def _data(n_batches, seed=0, size=16):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, size).astype(np.int32)) for _ in range(n_batches)]


def _gen(n_batches, seed=0):
    yield from _data(n_batches, seed)


def _hparams_content(log_dir):
    acc = plugin_event_accumulator.EventAccumulator(log_dir)
    acc.Reload()
    return acc.PluginTagToContent("hparams")


def _session_hparams(content):
    session = hparams_metadata.parse_session_start_info_plugin_data(
        content[hparams_metadata.SESSION_START_INFO_TAG])
    return {k: (v.WhichOneof("kind"), getattr(v, v.WhichOneof("kind")))
            for k, v in session.hparams.items()}


def _scalar_tags(log_dir):
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _record_saves(monkeypatch):
    """The steps of every checkpoint fit writes, in order (through orbax's manager)."""
    saved = []
    original = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        saved.append(int(step))
        return original(self, step, *args, **kwargs)
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    return saved


# a. HParams: one session per run, no experiment summary


def test_hparams_each_run_writes_only_its_session(tmp_path, one_device_mesh):
    kwargs = dict(loss_fn=loss_fn, workdir=str(tmp_path), mesh=one_device_mesh)
    _, h1 = fit(make_state(MLP()), _data(2), hparams={"lr": 0.1, "width": 32}, **kwargs)
    _, h2 = fit(make_state(MLP()), _data(2), hparams={"lr": 0.2}, **kwargs)
    assert h1.log_dir != h2.log_dir
    for history, lr in ((h1, 0.1), (h2, 0.2)):
        content = _hparams_content(history.log_dir)
        assert hparams_metadata.EXPERIMENT_TAG not in content, sorted(content)
        assert hparams_metadata.SESSION_START_INFO_TAG in content
        assert hparams_metadata.SESSION_END_INFO_TAG in content  # a good end
        hp = _session_hparams(content)
        assert hp["lr"] == ("number_value", pytest.approx(lr))
    assert "width" in _session_hparams(_hparams_content(h1.log_dir))
    assert "width" not in _session_hparams(_hparams_content(h2.log_dir))


# b. hparam values of every kind


def test_hparam_values_none_numpy_and_lists(tmp_path, one_device_mesh):
    _, history = fit(make_state(MLP()), _data(2), loss_fn=loss_fn, workdir=str(tmp_path),
                     mesh=one_device_mesh,
                     hparams={"a": None, "b": np.float32(1e-4), "c": np.int64(3), "d": [1, 2],
                              "e": np.array([4, 5])})
    hp = _session_hparams(_hparams_content(history.log_dir))
    assert hp["a"] == ("string_value", "None")
    assert hp["b"][0] == "number_value" and hp["b"][1] == pytest.approx(1e-4, rel=1e-5)
    assert hp["c"] == ("number_value", 3)
    assert hp["d"] == ("string_value", "[1, 2]")
    assert hp["e"] == ("string_value", "[4, 5]")  # a numpy array: its text, not an error


# c. verbose=


def _run_verbose(tmp_path, mesh, **kwargs):
    fit(make_state(MLP()), _data(4), _data(1, 1), loss_fn=loss_fn, eval_step=eval_step,
        num_epochs=2, log_every=2, workdir=str(tmp_path), mesh=mesh, **kwargs)


def test_verbose_0_prints_nothing(tmp_path, one_device_mesh, capfd):
    _run_verbose(tmp_path, one_device_mesh, verbose=0)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_verbose_1_prints_the_bar_and_epoch_lines(tmp_path, one_device_mesh, capfd, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    _run_verbose(tmp_path, one_device_mesh)  # verbose=1 is the default
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if line.startswith("epoch ")]
    assert any(line.startswith("epoch 1/2, step 4") for line in lines), out + err
    assert any(line.startswith("epoch 2/2, step 8") for line in lines), out + err
    assert "%|" in out + err


@pytest.mark.parametrize("how", ["verbose=2", "TQDM_DISABLE=1"])
def test_verbose_2_prints_epoch_lines_but_no_bar(how, tmp_path, one_device_mesh, capfd, monkeypatch):
    if how == "verbose=2":
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        _run_verbose(tmp_path, one_device_mesh, verbose=2)
    else:
        monkeypatch.setenv("TQDM_DISABLE", "1")
        _run_verbose(tmp_path, one_device_mesh)
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2, step 4", "epoch 2/2, step 8"], out + err
    assert "%|" not in out + err, out + err


def test_invalid_verbose_raises(tmp_path, one_device_mesh):
    with pytest.raises(ValueError, match="verbose"):
        fit(make_state(MLP()), _data(2), loss_fn=loss_fn, verbose=5, workdir=str(tmp_path),
            mesh=one_device_mesh)
    assert os.listdir(tmp_path) == []


# d. The bar's postfix


def test_bar_shows_loss_speed_and_eta_but_no_norms(tmp_path, one_device_mesh, capfd, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    fit(make_state(MLP()), _data(30), loss_fn=loss_fn, num_epochs=1, log_every=2,
        workdir=str(tmp_path), mesh=one_device_mesh)
    _, err = capfd.readouterr()
    bars = [s for s in err.replace("\r", "\n").splitlines() if "%|" in s]
    assert bars, err
    final = bars[-1]
    assert "loss=" in final and "steps/s" in final and "ETA" in final, final
    assert not any("grad_norm" in b or "param_norm" in b for b in bars), bars


# e. Early stop and resume


ACCURACIES = jnp.array([0.5, 0.7, 0.6, 0.65, 0.68, 0.9, 0.95, 0.96, 0.97])


def _scripted_eval(state, batch):  # eval accuracy per epoch, from the step (5 steps/epoch)
    return ACCURACIES[state.step // 5 - 1]


def test_an_early_stopped_run_resumed_with_the_same_arguments_returns_at_once(tmp_path, one_device_mesh):
    def call(num_epochs, resume):
        return fit(make_state(MLP()), _data(5), _data(1, 1), loss_fn=loss_fn,
                   eval_step=_scripted_eval, num_epochs=num_epochs,
                   hooks=[EarlyStopping(patience=3)], workdir=str(tmp_path), resume=resume,
                   mesh=one_device_mesh)

    state, history = call(7, False)
    assert int(state.step) == 10 and history["stopped"] == ["EarlyStopping at step 25"]
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir).step) == 25

    state2, history2 = call(7, True)  # the same arguments: nothing to do
    assert history2.run == history.run
    assert int(state2.step) == int(state.step) == 10
    assert dict(history2) == dict(history)
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir).step) == 25

    state3, history3 = call(9, True)  # asked to go further: it trains on
    assert history3.run == history.run
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir).step) == 45
    assert history3["step"] == [5, 10, 15, 20, 25, 30, 35, 40, 45]
    assert int(state3.step) == 45  # no early stop this time: the last state


def test_a_sigint_stop_resumes_to_the_end_a_hook_stop_does_not(tmp_path, one_device_mesh):
    def interrupt(event, run):
        if event == "log" and run.step == 6:
            signal.raise_signal(signal.SIGINT)

    def stop(event, run):
        if event == "log" and run.step == 6:
            run.stop = True

    def call(workdir, hooks=(), resume=False):
        return fit(make_state(MLP()), _data(5), loss_fn=loss_fn, num_epochs=2, log_every=2,
                   hooks=list(hooks), resume=resume, workdir=str(tmp_path / workdir),
                   mesh=one_device_mesh)

    # SIGINT (Ctrl-C) pauses the run: the same call with resume=True goes on to the end.
    state, history = call("sigint", [interrupt])
    stopped = int(state.step)
    assert 6 <= stopped < 10, stopped
    assert history["stopped"] == [f"SIGINT at step {stopped}"]
    state2, history2 = call("sigint", resume=True)
    assert history2.run == history.run
    assert int(state2.step) == 10 and history2["step"] == [5, 10]
    state3, history3 = call("sigint", resume=True)  # at its end: nothing left to do
    assert int(state3.step) == 10 and history3["step"] == [5, 10]

    # A hook's stop ends the run for good: the same call with resume=True returns at once.
    state, history = call("hook", [stop])
    stopped = int(state.step)
    assert history["stopped"] == [f"stop at step {stopped}"]
    state2, history2 = call("hook", [stop], resume=True)
    assert history2.run == history.run
    assert int(state2.step) == stopped and history2["step"] == history["step"]
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir).step) == stopped


# f. history["stopped"] survives a resume


def test_the_stop_stays_in_the_history_of_a_resumed_run(tmp_path, one_device_mesh):
    losses_up = jnp.array([0.5, 0.4, 0.6, 0.7, 0.8])

    def scripted(state, batch):
        return losses_up[state.step // 5 - 1]

    def call(num_epochs, resume):
        return fit(make_state(MLP()), _data(5), _data(1, 1), loss_fn=loss_fn, eval_step=scripted,
                   num_epochs=num_epochs, ckpt_every=5, hooks=[EarlyStopping(patience=1)],
                   workdir=str(tmp_path), resume=resume, mesh=one_device_mesh)

    _, history = call(4, False)
    assert history["stopped"] == ["EarlyStopping at step 10"]
    _, history2 = call(5, True)
    assert history2["step"][:2] == [5, 10] and len(history2["step"]) > 2
    assert "EarlyStopping at step 10" in history2["stopped"], history2.get("stopped")


# g. nothing to do: nothing made


def test_a_state_past_max_steps_returns_at_once_and_makes_no_directory(tmp_path, one_device_mesh):
    state = make_state(MLP()).replace(step=100)
    out, history = fit(state, _data(3), loss_fn=loss_fn, max_steps=10, workdir=str(tmp_path),
                       mesh=one_device_mesh)
    assert int(out.step) == 100
    assert os.listdir(tmp_path) == []


# h. error messages name what the user wrote


def test_a_non_scalar_metric_names_loss_fn(tmp_path, one_device_mesh):
    def bad_loss(logits, labels):
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return per_example.mean(), {"per_example": per_example}

    with pytest.raises(TypeError, match="loss_fn") as info:
        fit(make_state(MLP()), _data(2), loss_fn=bad_loss, workdir=str(tmp_path),
            mesh=one_device_mesh)
    assert "train_step" not in str(info.value), info.value
    assert os.listdir(tmp_path) == []


class Wider(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1))))


def test_load_ckpt_of_another_model_says_load_ckpt(tmp_path, one_device_mesh):
    _, history = fit(make_state(MLP()), _data(2), loss_fn=loss_fn, workdir=str(tmp_path),
                     mesh=one_device_mesh)
    with pytest.raises(ValueError) as info:
        load_ckpt(make_state(Wider()), history.ckpt_dir)
    assert str(info.value).startswith("load_ckpt:"), info.value


# i. TrainState without an optimizer


def test_trainstate_without_tx_and_fit_asks_for_one(tmp_path, one_device_mesh):
    model = MLP()
    var = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)
    state = TrainState.create(apply_fn=model.apply, params=var["params"], tx=None)
    assert state.opt_state is None and state.tx is None and int(state.step) == 0
    with pytest.raises(ValueError, match="tx"):
        fit(state, _data(2), loss_fn=loss_fn, workdir=str(tmp_path), mesh=one_device_mesh)
    assert os.listdir(tmp_path) == []


# j. no thread outlives fit


def test_fit_leaves_no_threads_behind(tmp_path, one_device_mesh, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    # A tqdm monitor thread left by an earlier call (of an older fit) is not this call's.
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()
    before = set(threading.enumerate())
    fit(make_state(MLP()), _data(6), _data(1, 1), loss_fn=loss_fn, eval_step=eval_step,
        num_epochs=2, log_every=2, ckpt_every=3, workdir=str(tmp_path), mesh=one_device_mesh)
    deadline = time.monotonic() + 2
    while set(threading.enumerate()) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    extra = set(threading.enumerate()) - before
    assert not extra, [t.name for t in extra]


# k. one-shot iterators


def test_a_generator_train_ds_over_two_epochs_is_refused_up_front(tmp_path, one_device_mesh):
    with pytest.raises(ValueError) as info:
        fit(make_state(MLP()), _gen(4), loss_fn=loss_fn, num_epochs=2, workdir=str(tmp_path),
            mesh=one_device_mesh)
    assert "steps_per_epoch" in str(info.value) and "max_steps" in str(info.value), info.value
    assert os.listdir(tmp_path) == []


def test_a_generator_test_ds_works_for_one_eval_only(tmp_path, one_device_mesh):
    with pytest.raises(ValueError, match="test_ds"):
        fit(make_state(MLP()), _data(2), _gen(1, 1), loss_fn=loss_fn, eval_step=eval_step,
            num_epochs=3, workdir=str(tmp_path / "three"), mesh=one_device_mesh)
    assert not os.path.exists(tmp_path / "three")
    _, history = fit(make_state(MLP()), _data(2), _gen(2, 1), loss_fn=loss_fn,
                     eval_step=eval_step, num_epochs=1, workdir=str(tmp_path / "one"),
                     mesh=one_device_mesh)
    assert len(history["eval/accuracy"]) == 1


# l. a schedule sized for another run


def _schedule_run(tmp_path, mesh, steps_per_epoch, epochs):
    tx = optax.inject_hyperparams(optax.adam)(lr_schedule(1e-3, steps_per_epoch=steps_per_epoch,
                                                          epochs=epochs))
    fit(make_state(MLP(), tx=tx), _data(10), loss_fn=loss_fn, num_epochs=4, log_every=10,
        workdir=str(tmp_path), mesh=mesh)


def test_a_schedule_that_ends_early_is_warned_about(tmp_path, one_device_mesh):
    # A Python warning: shown at every verbosity, filterable like any other.
    with pytest.warns(UserWarning, match="learning-rate schedule reaches its final value") as seen:
        _schedule_run(tmp_path / "short", one_device_mesh, steps_per_epoch=2, epochs=3)  # 6 of 40
    text = " ".join(str(w.message) for w in seen)
    assert "trains steps 0 to 40" in text and "step 5" in text, text
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _schedule_run(tmp_path / "right", one_device_mesh, steps_per_epoch=10, epochs=4)
    assert not [w for w in seen if "learning-rate schedule" in str(w.message)], seen


# m. TensorBoard perf tags


def test_perf_tags_are_steps_per_s_and_one_compile_time(tmp_path, one_device_mesh):
    _, history = fit(make_state(MLP()), _data(6), loss_fn=loss_fn, num_epochs=2, log_every=2,
                     workdir=str(tmp_path), mesh=one_device_mesh)
    tags = _scalar_tags(history.log_dir)
    assert "perf/steps_per_s" in tags, sorted(tags)
    # (#32 asked for examples/s and TFLOP/s beside steps/s; seconds per step stays out)
    assert "perf/examples_per_s" in tags and "perf/tflops_per_s" in tags, sorted(tags)
    assert "perf/seconds_per_step" not in tags, sorted(tags)
    assert len(tags.get("perf/compile_s", [])) == 1, tags.get("perf/compile_s")


# p. the monitor and its mode


def test_a_loss_among_eval_metrics_is_the_monitor_with_mode_min(tmp_path, one_device_mesh):
    losses = jnp.array([0.5, 0.3, 0.4])

    def vae_eval(state, batch):
        loss = losses[state.step // 5 - 1]
        return {"bce": loss * 0.5, "kld": 1.0 - loss, "loss": loss}

    seen = []

    def record(event, run):
        if event == "train_start":
            seen.append((run.monitor, run.mode))

    _, history = fit(make_state(MLP()), _data(5), _data(1, 1), loss_fn=loss_fn, eval_step=vae_eval,
                     num_epochs=3, max_to_keep=1, hooks=[record], workdir=str(tmp_path),
                     mesh=one_device_mesh)
    assert seen == [("eval/loss", "min")]
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir, "best").step) == 10


def test_a_monitor_of_unknown_direction_needs_mode(tmp_path, one_device_mesh):
    def foo_eval(state, batch):
        return {"foo": jnp.float32(1.0)}

    kwargs = dict(loss_fn=loss_fn, eval_step=foo_eval, mesh=one_device_mesh)
    with pytest.raises(ValueError, match="mode="):
        fit(make_state(MLP()), _data(2), _data(1, 1), workdir=str(tmp_path / "auto"), **kwargs)
    assert not os.path.exists(tmp_path / "auto")
    _, history = fit(make_state(MLP()), _data(2), _data(1, 1), mode="max",
                     workdir=str(tmp_path / "max"), **kwargs)
    assert history["eval/foo"] == [1.0]


# q. a model without train=


class NoTrainArg(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def test_a_model_without_train_argument_is_explained(tmp_path, one_device_mesh):
    model = NoTrainArg()
    var = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))
    state = TrainState.create(apply_fn=model.apply, params=var["params"], tx=optax.adam(1e-3))
    with pytest.raises(TypeError) as info:
        fit(state, _data(2), loss_fn=loss_fn, workdir=str(tmp_path), mesh=one_device_mesh)
    assert "train=" in str(info.value) and "train_step" in str(info.value), info.value
    assert os.listdir(tmp_path) == []


# Options


def test_an_unknown_option_suggests_the_right_one(tmp_path, one_device_mesh):
    with pytest.raises(TypeError, match="did you mean num_epochs?"):
        fit(make_state(MLP()), _data(2), loss_fn=loss_fn, num_epoch=2, workdir=str(tmp_path),
            mesh=one_device_mesh)
    assert os.listdir(tmp_path) == []


def test_options_are_frozen():
    options = fit_module.Options(num_epochs=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_epochs = 3


# Checkpoint policy


def test_checkpoints_when_an_eval_enters_the_best_and_at_the_end(tmp_path, one_device_mesh, monkeypatch):
    saved = _record_saves(monkeypatch)
    falling = jnp.array([0.5, 0.4, 0.3])

    def scripted(state, batch):
        return falling[state.step // 5 - 1]

    _, history = fit(make_state(MLP()), _data(5), _data(1, 1), loss_fn=loss_fn, eval_step=scripted,
                     num_epochs=3, workdir=str(tmp_path), mesh=one_device_mesh)
    assert history["eval/accuracy"] == pytest.approx([0.5, 0.4, 0.3])
    assert saved == [5, 15], saved
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir, "best").step) == 5


def test_a_hook_can_ask_for_a_checkpoint(tmp_path, one_device_mesh, monkeypatch):
    saved = _record_saves(monkeypatch)

    def save_at_4(event, run):
        if event == "log" and run.step == 4:
            run.save = True

    fit(make_state(MLP()), _data(10), loss_fn=loss_fn, log_every=2, hooks=[save_at_4],
        workdir=str(tmp_path), mesh=one_device_mesh)
    # The log of step 4 is read one step later (as for run.stop), so the save lands at step 5.
    assert saved == [5, 10], saved
