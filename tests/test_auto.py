"""#49: steps_per_jit="auto", the default: single steps, timed at log points; where the host is the
bottleneck, k steps a call, within the log, eval and save periods, with the results and the
hooks' events of single steps; the rule that decides, fed measured times; arrays gathered once a
call. Speed itself is measured by benchmarks/bench.py (the null-model table), never here."""
import collections
import warnings

import jax
import numpy as np
import optax
import pytest

import fit as fit_module
from conftest import CNN, MLP, eval_step, loss_fn, make_state, nnx_arrays, nnx_mlp
from fit import fit

COMMON = dict(verbose=0, tensorboard=False)
rule = lambda *args, **kwargs: fit_module._steps_per_call(*args, **kwargs)  # (the real one)


@pytest.fixture
def host_bound(monkeypatch):
    """Every window of steady steps is one log interval (`_WINDOW` 0), and the rule is fed times
    that say the host is the bottleneck (single steps 1 ms, k-step calls' steps 0.1 ms): the
    real rule then picks k from the periods. Records what fit measured and passed to it."""
    seen, real = [], getattr(fit_module, "_steps_per_call", None)

    def measured(timed, waited, compile_s, left, periods, *, unroll=False):
        seen.append((dict(timed), waited, compile_s, left, tuple(periods), unroll))
        fake = {k: 1e-3 if k == 1 else 1e-4 for k in timed}
        return real(fake, 0.0, 0.0, None, periods)  # (unroll aside: a CNN groups too)
    monkeypatch.setattr(fit_module, "_WINDOW", 0.0, raising=False)
    monkeypatch.setattr(fit_module, "_steps_per_call", measured, raising=False)
    return seen


@pytest.fixture
def calls(monkeypatch):
    """The steps of every train call fit makes (1, or k)."""
    made, real = [], fit_module._Dispatch.__call__

    def call(self, state, batch, k, **kwargs):
        made.append(k)
        return real(self, state, batch, k, **kwargs)
    monkeypatch.setattr(fit_module._Dispatch, "__call__", call)
    return made


def _leaves(state):
    tree = jax.device_get((state.params, state.batch_stats, state.opt_state, state.step))
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _events():
    events = []

    def hook(event, run):
        if event != "train_start":
            events.append((event, run.step))
    return events, hook


# -- The rule, fed measured times -------------------------------------------------------------------

def test_the_rule_groups_where_the_host_is_the_bottleneck_and_keeps_the_periods_exact():
    periods = [50]  # log_every's default alone: k divides 50, at most 16
    assert rule({1: 25e-6}, 0.0, 0.3, 10 ** 6, periods) == 10
    assert rule({1: 25e-6}, 0.05, 0.3, None, [64, 128]) == 16  # (left unknown: it may pay)
    assert rule({1: 25e-6}, 0.0, 0.3, 10 ** 6, [50, 300, 12]) == 2  # log, eval, save periods
    assert rule({1: 25e-6}, 0.0, 0.3, 10 ** 6, [7]) == 7
    assert rule({1: 25e-6}, 0.0, 0.3, 10 ** 6, [1]) == 1  # a log every step: nothing to group


def test_a_compute_bound_model_stays_at_one_step_a_call():
    # The host waited for the device (an accelerator's queue of steps) over 10% of the time:
    # the device is the bottleneck, grouping would gain nothing.
    assert rule({1: 5e-3}, 0.6, 1.0, 10 ** 6, [50]) == 1
    assert rule({1: 5e-3}, 0.11, 1.0, 10 ** 6, [50]) == 1
    # A CPU step with convolutions: k steps would compile unrolled, ~k times a step's compile.
    assert rule({1: 25e-6}, 0.0, 0.3, 10 ** 6, [50], unroll=True) == 1
    # Too few steps left to pay for a compile (left x 25 us < 2 x 0.3 s).
    assert rule({1: 25e-6}, 0.0, 0.3, 20_000, [50]) == 1
    assert rule({1: 25e-6}, 0.0, 0.3, 30_000, [50]) == 10


