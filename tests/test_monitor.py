"""#39 (items 2-4): metrics computed in Python, one best that loads, the train sums' one layout.

1. `eval_metrics={name: fn(state, batches)}`: a metric no device sum can give (macro-F1 over all
   decoded predictions) is logged, recorded and may be the `monitor`: the best checkpoint,
   `EarlyStopping` and TensorBoard's `best/<monitor>` follow it; `evaluate` computes it too; a
   typo in `monitor=` is refused before any work. It runs for every named eval set and for the
   `fit.ema` average, and an nnx model's fn gets the model in eval mode.
2. On 2 processes each computes its own value and all use process 0's (tests/_multihost_child.py,
   scenario `python_metric`).
3. Compute first, decide second: a hook that changes `run.metrics` raises naming itself and the
   event; `run.metrics` holds floats only (`json.dumps` works in a hook).
4. A train-metric monitor (no test set, `monitor="train/loss"`) checkpoints the epoch end whose
   mean enters the kept best, so `load_ckpt(..., "best")` loads it and EarlyStopping restores it;
   of equal values the later is the best, and `EarlyStopping` counts a tie as no improvement.
5. (#48) Without an eval set a run keeps a best only if `monitor=` names one: it saves on its
   periods alone, `load_ckpt(..., "best")` says how to keep one, and `EarlyStopping` without a
   metric to follow raises before any work; with no metric at all the run trains, with no best.
6. The train sums have one layout: one edit in `_step_values` logs a new per-step quantity.
7. Guard: with scalar metrics only, the compiled train and eval steps have as many optimized HLO
   instructions as before #39 (5402c9f).

Everything but (7) fails on 5402c9f's fit.py (it has no `eval_metrics`, no `_step_values`, no check
of `run.metrics`, no checkpoint for a train monitor's best, and defaults to `train/loss`).
Models are small (conftest's, an nnx MLP), on one device, for a few dozen steps.
"""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import CNN, MLP, eval_step, fit_at, flat, loss_fn, make_state
from fit import EarlyStopping, evaluate, fit, load_ckpt
from test_shape import _programs
from test_traps import edited_fit

OLD = "5402c9f"  # fit.py before #39
QUIET = dict(verbose=0, tensorboard=False)


