"""#31: test_ds as a dict of named eval sets, each exact and each a possible monitor.

Two sets on 4 simulated devices, both with a ragged last batch that runs whole on every device:
`a` is held-out digits (its accuracy grows), `b` is other digits labelled by the model of step 20
of the same run (its accuracy peaks at step 20, then falls), so the two peak at different steps.
"""
import logging

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fit as fit_module
from conftest import MLP, CompileLog, eval_step, loss_fn, make_state
from fit import EarlyStopping, evaluate, fit, load_ckpt

BATCH, EVERY, STEPS, PEAK = 60, 5, 40, 20


def tx():
    return optax.adam(3e-3)


@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


@pytest.fixture(scope="module")
def sets(digits, mesh4, tmp_path_factory):
    """train (x, y); sets a (250 rows: last batch 10) and b (170 rows: last batch 50)."""
    x, y, xt, yt = digits
    train = (x[:1000], y[:1000])
    at_peak, _ = fit(make_state(MLP(), tx()), train, loss_fn=loss_fn, batch_size=BATCH,
                     max_steps=PEAK, num_epochs=5, mesh=mesh4, verbose=0, tensorboard=False,
                     workdir=str(tmp_path_factory.mktemp("peak")))
    xb = x[1000:1170]
    yb = np.asarray(predict(jax.device_get(at_peak.params), xb).argmax(-1), np.int32)
    return train, {"a": (xt[:250], yt[:250]), "b": (xb, yb)}


def predict(params, x):
    return MLP().apply({"params": params}, x, train=False)


def hand_accuracy(params, data):
    x, y = data
    return float(np.mean(np.asarray(predict(params, x).argmax(-1)) == y))


class Capture:
    """An eval hook keeping each eval's step, params and metrics."""

    def __init__(self):
        self.evals = []

    def __call__(self, event, run):
        if event == "eval":
            self.evals.append((run.step, jax.device_get(run.state.params), dict(run.metrics)))


def run(sets, mesh4, workdir, **options):
    train, test = sets
    kwargs = dict(loss_fn=loss_fn, eval_step=eval_step, batch_size=BATCH, eval_every=EVERY,
                  max_steps=STEPS, num_epochs=5, mesh=mesh4, verbose=0, tensorboard=False,
                  workdir=str(workdir), log_name="sets")
    return fit(make_state(MLP(), tx()), train, test, **{**kwargs, **options})


def best_step(history, key, mode=max):
    """The step of the best value in the eval rows (a tie: the later, as fit keeps it)."""
    values = history[key]
    best = mode(values)
    return max(s for s, v in zip(history["eval/step"], values) if v == best)


@pytest.fixture(scope="module")
def monitored(sets, mesh4, tmp_path_factory):
    """One uninterrupted run monitoring the second set; its evals captured, its compiles counted."""
    capture, compiles = Capture(), CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    try:
        with jax.log_compiles():
            state, history = run(sets, mesh4, tmp_path_factory.mktemp("monitored"),
                                 monitor="eval/b/accuracy", hooks=[capture])
    finally:
        logger.removeHandler(compiles)
    return state, history, capture, compiles.count("_eval_and_accumulate")


def test_each_set_is_exact_and_logged_by_name(monitored, sets):
    _, history, capture, _ = monitored
    assert "eval/accuracy" not in history
    assert history["eval/step"] == list(range(EVERY, STEPS + 1, EVERY))
    assert len(capture.evals) == len(history["eval/step"])
    for i, (step, params, metrics) in enumerate(capture.evals):
        assert set(metrics) == {"eval/a/accuracy", "eval/b/accuracy"}
        for name, data in sets[1].items():
            hand = hand_accuracy(params, data)
            assert metrics[f"eval/{name}/accuracy"] == pytest.approx(hand, abs=1e-6), (step, name)
            assert history[f"eval/{name}/accuracy"][i] == metrics[f"eval/{name}/accuracy"]
    # The sets were built to peak apart: b at the step that labelled it, a later.
    assert best_step(history, "eval/b/accuracy") == PEAK
    assert best_step(history, "eval/a/accuracy") > PEAK


