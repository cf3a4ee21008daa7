"""#33, item 4: the traps met while changing fit.py, each closed."""
import importlib.util
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fit as fit_module
from conftest import MLP, loss_fn, make_state
from fit import fit

COMMON = dict(verbose=0, tensorboard=False)


def batches(n, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, size).astype(np.int32)) for _ in range(n)]


def edited_fit(tmp_path, monkeypatch, *replacements):
    """fit.py as a user would edit it (each `old` text replaced), imported as its own module."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "fit.py")) as f:
        source = f.read()
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path = tmp_path / "fit_edited.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fit_edited", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_wrapped_linen_forward_compiles_once_and_gets_linen_advice(tmp_path, monkeypatch,
                                                                      compile_log):
    """The natural way to pass the forward an option: functools.partial(_linen_forward, ...)."""
    edited = edited_fit(tmp_path, monkeypatch, (
        'return _Model(model, _linen_forward, opts.eval_step, _itself, _itself, True, None, "")',
        'return _Model(model, _WRAPPED, opts.eval_step, _itself, _itself, True, None, "")'), (
        "def _default_train_step(config):",
        "_WRAPPED = functools.partial(_linen_forward)\n\n\ndef _default_train_step(config):"))
    data, tx, apply_fn = batches(3), optax.adam(1e-3), MLP().apply
    for i in range(2):  # a notebook cell run twice: the second compiles nothing
        edited.fit(edited.TrainState.create(apply_fn=apply_fn, tx=tx,
                                            params=make_state(MLP()).params), data,
                   loss_fn=loss_fn, workdir=str(tmp_path / str(i)), **COMMON)
    assert compile_log.count() == 1, compile_log.shapes()

    class NoTrain(MLP):  # a model without the `train` argument fit's default step passes
        def __call__(self, x):
            return super().__call__(x, False)
    state = edited.TrainState.create(apply_fn=NoTrain().apply, tx=optax.adam(1e-3),
                                     params=make_state(MLP()).params)
    with pytest.raises(Exception) as info:
        edited.fit(state, data, loss_fn=loss_fn, workdir=str(tmp_path / "advice"), **COMMON)
    assert "train_step(state, batch)" in str(info.value), str(info.value)
    assert "nnx_loss_fn" not in str(info.value), str(info.value)


@pytest.mark.parametrize("event", ["train_start", "log", "epoch_end", "eval", "save"])
def test_assigning_run_state_outside_train_end_raises_naming_the_event(event, tmp_path):
    def replace_state(e, run):
        if e == event:
            run.state = run.state.replace(step=run.state.step)  # (a new object, as a user's)

    with pytest.raises(ValueError, match=rf"replace_state assigned run.state at {event!r}"):
        fit(make_state(MLP()), batches(4), batches(1), loss_fn=loss_fn,
            eval_step=lambda s, b: 0.5, log_every=2, hooks=[replace_state],
            workdir=str(tmp_path), **COMMON)


def test_run_state_assigned_at_train_end_is_returned(tmp_path):
    def replace_state(event, run):
        if event == "train_end":
            run.state = run.state.replace(step=run.state.step + 100)

    state, _ = fit(make_state(MLP()), batches(4), loss_fn=loss_fn, hooks=[replace_state],
                   workdir=str(tmp_path), **COMMON)
    assert int(state.step) == 104


def test_a_user_hooks_time_is_out_of_steps_per_s_and_in_hooks_s(tmp_path, one_device_mesh):
    def slow(event, run):
        if event == "log":
            time.sleep(0.2)
            with run.timed("upload"):  # a hook's own part, also reported
                time.sleep(0.05)

    data = batches(8)
    kwargs = dict(loss_fn=loss_fn, num_epochs=3, log_every=2, mesh=one_device_mesh, **COMMON)
    _, quick = fit(make_state(MLP()), data, workdir=str(tmp_path / "a"), **kwargs)
    _, slowed = fit(make_state(MLP()), data, workdir=str(tmp_path / "b"), hooks=[slow], **kwargs)
    logs = 24 // 2
    timing = slowed.timing
    assert timing["hooks_count"] >= logs and timing["hooks_s"] >= logs * 0.25 - 0.01, timing
    assert timing["upload_count"] >= logs and timing["upload_s"] >= logs * 0.05 - 0.01, timing
    assert quick.timing["hooks_s"] < 0.1, quick.timing  # (no user hook: only fit's own)
    # 12 x 0.25 s of sleep would make a ~24-step run's rate collapse: it stays out of it.
    steady_s = timing["steps"] / timing["steady_steps_per_s"]
    assert steady_s < timing["wall_s"] - logs * 0.25 + 0.2, timing


def test_a_resumed_runs_event_file_has_its_purge_records_before_any_summary(tmp_path,
                                                                          monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboardX import event_file_writer

    # A busy machine: tensorboardX's writer thread gets to its queue late.
    run = event_file_writer._EventLoggerThread.run
    monkeypatch.setattr(event_file_writer._EventLoggerThread, "run",
                        lambda self: (time.sleep(0.5), run(self)))

    def histogram(event, run):  # written from a hook, as the user did, from the start
        if event in ("train_start", "log") and run.writer is not None:
            run.writer.add_histogram("logits", np.arange(10.0), run.step)

    kwargs = dict(loss_fn=loss_fn, log_every=2, ckpt_every=4, hooks=[histogram], verbose=0,
                  workdir=str(tmp_path), log_name="tb")
    fit(make_state(MLP()), batches(8), max_steps=4, **kwargs)
    _, history = fit(make_state(MLP()), batches(8), max_steps=8, resume=True, **kwargs)
    files = sorted(os.listdir(history.log_dir), key=lambda f: os.path.getmtime(
        os.path.join(history.log_dir, f)))
    events = list(EventFileLoader(os.path.join(history.log_dir, files[-1])).Load())
    kinds = [e.WhichOneof("what") for e in events]
    first_summary = kinds.index("summary")
    purge = [i for i, e in enumerate(events) if e.step == 5 and kinds[i] in
             ("file_version", "session_log")]
    assert len(purge) == 2 and max(purge) < first_summary, [
        (kind, e.step) for kind, e in zip(kinds, events)]


def test_a_step_that_changes_a_leafs_dtype_warns_once_at_trace_time(tmp_path):
    def bf16_step(state, batch):
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), state.params)
        return state.replace(params=params, step=state.step + 1), {"loss": jnp.float32(0.0)}

    with pytest.warns(UserWarning, match=r"changes the dtype of .*params.*bfloat16.*float32"):
        state, _ = fit(make_state(MLP()), batches(4), train_step=bf16_step,
                       workdir=str(tmp_path), **COMMON)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step that keeps its dtypes: no warning
        fit(make_state(MLP()), batches(4), loss_fn=loss_fn, workdir=str(tmp_path / "ok"),
            **COMMON)


def test_an_option_marked_traced_reaches_the_step_config_and_the_cache_key(tmp_path,
                                                                           monkeypatch):
    """A user adds an option that their edited step reads: the field and its mark, nothing more."""
    edited = edited_fit(tmp_path, monkeypatch, (
        "    seed: int = dataclasses.field(default=0, metadata=_TRACED)\n",
        "    seed: int = dataclasses.field(default=0, metadata=_TRACED)\n"
        "    label_smoothing: float = dataclasses.field(default=0.0, metadata=_TRACED)\n"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))

    def config(**options):
        return edited._StepConfig.of(edited.Options(**options), edited._linen_forward, None,
                                     mesh, linen=True)
    assert config(label_smoothing=0.1).label_smoothing == 0.1
    assert config(label_smoothing=0.1) != config(label_smoothing=0.2)  # (the cache's key)
    assert config(label_smoothing=0.1) == config(label_smoothing=0.1)
    assert config().seed == 0 and config(seed=3).log_every == 50
    with pytest.raises(AttributeError, match="mark the option _TRACED"):
        config().batch_size  # (not marked: traced code cannot read it by mistake)


def test_train_end_hooks_and_clashing_names(tmp_path, one_device_mesh):
    """A slow train_end hook (EarlyStopping restoring the best, wandb.finish) is reported, not
    taken out of the steady time it was never in; run.timed refuses fit's own parts' names."""
    def finish(event, run):
        if event == "train_end":
            time.sleep(1.0)

    _, history = fit(make_state(MLP()), batches(8), loss_fn=loss_fn, num_epochs=2,
                     hooks=[finish], mesh=one_device_mesh, workdir=str(tmp_path), **COMMON)
    timing = history.timing
    assert timing["hooks_s"] >= 1.0 and timing["steady_steps_per_s"] is not None, timing
    steady_s = (timing["steps"] - 1) / timing["steady_steps_per_s"]  # (the compile step aside)
    assert steady_s > 0.9 * (timing["wall_s"] - timing["compile_s"] - timing["save_s"] - timing[
        "finish_s"] - timing["close_s"] - timing["eval_s"] - 0.05), timing

    def clash(event, run):
        if event == "log":
            with run.timed("eval"):
                pass
    with pytest.raises(ValueError, match=r"run.timed\('eval'\) would add to fit's own eval_s"):
        fit(make_state(MLP()), batches(4), loss_fn=loss_fn, log_every=2, hooks=[clash],
            mesh=one_device_mesh, workdir=str(tmp_path / "clash"), **COMMON)