def scalars(log_dir, tag):
    """[(step, value)] of one TensorBoard scalar tag in a run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


class Capture:
    """A hook keeping, for each of `events`, (step, params, metrics) as the hook saw them."""

    def __init__(self, *events):
        self.events, self.seen = events, {e: [] for e in events}

    def __call__(self, event, run):
        if event in self.events:
            self.seen[event].append((run.step, jax.device_get(run.state.params),
                                     dict(run.metrics)))

    def params_at(self, event, step):
        (params,) = [p for s, p, _ in self.seen[event] if s == step]
        return params


def assert_same_params(a, b):
    np.testing.assert_array_equal(flat(a), flat(b))


# ----------------------------------------------------------------------------------------------
# 1. A metric computed in Python from decoded predictions, as the monitor

BATCH, EVERY, PEAK = 60, 5, 20
_predict = jax.jit(lambda params, x: MLP().apply({"params": params}, x, train=False).argmax(-1))


def macro_f1(state, batches):
    """Macro-F1 of the decoded predictions over the whole eval set at once (sklearn): an F1 is
    not a mean of per-batch F1s, so no device sum gives it; it needs every prediction."""
    from sklearn.metrics import f1_score
    xs, ys = zip(*batches)
    predictions = np.asarray(_predict(jax.device_get(state.params), np.concatenate(xs)))
    return f1_score(np.concatenate(ys), predictions, average="macro", zero_division=0)


def test_a_python_metric_is_the_monitor_of_best_early_stopping_and_tensorboard(
        digits, one_device_mesh, tmp_path):
    """An eval set labelled by the model of step PEAK of this very run (a first run to PEAK: the
    same steps, deterministic), so the macro-F1 is 1.0 at the eval of step PEAK and below it at
    every other eval: a peak in the middle. With `monitor="eval/macro_f1"` (mode "max" from its
    name), EarlyStopping(patience=2) stops two evals later and returns the state of step PEAK,
    which is also what `load_ckpt(..., "best")` loads (both compared with the params a hook
    captured at that eval); TensorBoard's `best/eval/macro_f1` is the running best; the history
    holds the values the hooks saw; `evaluate(..., eval_metrics=)` computes it too."""
    x, y, _, _ = digits
    train, tx = (x[:1000], y[:1000]), lambda: optax.adam(3e-3)
    common = dict(loss_fn=loss_fn, batch_size=BATCH, num_epochs=5, mesh=one_device_mesh)
    at_peak, _ = fit(make_state(MLP(), tx()), train, max_steps=PEAK, workdir=str(tmp_path / "p"),
                     **common, **QUIET)
    xb = x[1000:1170]  # (170 rows: eval batches of 60, 60, 50)
    test = (xb, np.asarray(_predict(jax.device_get(at_peak.params), xb), np.int32))

    capture, stopper = Capture("eval"), EarlyStopping(patience=2)
    state, history = fit(make_state(MLP(), tx()), train, test, eval_step=eval_step,
                         eval_metrics={"macro_f1": macro_f1}, monitor="eval/macro_f1",
                         eval_every=EVERY, max_steps=60, workdir=str(tmp_path / "run"),
                         hooks=[capture, stopper], verbose=0, **common)
    f1s = history["eval/macro_f1"]
    assert history["eval/step"] == [5, 10, 15, 20, 25, 30], history["eval/step"]  # stopped at 30
    assert f1s[3] == 1.0 and max(f1s[:3] + f1s[4:]) < 1.0, f1s
    # Compute first: the hooks saw the values the history holds (and EarlyStopping's rank).
    assert [m["eval/macro_f1"] for _, _, m in capture.seen["eval"]] == f1s
    assert [m["eval/accuracy"] for _, _, m in capture.seen["eval"]] == history["eval/accuracy"]
    # The best checkpoint and EarlyStopping's restored state: the eval of step PEAK.
    peak_params = capture.params_at("eval", PEAK)
    best = load_ckpt(make_state(MLP(), tx()), history.ckpt_dir, "best")
    assert int(best.step) == PEAK
    assert_same_params(best.params, peak_params)
    assert int(state.step) == PEAK
    assert_same_params(state.params, peak_params)
    # TensorBoard: eval/macro_f1 at every eval, best/eval/macro_f1 its running maximum.
    steps = history["eval/step"]
    running = list(np.maximum.accumulate(f1s))
    np.testing.assert_allclose([v for _, v in scalars(history.log_dir, "eval/macro_f1")], f1s,
                               rtol=1e-6)
    best_tb = scalars(history.log_dir, "best/eval/macro_f1")
    assert [s for s, _ in best_tb] == steps, best_tb
    np.testing.assert_allclose([v for _, v in best_tb], running, rtol=1e-6)
    # evaluate() computes the Python metric as well: the restored best state scores 1.0.
    out = evaluate(state, test, eval_step, eval_metrics={"macro_f1": macro_f1},
                   batch_size=BATCH, mesh=one_device_mesh)
    assert out["macro_f1"] == 1.0 and set(out) == {"accuracy", "macro_f1"}, out


def test_a_typo_in_a_python_metric_monitor_is_refused_before_any_work(
        digits, one_device_mesh, tmp_path):
    """`monitor="eval/macro_f2"` where the run has `eval/macro_f1`: a ValueError naming the
    metrics and the near match, before any directory is made or any eval function runs."""
    x, y, xt, yt = digits
    calls = []
    workdir = tmp_path / "typo"
    with pytest.raises(ValueError) as info:
        fit(make_state(MLP()), (x[:120], y[:120]), (xt[:60], yt[:60]), loss_fn=loss_fn,
            eval_step=eval_step, eval_metrics={"macro_f1": lambda s, b: calls.append(1) or 0.0},
            monitor="eval/macro_f2", batch_size=60, mesh=one_device_mesh, workdir=str(workdir),
            **QUIET)
    message = str(info.value)
    assert "monitor='eval/macro_f2' is not a metric of this run" in message, message
    assert "'eval/macro_f1'" in message and "Did you mean 'eval/macro_f1'?" in message, message
    assert not workdir.exists() and calls == []


def test_python_metrics_run_for_every_named_set_and_for_the_average(
        digits, one_device_mesh, tmp_path):
    """Named eval sets and `fit.ema`: the fn runs once for each set and each of `eval`,
    `eval_ema`, getting that set's batches (numpy, as eval_step gets them: 60 + 40 rows for `a`,
    50 for `b`) and the state evaluated (the average's params for `eval_ema/`): an accuracy
    computed in numpy equals eval_step's, tag by tag, `eval[_ema]/<set>/<name>`."""
    import fit as fit_module
    x, y, xt, yt = digits
    shapes = []

    def numpy_accuracy(state, batches):
        hits = []
        for bx, by in batches:
            assert isinstance(bx, np.ndarray) and isinstance(by, np.ndarray)
            shapes.append(len(bx))
            logits = state.apply_fn({"params": state.params}, bx, train=False)
            hits.append(np.asarray(logits).argmax(-1) == by)
        return np.concatenate(hits).mean()

    _, history = fit(make_state(MLP(), fit_module.ema(optax.adam(3e-3), decay=0.9)),
                     (x[:240], y[:240]), {"a": (xt[:100], yt[:100]), "b": (xt[100:150],
                                                                          yt[100:150])},
                     loss_fn=loss_fn, eval_step=eval_step,
                     eval_metrics={"numpy_accuracy": numpy_accuracy}, batch_size=60, num_epochs=2,
                     mesh=one_device_mesh, workdir=str(tmp_path), **QUIET)
    assert shapes == [60, 40, 50] * 4  # (2 evals x (eval, eval_ema) x (a, b))
    for part in ("eval", "eval_ema"):
        for name in ("a", "b"):
            np.testing.assert_allclose(history[f"{part}/{name}/numpy_accuracy"],
                                       history[f"{part}/{name}/accuracy"], rtol=1e-6)
    assert history["eval/a/numpy_accuracy"] != history["eval_ema/a/numpy_accuracy"]


def test_an_nnx_models_python_metric_gets_the_model_in_eval_mode(digits, tmp_path):
    """An nnx model with Dropout: `eval_metrics`' fn gets the nnx model (as `eval_step` does), in
    eval mode (Dropout deterministic: two calls give the same outputs), with the trained
    weights (its accuracy is eval_step's)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(nnx.relu(self.a(x.reshape(x.shape[0], -1)))))

    def nnx_eval_step(model, batch):
        x, y = batch
        return (model(x).argmax(-1) == y).mean()

    seen = []

    def nnx_accuracy(model, batches):
        seen.append((type(model), model.drop.deterministic))
        hits = []
        for bx, by in batches:
            first, second = np.asarray(model(bx)), np.asarray(model(bx))
            np.testing.assert_array_equal(first, second)  # (no dropout)
            hits.append(first.argmax(-1) == by)
        return np.concatenate(hits).mean()

    x, y, xt, yt = digits
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    _, history = fit(model, (x[:240], y[:240]), (xt[:100], yt[:100]), optimizer=optimizer,
                     loss_fn=loss_fn, eval_step=nnx_eval_step,
                     eval_metrics={"nnx_accuracy": nnx_accuracy}, batch_size=60, num_epochs=2,
                     mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                     workdir=str(tmp_path), **QUIET)
    assert seen == [(Net, True)] * 2
    np.testing.assert_allclose(history["eval/nnx_accuracy"], history["eval/accuracy"], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# 2. Two processes: each computes its own value; process 0's holds for all

def test_two_processes_record_and_rank_by_process_0s_python_metric(tmp_path):
    """Two processes x 2 CPU devices (tests/_multihost_child.py, scenario `python_metric`), the
    monitor an eval metric computed in Python on each process's own eval rows, plus 0.01 *
    process_index: the processes compute different values, but both record process 0's, follow
    the same best (`run.best` after each eval), and the checkpoint they wrote together as the best
    is the step of process 0's best value (of equal ones, the later)."""
    from test_multihost import Group, _child_module, _ok
    group = Group("python_metric", ["python_metric"], 2, 240, str(tmp_path))
    try:
        results = group.results("python_metric")
        _ok(results, group)
        assert group.finish() == [0, 0]
    finally:
        group.kill()
    (p0, p1) = results
    mine = p0["computed"]
    assert len(mine) == 3 and len(p1["computed"]) == 3  # (one eval an epoch)
    # The processes' own values differ (other rows, +0.01), but both record process 0's.
    assert all(a != b for a, b in zip(mine, p1["computed"])), (mine, p1["computed"])
    assert p0["history"]["eval/shifted"] == mine == p1["history"]["eval/shifted"]
    assert p0["history"] == p1["history"]
    assert p0["bests"] == p1["bests"] == list(np.maximum.accumulate(mine))
    # The best checkpoint (written by both, restored here in one process): process 0's best.
    best_step = max(s for s, v in zip(p0["history"]["eval/step"], mine) if v == max(mine))
    restored = load_ckpt(_child_module().make_state(), p0["ckpt_dir"], "best")
    assert int(restored.step) == best_step


# ----------------------------------------------------------------------------------------------
# 3. Compute first, decide second: run.metrics is read-only to hooks, and floats only

def assign_metrics(event, run):
    if event == "log":
        run.metrics = {**run.metrics, "train/extra": 1.0}


def mutate_metrics(event, run):
    if event in ("eval", "epoch_end"):
        run.metrics["eval/extra"] = 1.0


@pytest.mark.parametrize("hook, event", [(assign_metrics, "log"), (mutate_metrics, "eval")])
def test_a_hook_that_changes_run_metrics_raises_naming_itself_and_the_event(
        hook, event, digits, one_device_mesh, tmp_path):
    """Assigning `run.metrics` (at `log`) or writing into it (at `eval`; `mutate_metrics` would
    do so at `epoch_end` too, but the eval comes first as eval_every=2 falls on the epoch's end)
    raises a ValueError naming the hook and the event: fit has already logged, recorded and
    ranked those values, so a change would be silently lost to some of them. Before #39 the
    change went through."""
    x, y, xt, yt = digits
    with pytest.raises(ValueError, match=rf"fit: hook {hook.__name__} changed run.metrics at "
                                         rf"'{event}'.*eval_metrics="):
        fit(make_state(MLP()), (x[:120], y[:120]), (xt[:60], yt[:60]), loss_fn=loss_fn,
            eval_step=eval_step, batch_size=60, eval_every=2, log_every=1, num_epochs=1,
            mesh=one_device_mesh, workdir=str(tmp_path), hooks=[hook], **QUIET)


def test_mutating_run_metrics_at_epoch_end_raises(digits, one_device_mesh, tmp_path):
    """The same at `epoch_end` (no eval set, so nothing comes before it)."""
    x, y, _, _ = digits
    with pytest.raises(ValueError, match=r"hook mutate_metrics changed run.metrics at "
                                         r"'epoch_end'"):
        fit(make_state(MLP()), (x[:120], y[:120]), loss_fn=loss_fn, batch_size=60,
            mesh=one_device_mesh, workdir=str(tmp_path), hooks=[mutate_metrics], **QUIET)


def test_run_metrics_are_floats_that_json_dumps_in_every_hook(digits, one_device_mesh, tmp_path):
    """A hook that sends `json.dumps(run.metrics)` somewhere at log, eval and epoch_end: every
    value is a Python float, also the one of an eval_metrics fn that returns a numpy float32 (a
    median of per-example scores, which no per-batch mean gives), and those of `train/lr`."""
    x, y, xt, yt = digits

    def median_confidence(state, batches):  # the median of each example's top probability
        probs = [jax.nn.softmax(state.apply_fn({"params": state.params}, bx, train=False))
                 for bx, _ in batches]
        return np.median(np.concatenate([np.asarray(p).max(-1) for p in probs])).astype(
            np.float32)

    dumped = []

    def to_json(event, run):
        if event in ("log", "eval", "epoch_end"):
            assert all(type(v) is float for v in run.metrics.values()), (event, run.metrics)
            dumped.append((event, json.loads(json.dumps(run.metrics))))

    _, history = fit(make_state(MLP()), (x[:120], y[:120]), (xt[:60], yt[:60]), loss_fn=loss_fn,
                     eval_step=eval_step, eval_metrics={"median_confidence": median_confidence},
                     monitor="eval/accuracy", batch_size=60, log_every=1, num_epochs=2,
                     lr_fn=lambda step: 1e-3, mesh=one_device_mesh, workdir=str(tmp_path),
                     hooks=[to_json], **QUIET)
    assert {e for e, _ in dumped} == {"log", "eval", "epoch_end"}
    evals = [m for e, m in dumped if e == "eval"]
    assert [m["eval/median_confidence"] for m in evals] == history["eval/median_confidence"]
    assert any("train/lr" in m for e, m in dumped if e == "log")


# ----------------------------------------------------------------------------------------------
# 4. One best that loads: a train monitor, and ties

def scripted_train_step(losses):
    """A real SGD step on the MLP whose logged `loss` is `losses[step]`: the epochs' means, hence
    the best epoch, are chosen by the test while the parameters change every step."""
    table = jnp.asarray(losses, jnp.float32)

    def train_step(state, batch):
        x, y = batch

        def loss(params):
            logits = state.apply_fn({"params": params}, x, train=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        new_state = state.apply_gradients(grads=jax.grad(loss)(state.params))
        return new_state, {"loss": table[state.step]}
    return train_step


@pytest.mark.parametrize("means, best_epoch", [
    ([3.0, 1.0, 2.0, 2.5, 2.75], 2),  # one best, the second epoch of five
    ([3.0, 1.0, 1.0, 2.5, 2.75], 3),  # a tie: the later of the equal epochs
])
def test_a_train_monitors_best_epoch_is_checkpointed_and_loads(
        means, best_epoch, digits, one_device_mesh, tmp_path):
    """No test set, `monitor="train/loss"`: judged on epochs' means. 4 steps an epoch, the
    per-step losses scripted so the best mean is that of epoch `best_epoch` (neither the last
    epoch nor a step any other rule saves: no ckpt_every, ckpt_interval not reached). Its end is
    checkpointed, and `load_ckpt(..., "best")` gives the state the `epoch_end` hook saw there.
    Before #39 that step was never saved: "step N is not in ...". With a tie the later epoch is
    the best."""
    x, y, _, _ = digits
    per_step = [m + d for m in means for d in (-0.5, 0.5, 0.25, -0.25)]  # (exact in float32)
    capture, monitors = Capture("epoch_end"), []
    state, history = fit(make_state(MLP(), optax.sgd(0.1)), (x[:200], y[:200]),
                         train_step=scripted_train_step(per_step), batch_size=50,
                         num_epochs=len(means), mesh=one_device_mesh, workdir=str(tmp_path),
                         monitor="train/loss",
                         hooks=[capture, lambda e, run: monitors.append(run.monitor)], **QUIET)
    assert set(monitors) == {"train/loss"}
    np.testing.assert_allclose(history["train/loss"], means)
    step = 4 * best_epoch
    assert history["step"][best_epoch - 1] == step
    assert int(state.step) == 4 * len(means)
    best = load_ckpt(make_state(MLP(), optax.sgd(0.1)), history.ckpt_dir, "best")
    assert int(best.step) == step
    assert_same_params(best.params, capture.params_at("epoch_end", step))


def test_early_stopping_on_a_train_monitor_returns_the_best_epochs_state(
        digits, one_device_mesh, tmp_path):
    """The same scripted epochs (best: the second of five) with EarlyStopping(patience=2): it
    stops at the end of epoch 4 (two epochs without improvement) and returns the state of epoch
    2's end, as the `epoch_end` hook saw it. Before #39 its restore raised: no such checkpoint."""
    x, y, _, _ = digits
    per_step = [m + d for m in [3.0, 1.0, 2.0, 2.5, 2.75] for d in (-0.5, 0.5, 0.25, -0.25)]
    capture, stopper = Capture("epoch_end"), EarlyStopping(patience=2)
    state, history = fit(make_state(MLP(), optax.sgd(0.1)), (x[:200], y[:200]),
                         train_step=scripted_train_step(per_step), batch_size=50, num_epochs=5,
                         mesh=one_device_mesh, workdir=str(tmp_path), hooks=[capture, stopper],
                         monitor="train/loss", **QUIET)
    assert history["step"] == [4, 8, 12, 16] and stopper.get_state()["bad"] == 2
    assert int(state.step) == 8
    assert_same_params(state.params, capture.params_at("epoch_end", 8))


def test_of_equal_evals_the_later_is_the_best_and_early_stopping_counts_a_tie(
        digits, one_device_mesh, tmp_path):
    """An eval metric scripted to 0.5, 0.7, 0.7, 0.6 over four evals (one an epoch): the best
    checkpoint is the state of the third eval (the later 0.7), and EarlyStopping's count after
    each eval is 0, 0, 1, 2 (a tie is no improvement)."""
    x, y, xt, yt = digits
    script, calls = [0.5, 0.7, 0.7, 0.6], []

    def score(state, batches):
        calls.append(len(list(batches)))  # (one pass of the eval set's 2 batches)
        return script[len(calls) - 1]

    stopper, bad = EarlyStopping(patience=5), []
    capture = Capture("eval")
    _, history = fit(make_state(MLP()), (x[:200], y[:200]), (xt[:100], yt[:100]),
                     loss_fn=loss_fn, eval_step=eval_step, eval_metrics={"score": score},
                     monitor="eval/score", batch_size=50, num_epochs=4, mesh=one_device_mesh,
                     workdir=str(tmp_path), **QUIET, hooks=[
                         capture, stopper, lambda e, run: e == "eval" and bad.append(
                             stopper.get_state()["bad"])])
    assert history["eval/score"] == script and history["eval/step"] == [4, 8, 12, 16]
    assert calls == [2, 2, 2, 2]
    assert bad == [0, 0, 1, 2]
    best = load_ckpt(make_state(MLP()), history.ckpt_dir, "best")
    assert int(best.step) == 12
    assert_same_params(best.params, capture.params_at("eval", 12))


# ----------------------------------------------------------------------------------------------
# 5. The default monitor without a loss and without an eval set; no metric at all

def gan_like_step(state, batch):
    """A train step returning `{"d_loss", "g_loss"}` and no `loss`."""
    inputs, labels = batch

    def loss(params):
        logits = state.apply_fn({"params": params}, inputs, train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"d_loss": value, "g_loss": -value}


def test_without_an_eval_set_a_named_train_metric_is_the_monitor(
        digits, one_device_mesh, tmp_path):
    """A GAN-like train_step returning `{"d_loss", "g_loss"}` and no test set: without `monitor=`
    the run keeps no best (#48); with `monitor="train/d_loss"` it follows that metric (mode "min"
    from its name), both metrics are in the history, and the best loads. Before #39 the default
    `train/loss` was refused as not a metric of the run."""
    x, y, _, _ = digits
    seen = []
    kwargs = dict(train_step=gan_like_step, batch_size=50, num_epochs=2, mesh=one_device_mesh,
                  hooks=[lambda e, run: seen.append((run.monitor, run.mode))], **QUIET)
    fit(make_state(MLP()), (x[:200], y[:200]), workdir=str(tmp_path / "a"), **kwargs)
    assert set(seen) == {(None, None)}
    seen.clear()
    state, history = fit(make_state(MLP()), (x[:200], y[:200]), workdir=str(tmp_path / "b"),
                         monitor="train/d_loss", **kwargs)
    assert set(seen) == {("train/d_loss", "min")}
    assert len(history["train/d_loss"]) == len(history["train/g_loss"]) == 2
    np.testing.assert_allclose(history["train/g_loss"], -np.asarray(history["train/d_loss"]))
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir, "best").step) in (4, 8)