def test_the_monitor_may_be_the_second_set(monitored, mesh4):
    _, history, _, _ = monitored
    best = load_ckpt(make_state(MLP(), tx()), history.ckpt_dir, "best")
    assert int(best.step) == best_step(history, "eval/b/accuracy") == PEAK


def test_each_set_compiles_once_and_sets_of_one_kind_share_the_step(monitored):
    # Eval batch shapes: 60 rows (both sets), 10 (a's last), 50 (b's last): three compiles over
    # eight evals; a step per set would compile 60 twice.
    assert monitored[3] == 3


def test_evaluate_with_a_dict_equals_the_last_eval(monitored, sets, mesh4):
    state, history, _, _ = monitored
    out = evaluate(state, sets[1], eval_step, batch_size=BATCH, mesh=mesh4)
    assert set(out) == {"a", "b"}
    for name in ("a", "b"):
        assert out[name] == {"accuracy": pytest.approx(history[f"eval/{name}/accuracy"][-1],
                                                       abs=1e-7)}
    one = evaluate(state, sets[1]["a"], eval_step, batch_size=BATCH, mesh=mesh4)
    assert one == {"accuracy": pytest.approx(out["a"]["accuracy"], abs=1e-7)}


def test_early_stopping_on_the_second_set_stops_where_its_rows_say(sets, mesh4, tmp_path):
    patience = 2
    state, history = run(sets, mesh4, tmp_path, monitor="eval/b/accuracy",
                         hooks=[EarlyStopping(patience=patience)])
    rows, best, bad, expected = history["eval/b/accuracy"], None, 0, None
    for step, value in zip(history["eval/step"], rows):
        if best is None or value > best:
            best, bad = value, 0
        else:
            bad += 1
            if bad >= patience:
                expected = step
                break
    assert expected is not None and expected < STEPS, rows
    assert history["eval/step"][-1] == expected
    assert history["stopped"][0].endswith(f"at step {expected}"), history["stopped"]
    assert int(state.step) == PEAK  # restore_best: the second set's best


def test_a_run_cut_by_max_steps_and_resumed_has_the_uninterrupted_eval_rows(
        monitored, sets, mesh4, tmp_path):
    _, whole, _, _ = monitored
    run(sets, mesh4, tmp_path, monitor="eval/b/accuracy", max_steps=23)
    _, resumed = run(sets, mesh4, tmp_path, monitor="eval/b/accuracy", resume=True)
    # The cut adds its own eval at step 23 (as a single set's does); every other row is equal.
    cut = resumed["eval/step"].index(23)
    keys = ("eval/step", "eval/epoch", "eval/a/accuracy", "eval/b/accuracy")
    for key in keys:
        rest = resumed[key][:cut] + resumed[key][cut + 1:]
        np.testing.assert_allclose(rest, whole[key], rtol=0, atol=1e-6, err_msg=key)


def test_the_default_monitor_is_the_first_sets_and_the_start_line_says_so(
        sets, mesh4, tmp_path, capfd):
    _, history = run(sets, mesh4, tmp_path, max_steps=10, verbose=2)
    out = capfd.readouterr()
    assert "best by eval/a/accuracy (max)" in out.out + out.err
    best = load_ckpt(make_state(MLP(), tx()), history.ckpt_dir, "best")
    assert int(best.step) == best_step(history, "eval/a/accuracy")


def test_eval_steps_caps_each_set_or_one_by_name(sets, mesh4, tmp_path):
    capture = Capture()
    run(sets, mesh4, tmp_path, max_steps=5, eval_steps={"b": 1}, hooks=[capture])
    (_, params, metrics), = capture.evals
    xb, yb = sets[1]["b"]
    assert metrics["eval/b/accuracy"] == pytest.approx(
        hand_accuracy(params, (xb[:BATCH], yb[:BATCH])), abs=1e-6)
    assert metrics["eval/a/accuracy"] == pytest.approx(hand_accuracy(params, sets[1]["a"]),
                                                       abs=1e-6)
    capture = Capture()
    run(sets, mesh4, tmp_path, max_steps=5, eval_steps=2, hooks=[capture], log_name="two")
    (_, params, metrics), = capture.evals
    for name, (x, y) in sets[1].items():
        assert metrics[f"eval/{name}/accuracy"] == pytest.approx(
            hand_accuracy(params, (x[:2 * BATCH], y[:2 * BATCH])), abs=1e-6)