def test_k_steps_a_call_are_kept_only_if_their_steps_ran_10_percent_faster():
    assert rule({1: 25e-6, 10: 5e-6}, 0.0, 0.3, None, [50]) == 10
    assert rule({1: 25e-6, 10: 23e-6}, 0.0, 0.3, None, [50]) == 1
    assert rule({1: 25e-6, 10: 30e-6}, 0.0, 0.3, None, [50]) == 1


# -- fit's choice: results, events, timing -----------------------------------------------------------

def _run(model, data, tmp_path, name, **options):
    events, hook = _events()
    state, history = fit(model, data, loss_fn=loss_fn, num_epochs=2, log_every=4,
                         workdir=str(tmp_path / name), hooks=[hook], **COMMON, **options)
    return state, history, events


@pytest.mark.parametrize("case", ["mlp", "grad_accum", "cnn_bn_dropout", "nnx"])
def test_auto_groups_a_host_bound_model_with_the_results_and_events_of_single_steps(
        case, digits, tmp_path, one_device_mesh, host_bound, calls):
    x, y, xt, yt = digits
    data, test = (x[:640], y[:640]), (xt[:64], yt[:64])  # 20 steps an epoch of 32 rows
    options = dict(batch_size=32, eval_every=8, ckpt_every=12, mesh=one_device_mesh,
                   test_ds=test, eval_step=eval_step if case != "nnx" else None)  # (nnx: loss)
    if case == "grad_accum":
        options["grad_accum"] = 2
    if case == "nnx":
        from flax import nnx
        make = lambda: (lambda m: (m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))(
            nnx_mlp())
        results = {}
        for k in ("auto", 1):
            model, optimizer = make()
            _, history, events = _run(model, data, tmp_path, str(k), optimizer=optimizer,
                                      steps_per_jit=k, **options)
            results[k] = (nnx_arrays(model, optimizer), history, events)
    else:
        model = CNN() if case == "cnn_bn_dropout" else MLP()
        results = {k: _run(make_state(model), data, tmp_path, str(k), steps_per_jit=k,
                           **options) for k in ("auto", 1)}
    (grouped, history, events), (single, history_1, events_1) = results["auto"], results[1]
    assert 4 in calls and history.timing["steps_per_jit"] == 4, (calls, history.timing)
    assert history_1.timing["steps_per_jit"] == 1
    assert sum(calls) == 2 * 2 * 20  # (both runs, every step)
    # The hooks saw the same events at the same steps: logs, evals, saves, epochs' ends.
    assert events == events_1 and {"log", "eval", "save", "epoch_end"} <= {e for e, _ in events}
    assert history["train/loss"] == history_1["train/loss"]  # (means of the same steps)
    if case == "nnx":
        assert grouped.keys() == single.keys()
        grouped, single = list(grouped.values()), list(single.values())
    else:
        grouped, single = _leaves(grouped), _leaves(single)
    if case != "cnn_bn_dropout":  # a rolled scan of the same step: bit-identical on a CPU
        assert all(np.array_equal(a, b) for a, b in zip(grouped, single))
    else:  # unrolled (convolutions on a CPU): measured 3e-8 apart (BatchNorm's running mean)
        worst = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in
                    zip(grouped, single))
        assert worst <= 1e-6, worst
    # fit measured single steps, then 4-step calls, and passed the rule what it measured.
    (first, *_), (second, *_) = host_bound[:2]
    assert list(first) == [1] and sorted(second) == [1, 4] and first[1] > 0 < second[4]
    assert host_bound[0][4] == (4, 8, 12)  # (log_every, eval_every, ckpt_every)
    assert host_bound[0][5] == (case == "cnn_bn_dropout")  # (convolutions on a CPU: unrolled)


def test_the_choice_and_the_times_are_in_history_timing(digits, tmp_path, one_device_mesh,
                                                        host_bound, capfd):
    x, y, _, _ = digits
    _, history = fit(make_state(MLP()), (x[:640], y[:640]), loss_fn=loss_fn, batch_size=32,
                     num_epochs=2, log_every=5, mesh=one_device_mesh,
                     workdir=str(tmp_path / "auto"), **{**COMMON, "verbose": 2})
    timing = history.timing
    assert timing["steps_per_jit"] == 5 and sorted(timing["steps_per_jit_us"]) == [1, 5]
    assert all(v > 0 for v in timing["steps_per_jit_us"].values()), timing
    said = [line for line in capfd.readouterr().out.splitlines() if "steps_per_jit" in line]
    assert len(said) == 1 and "5 step(s) a call" in said[0], said
    # A pinned k is in timing too; a run too short to be timed stays at 1.
    _, pinned = fit(make_state(MLP()), (x[:640], y[:640]), loss_fn=loss_fn, batch_size=32,
                    steps_per_jit=2, mesh=one_device_mesh, workdir=str(tmp_path / "p"), **COMMON)
    assert pinned.timing["steps_per_jit"] == 2 and pinned.timing["steps_per_jit_us"] == {}