def test_without_an_eval_set_or_monitor_a_run_saves_on_its_periods_alone(
        digits, one_device_mesh, tmp_path):
    """#48: the scripted epochs (best: the second of five), no eval set. Without `monitor=`: no
    save at any epoch's end (only the final one; ckpt_interval not reached), the run says it
    keeps no best, and `load_ckpt(..., "best")` raises, naming `monitor='train/loss'`. The same
    run with `monitor="train/loss"` saves the epoch ends that enter the kept best (steps 4, 8)
    and the final one, and its best loads. (Before #48 the first run saved at 4 and 8 too.)"""
    x, y, _, _ = digits
    per_step = [m + d for m in [3.0, 1.0, 2.0, 2.5, 2.75] for d in (-0.5, 0.5, 0.25, -0.25)]
    saves = []
    kwargs = dict(train_step=scripted_train_step(per_step), batch_size=50, num_epochs=5,
                  mesh=one_device_mesh, **QUIET,
                  hooks=[lambda e, run: e == "save" and saves.append(run.step)])
    _, history = fit(make_state(MLP(), optax.sgd(0.1)), (x[:200], y[:200]),
                     workdir=str(tmp_path / "a"), **kwargs)
    assert saves == [20], saves
    with pytest.raises(ValueError, match=r"has no best checkpoint: its run kept none .* "
                                         r"monitor='train/loss'"):
        load_ckpt(make_state(MLP(), optax.sgd(0.1)), history.ckpt_dir, "best")
    saves.clear()
    _, history = fit(make_state(MLP(), optax.sgd(0.1)), (x[:200], y[:200]),
                     workdir=str(tmp_path / "b"), monitor="train/loss", **kwargs)
    assert saves == [4, 8, 20], saves
    assert int(load_ckpt(make_state(MLP(), optax.sgd(0.1)), history.ckpt_dir, "best").step) == 8