def test_ema_evals_every_set_and_monitors_any(sets, mesh4, tmp_path):
    train, test = sets
    state = make_state(MLP(), fit_module.ema(tx(), 0.9))
    _, history = fit(state, train, test, loss_fn=loss_fn, eval_step=eval_step, batch_size=BATCH,
                     eval_every=EVERY, max_steps=10, mesh=mesh4, verbose=0, tensorboard=False,
                     workdir=str(tmp_path / "ema"), monitor="eval_ema/b/accuracy")
    assert {"eval/a/accuracy", "eval/b/accuracy", "eval_ema/a/accuracy",
            "eval_ema/b/accuracy"} <= set(history)
    averaged = load_ckpt(make_state(MLP(), tx()), history.ckpt_dir, "last", weights_only=True,
                         ema=True)
    assert history["eval_ema/b/accuracy"][-1] == pytest.approx(
        hand_accuracy(jax.device_get(averaged.params), test["b"]), abs=1e-6)


def one_shot(data):
    x, y = data
    return ((x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH))


@pytest.mark.parametrize("case", ["empty dict", "dict of arrays", "bad name", "unknown cap",
                                  "dict cap, one set", "bad cap", "empty set", "one-shot set",
                                  "unknown monitor"])
def test_each_named_set_is_checked_before_any_work(case, sets, mesh4, tmp_path):
    train, test = sets
    a, b = test["a"], test["b"]
    given, options, message = {
        "empty dict": ({}, {}, "got an empty dict"),
        "dict of arrays": ({"x": a[0], "y": a[1]}, {}, "a dict of arrays ['x', 'y']. For one set "
                                                      "of arrays, pass (x, y)"),
        "bad name": ({"a": a, "in/out": b}, {}, "got ['in/out']"),
        "unknown cap": ({"a": a, "b": b}, {"eval_steps": {"c": 1}}, "eval_steps by those names; "
                                                                    "got ['c']"),
        "dict cap, one set": (a, {"eval_steps": {"a": 1}}, "eval_steps is a dict by eval set, "
                                                           "but test_ds is one set"),
        "bad cap": ({"a": a, "b": b}, {"eval_steps": {"a": 0}}, "eval_steps must be a positive "
                                                                "integer, or a dict"),
        "empty set": ({"a": a, "b": []}, {}, "test_ds['b'] is empty"),
        "one-shot set": ({"a": a, "b": one_shot(b)}, {}, "test_ds['b'] is a one-shot iterator"),
        "unknown monitor": ({"a": a, "b": b}, {"monitor": "eval/c/accuracy"},
                            "'eval/a/accuracy', 'eval/b/accuracy'"),
    }[case]
    with pytest.raises((ValueError, TypeError)) as info:
        fit(make_state(MLP(), tx()), train, given, loss_fn=loss_fn, eval_step=eval_step,
            batch_size=BATCH, num_epochs=2, mesh=mesh4, verbose=0, workdir=str(tmp_path),
            **options)
    assert message in str(info.value), str(info.value)
    assert not (tmp_path / "checkpoints").exists()  # raised before the run was opened


def test_evaluate_names_the_set(sets, mesh4):
    with pytest.raises(ValueError, match=r"ds\['b'\] is empty"):
        evaluate(make_state(MLP(), tx()), {"a": sets[1]["a"], "b": []}, eval_step,
                 batch_size=BATCH, mesh=mesh4)


def test_the_processes_agree_on_every_named_set(sets, monkeypatch):
    """With several processes, each set is in the table they compare (_agree): arrays by their
    size and a hash of their rows (#40: every process passes the same arrays)."""
    train, test = sets
    opts = fit_module.Options(batch_size=BATCH)
    said = []
    monkeypatch.setattr(fit_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(fit_module, "_agree", lambda text, what: said.append(text))
    fit_module._check_data(fit_module._Data(train, "train_ds", opts, train=True),
                           fit_module._eval_sets(test, "test_ds", opts), opts,
                           Mesh(np.array(jax.devices()[:1]), ("data",)))
    assert "test_ds['a']: arrays of 250 rows (hash " in said[0], said
    assert "test_ds['b']: arrays of 170 rows (hash " in said[0], said