def test_auto_without_a_log_point_after_the_compile_stays_at_one(digits, tmp_path,
                                                                 one_device_mesh, calls):
    x, y, _, _ = digits
    _, history = fit(make_state(MLP()), (x[:640], y[:640]), loss_fn=loss_fn, batch_size=32,
                     mesh=one_device_mesh, workdir=str(tmp_path), **COMMON)  # (log_every 50)
    assert history.timing["steps_per_jit"] == 1 and set(calls) == {1}


def test_auto_is_not_an_option_value_for_other_counts(tmp_path):
    with pytest.raises(ValueError, match=r"steps_per_jit must be 'auto' or a positive integer, "
                                         r"got 'fast'"):
        fit(make_state(MLP()), [(np.zeros((4, 8, 8, 1), np.float32), np.zeros(4, np.int32))],
            loss_fn=loss_fn, steps_per_jit="fast", workdir=str(tmp_path))


# -- Length buckets under auto -----------------------------------------------------------------------

def test_bucketed_batches_group_by_shape_under_auto_and_train_as_single_steps(
        tmp_path, one_device_mesh, host_bound, calls):
    from test_buckets import bag_state, loss_fn as bag_loss, token_batches
    data = token_batches([8] * 8 + [16] * 6 + [8, 16, 8, 16] + [16] * 4)  # runs and alternations
    results = {}
    for k in ("auto", 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, history = fit(bag_state(), data, loss_fn=bag_loss, num_epochs=3, log_every=2,
                                 steps_per_jit=k, mesh=one_device_mesh,
                                 workdir=str(tmp_path / str(k)), **COMMON)
        assert not [w for w in caught if "steps_per_jit" in str(w.message)], k  # (auto: none)
        results[k] = (state, history)
    (grouped, history), (single, history_1) = results["auto"], results[1]
    assert 2 in calls and history.timing["steps_per_jit"] == 2
    assert int(grouped.step) == int(single.step) == 3 * 22
    assert history["train/loss"] == history_1["train/loss"]
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(jax.device_get(grouped.params)),
        jax.tree.leaves(jax.device_get(single.params))))


# -- One gather a call -------------------------------------------------------------------------------

@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "jax.Array"])
def test_a_group_of_k_batches_of_arrays_is_one_gather(on_device, digits, tmp_path,
                                                      one_device_mesh, monkeypatch, calls):
    x, y, _, _ = digits
    data = (x[:640], y[:640])
    gathers, real_arrays, real_take = [], fit_module._Data._arrays, fit_module._take

    def arrays(self, ds, batch_size):  # counts the gathers of numpy arrays' rows
        first = real_arrays(self, ds, batch_size)
        rows = self.rows
        self.rows = lambda idx: (gathers.append(idx.shape), rows(idx))[1]
        return first
    if on_device:  # the rows of jax.Arrays are gathered on their device, by `_take`
        data = jax.tree.map(jax.numpy.asarray, data)
        monkeypatch.setattr(fit_module, "_take", lambda arrays, idx: (
            gathers.append(idx.shape), real_take(arrays, idx))[1])
    else:
        monkeypatch.setattr(fit_module._Data, "_arrays", arrays)
    fit(make_state(MLP()), data, loss_fn=loss_fn, batch_size=32, num_epochs=2, steps_per_jit=5,
        mesh=one_device_mesh, workdir=str(tmp_path), **COMMON)
    # One gather of each call's rows: (k, 32) for a call of k = 5 steps, (32,) for one step.
    assert calls == [5] * 8 and gathers[-8:] == [(5, 32)] * 8, (calls, gathers)
    assert len(gathers) == 8 + on_device  # (on the device, the first batch's too, for its spec)