def test_early_stopping_without_a_metric_to_follow_raises_before_any_step(
        digits, one_device_mesh, tmp_path):
    """#48: EarlyStopping() on a run without an eval set and without `monitor=` raises a
    ValueError naming the fix (monitor='train/loss') at train_start, before any step runs."""
    x, y, _, _ = digits
    events = []
    with pytest.raises(ValueError, match=r"EarlyStopping: this run follows no metric: .* "
                                         r"monitor='train/loss'"):
        fit(make_state(MLP()), (x[:200], y[:200]), loss_fn=loss_fn, batch_size=50,
            mesh=one_device_mesh, workdir=str(tmp_path), **QUIET,
            hooks=[lambda e, run: events.append(e), EarlyStopping()])
    assert events == ["train_start"], events


def test_a_train_step_without_metrics_trains(digits, one_device_mesh, tmp_path):
    """A train_step returning no metrics (`{}`): the run trains, with no monitor and no best, and
    its last checkpoint loads."""
    x, y, _, _ = digits

    def train_step(state, batch):
        inputs, labels = batch

        def loss(params):
            logits = state.apply_fn({"params": params}, inputs, train=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return state.apply_gradients(grads=jax.grad(loss)(state.params)), {}

    seen, start = [], make_state(MLP())
    state, history = fit(start, (x[:200], y[:200]), train_step=train_step, batch_size=50,
                         num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path),
                         hooks=[lambda e, run: seen.append((run.monitor, run.best))], **QUIET)
    assert int(state.step) == 8 and history["step"] == [4, 8]
    assert set(seen) == {(None, None)}
    assert not np.array_equal(flat(state.params), flat(start.params))
    last = load_ckpt(make_state(MLP()), history.ckpt_dir)
    assert int(last.step) == 8
    assert_same_params(last.params, state.params)
    with pytest.raises(ValueError, match="no best checkpoint"):  # (not the last, silently)
        load_ckpt(make_state(MLP()), history.ckpt_dir, "best")


# ----------------------------------------------------------------------------------------------
# 6. One edit adds a per-step quantity to the train sums

def test_one_edit_in_step_values_logs_a_new_per_step_quantity(
        digits, one_device_mesh, tmp_path, monkeypatch):
    """The one line of `_step_values` changed to add each batch's row count: `train/rows` reaches
    the `log` hooks (log_every=1: each step's own count, 50, 50, 30 for 130 rows in batches of
    50) and the history (each epoch's mean, 130 / 3), with nothing else edited."""
    edited = edited_fit(tmp_path, monkeypatch, (
        '    return new_state, _as_dict(metrics, "loss")\n',
        '    rows = jnp.float32(jax.tree.leaves(batch)[0].shape[0])\n'
        '    return new_state, {**_as_dict(metrics, "loss"), "rows": rows}\n'))
    x, y, _, _ = digits
    logged = []
    state = edited.TrainState.create(apply_fn=MLP().apply, params=make_state(MLP()).params,
                                     tx=optax.adam(1e-3))
    _, history = edited.fit(state, (x[:130], y[:130]), loss_fn=loss_fn, batch_size=50,
                            num_epochs=2, log_every=1, mesh=one_device_mesh,
                            workdir=str(tmp_path / "w"), **QUIET, hooks=[
                                lambda e, run: e == "log" and logged.append(
                                    (run.step, run.metrics["train/rows"]))])
    assert logged == [(1, 50.0), (2, 50.0), (3, 30.0), (4, 50.0), (5, 50.0), (6, 30.0)]
    np.testing.assert_allclose(history["train/rows"], [130 / 3] * 2, rtol=1e-6)
    assert len(history["train/loss"]) == 2  # (the loss is logged as before)


# ----------------------------------------------------------------------------------------------
# 7. Guard: the compiled steps are no larger than before #39 with scalar metrics

class PlainCNN(nn.Module):
    """A CNN without BatchNorm and Dropout."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def hlo_counts(fm, model):
    """Optimized HLO instructions of `fm`'s compiled train step and eval step for `model` on one
    device, conftest's scalar `loss_fn` (loss, accuracy) and `eval_step` (accuracy)."""
    return tuple(len(program) for program in _programs(fm, model))


def test_compiled_steps_have_as_many_hlo_instructions_as_before(
        one_device_mesh, tmp_path, monkeypatch):
    """A guard, passing before and after #39: the layouts of the train and eval sums moved into
    `_TrainSums` and `_EvalSums` (and the eval step now also returns the host-merged states, none
    here), which must cost no device work when only scalar metrics are used. Counted for
    conftest's CNN (BatchNorm, Dropout), a plain CNN and the MLP on one device."""
    import fit as new
    old = fit_at(OLD, tmp_path, monkeypatch)
    for model in (CNN(), PlainCNN(), MLP()):
        before, after = hlo_counts(old, model), hlo_counts(new, model)
        assert after == before, (type(model).__name__, "(train, eval) now", after, "before",
                                 before)
