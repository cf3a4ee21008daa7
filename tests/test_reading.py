"""#52: the traps of a fresh reading closed, and the step's own quantities reachable without
replacing the step.

1. `step_metrics=fn(step)`: fit's own train step calls it with the gradients, the update, the
   state after it and the batch; its values are logged with the train metrics: a per-layer
   gradient norm (a `grad_norm/...` name: its log step's value), the fraction of clipped
   gradients (a mean), and examples seen (`fit.Total`: the run's running total, exact over a
   resume). Without it the compiled step is unchanged (tests/test_shape.py's HLO guard).
2. The traps (T1-T12 of the issue), each with a test that fails on the file before #52.
"""
import warnings

import numpy as np
import optax
import pytest
from conftest import MLP, eval_step, flat, loss_fn, make_state

import fit
from test_traps import batches, edited_fit

QUIET = dict(verbose=0, tensorboard=False)


# ----------------------------------------------------------------------------------------------
# 1. The step's own quantities

def layer_norms(step):
    """A per-layer gradient norm, the global norm's clipping and the examples seen."""
    rows = step.batch[0].shape[0]
    return {"grad_norm/Dense_0": optax.tree.norm(step.grads["Dense_0"]),
            "update_norm/Dense_0": optax.tree.norm(step.updates["Dense_0"]),
            "clipped": (optax.tree.norm(step.grads) > 1.0).astype(np.float32),
            "examples": fit.Total(np.float32(rows))}


def test_step_metrics_log_a_layers_gradient_norm_and_a_clipped_fraction(tmp_path,
                                                                       one_device_mesh):
    """SGD with rate 0.1 and log_every=1: at every log step `train/grad_norm/Dense_0` is the
    layer's gradient norm, so 10x its update's norm (`update_norm`, a mean over the one-step
    interval); the layers' norms are at most the global `train/grad_norm`; `train/clipped` is a
    fraction in [0, 1]. (The file before #52: step_metrics is an unknown option.)"""
    logged = []
    _, history = fit.fit(make_state(MLP(), optax.sgd(0.1)), batches(6), loss_fn=loss_fn,
                         step_metrics=layer_norms, log_every=1, num_epochs=2,
                         mesh=one_device_mesh, workdir=str(tmp_path), **QUIET,
                         hooks=[lambda e, run: e == "log" and logged.append(dict(run.metrics))])
    assert [len(m) > 0 for m in logged] == [True] * 12
    for m in logged:
        np.testing.assert_allclose(m["train/grad_norm/Dense_0"],
                                   10 * m["train/update_norm/Dense_0"], rtol=1e-4)
        assert 0 < m["train/grad_norm/Dense_0"] <= m["train/grad_norm"] * (1 + 1e-6)
        assert m["train/clipped"] in (0.0, 1.0)
    assert all(0 <= v <= 1 for v in history["train/clipped"])


def test_a_total_counts_examples_seen_exactly_over_a_stop_and_a_resume(tmp_path,
                                                                      one_device_mesh):
    """`fit.Total(rows)` from step_metrics: 3,000 examples in batches of 128 (the last of 56),
    one epoch, stopped by max_steps at step 10 and resumed: every log point shows the examples
    seen since the run began (1,280 at step 10; 3,000 at the end, exactly), and the history's
    epoch rows (the cut one's at step 10, the whole epoch's) hold the totals then. (The file before #52 has no fit.Total.)"""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, 3000).astype(np.int32)
    seen = []
    kwargs = dict(loss_fn=loss_fn, step_metrics=layer_norms, batch_size=128, log_every=5,
                  mesh=one_device_mesh, workdir=str(tmp_path), **QUIET,
                  hooks=[lambda e, run: e == "log" and seen.append(
                      (run.step, run.metrics["train/examples"]))])
    fit.fit(make_state(MLP()), (x, y), max_steps=10, **kwargs)
    _, history = fit.fit(make_state(MLP()), (x, y), resume=True, **kwargs)
    assert seen == [(5, 640.0), (10, 1280.0), (15, 1920.0), (20, 2560.0), (24, 3000.0)], seen
    assert history["step"] == [10, 24] and history["train/examples"] == [1280.0, 3000.0]


def test_a_total_counts_every_devices_rows_under_axis_name_and_comes_from_step_metrics_alone(
        tmp_path, eight_device_mesh):
    """Under `axis_name` the step runs per device and sees its own rows: a Total from
    step_metrics is summed over the devices (all 64 rows of a batch, not one device's 8), a mean
    averaged; a Total among loss_fn's metrics (summed per microbatch and device, wrongly) is
    refused, naming step_metrics. (Before the review's fix: 8 rows a batch; an IndexError.)"""
    seen = []
    count = lambda step: {"examples": fit.Total(np.float32(step.batch[0].shape[0])),
                          "rows": np.float32(step.batch[0].shape[0])}
    fit.fit(make_state(MLP()), batches(4, size=64), loss_fn=loss_fn, step_metrics=count,
            axis_name="batch", log_every=2, mesh=eight_device_mesh, workdir=str(tmp_path),
            **QUIET, hooks=[lambda e, run: e == "log" and seen.append(
                (run.step, run.metrics["train/examples"], run.metrics["train/rows"]))])
    assert seen == [(2, 128.0, 8.0), (4, 256.0, 8.0)], seen

    def counted_loss(logits, labels):
        return loss_fn(logits, labels)[0], {"n": fit.Total(np.float32(labels.shape[0]))}
    with pytest.raises(TypeError, match=r"metric 'n' is a fit.Total; a Total comes from "
                                        r"step_metrics"):
        fit.fit(make_state(MLP()), batches(4), loss_fn=counted_loss, grad_accum=2,
                workdir=str(tmp_path / "b"), **QUIET)


def test_step_metrics_with_a_train_step_of_your_own_is_refused(tmp_path):
    """Your train_step returns its own metrics: step_metrics with it raises, naming both."""
    with pytest.raises(ValueError, match="step_metrics is called by fit's own train step"):
        fit.fit(make_state(MLP()), batches(2), train_step=lambda s, b: (s, {}),
                step_metrics=layer_norms, workdir=str(tmp_path), **QUIET)


# ----------------------------------------------------------------------------------------------
# 2. The traps

def test_t1_a_loss_returned_bare_by_eval_step_is_warned_about_naming_the_fix(
        tmp_path, one_device_mesh, capsys):
    """T1: an eval_step returning the test loss as a bare number: fit logs it as eval/accuracy and
    keeps the best by its maximum; at the first eval it says so (the monitor, with its mode) and
    warns that the value is outside [0, 1], naming the fix `{'loss': x}`. An accuracy returned
    bare gets no warning. (7711fde said nothing: load_ckpt(..., "best") gave the worst model.)"""
    def loss_eval(state, batch):
        logits = state.apply_fn({"params": state.params}, batch[0], train=False)
        return loss_fn(logits, batch[1])[0]

    def accuracy(state, batch):
        logits = state.apply_fn({"params": state.params}, batch[0], train=False)
        return (logits.argmax(-1) == batch[1]).mean()

    kwargs = dict(loss_fn=loss_fn, num_epochs=2, mesh=one_device_mesh, tensorboard=False,
                  verbose=2)
    with pytest.warns(UserWarning, match=r"eval/accuracy .* outside \[0, 1\]\. If it is a loss, "
                                         r"return \{'loss': x\}"):
        fit.fit(make_state(MLP()), batches(3), batches(2, seed=1), eval_step=loss_eval,
                workdir=str(tmp_path / "a"), **kwargs)
    said = capsys.readouterr().out
    assert said.count("eval_step returns a bare number, logged as eval/accuracy: the best "
                      "checkpoint is its maximum") == 1, said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit.fit(make_state(MLP()), batches(3), batches(2, seed=1), eval_step=accuracy,
                workdir=str(tmp_path / "b"), **kwargs)


def test_t2_t3_at_log_the_state_and_the_norms_follow_the_one_stated_rule(tmp_path,
                                                                        one_device_mesh):
    """T2, T3: log_every=4, epochs of 6 steps, a save every 8: each `log` event's state is one
    call past its step, but at the step itself where an epoch ends or a save falls; the log
    step's norms are there at multiples of log_every only. `_Run`'s docstring states both
    rules with their exceptions, in one place (7711fde's said "one call after `step`" alone)."""
    seen = []

    def hook(event, run):
        if event == "log":
            seen.append((run.step, int(run.state.step), "train/grad_norm" in run.metrics))

    fit.fit(make_state(MLP()), batches(6), loss_fn=loss_fn, log_every=4, num_epochs=3,
            ckpt_every=8, mesh=one_device_mesh, workdir=str(tmp_path), hooks=[hook], **QUIET)
    assert seen == [(4, 5, True), (6, 6, False), (8, 8, True), (12, 12, True), (16, 16, True),
                    (18, 18, False)], seen
    doc = " ".join(fit._Run.__doc__.split())
    assert "at multiples of `log_every` only, so not at an epoch's last log point" in doc
    assert "one call past `step`" in doc and "at `step` itself where an epoch ends or a save " \
                                             "falls there" in doc


def test_t4_an_internal_replaced_after_a_first_call_is_traced_anew(tmp_path, one_device_mesh,
                                                                   monkeypatch):
    """T4: after a first call, `fit._gradient_step` replaced by one that applies no update (the
    SGD step scaled by 0): a second call with the same functions, optimizer and shapes traces the
    replacement, so the params stay as they were. (7711fde reused the cached steps: trained.)"""
    data, tx, model = batches(2), optax.sgd(0.1), MLP()  # (one model: one apply_fn, one key)
    kwargs = dict(loss_fn=loss_fn, mesh=one_device_mesh, **QUIET)
    fit.fit(make_state(model, tx), data, workdir=str(tmp_path / "a"), **kwargs)
    real = fit._gradient_step

    def frozen_step(state, batch, rng, config, grads_of):
        new, metrics, grads = real(state, batch, rng, config, grads_of)
        return state.replace(step=new.step, opt_state=new.opt_state), metrics, grads

    monkeypatch.setattr(fit, "_gradient_step", frozen_step)
    start = make_state(model, tx)
    state, _ = fit.fit(start, data, workdir=str(tmp_path / "b"), **kwargs)
    np.testing.assert_array_equal(flat(state.params), flat(start.params))


def test_t5_a_seed_that_is_not_an_integer_is_refused_naming_it():
    """T5: seed=None (or 1.5, or True) raises a ValueError naming seed before any work. (7711fde
    accepted None and failed deep inside: "None is not a valid value for jnp.array".)"""
    for seed in (None, 1.5, True, -1):
        with pytest.raises(ValueError, match=r"fit: seed must be an integer >= 0"):
            fit.Options(loss_fn=loss_fn, seed=seed)


def test_t5_shuffle_false_feeds_the_rows_in_order_and_a_resume_keeps_it(tmp_path,
                                                                      one_device_mesh):
    """T5: shuffling has an off switch. Rows whose first pixel is their index, batches of 16:
    with shuffle=False every epoch's batches start at rows 0, 16, 32, 48 (with the default, the
    first epoch's do not); a resume with the other setting is refused, naming it. `shuffle` is a
    boolean. (7711fde: shuffle is an unknown option.)"""
    x = np.zeros((64, 8, 8, 1), np.float32)
    x[:, 0, 0, 0] = np.arange(64)
    y = np.arange(64, dtype=np.int32) % 10

    def firsts(**kw):
        seen = []
        fit.fit(make_state(MLP()), (x, y), loss_fn=loss_fn, batch_size=16, log_every=1,
                step_metrics=lambda step: {"first": step.batch[0][0, 0, 0, 0]},
                mesh=one_device_mesh, workdir=str(tmp_path / str(kw)), **QUIET, **kw,
                hooks=[lambda e, run: e == "log" and seen.append(run.metrics["train/first"])])
        return seen
    assert firsts(shuffle=False, num_epochs=2) == [0.0, 16.0, 32.0, 48.0] * 2
    assert firsts()[:4] != [0.0, 16.0, 32.0, 48.0]
    kw = dict(loss_fn=loss_fn, batch_size=16, mesh=one_device_mesh, workdir=str(tmp_path), **QUIET)
    fit.fit(make_state(MLP()), (x, y), shuffle=False, max_steps=2, **kw)
    with pytest.raises(ValueError, match=r"trained with shuffle=False"):
        fit.fit(make_state(MLP()), (x, y), resume=True, **kw)
    with pytest.raises(TypeError, match=r"fit: shuffle must be True or False, got 'no'"):
        fit.Options(loss_fn=loss_fn, shuffle="no")


def test_t6_with_skip_every_value_in_run_metrics_is_a_float(tmp_path, one_device_mesh):
    """T6: on_nonfinite="skip" logs `train/skipped_steps`, a float like every other value of
    `run.metrics`. (7711fde logged an int there.)"""
    kinds = set()
    fit.fit(make_state(MLP()), batches(4), loss_fn=loss_fn, on_nonfinite="skip", log_every=2,
            mesh=one_device_mesh, workdir=str(tmp_path), **QUIET,
            hooks=[lambda e, run: kinds.update((k, type(v)) for k, v in run.metrics.items())])
    assert ("train/skipped_steps", float) in kinds
    assert {t for _, t in kinds} == {float}, kinds


def test_t7_no_trailing_comment_runs_on_to_the_next_statement():
    """T7: a comment beside code says its whole say on its own line: its parentheses close there
    (7711fde had five that ran across two statements, e.g. `# (filled from the` / `# checkpoint if
    the run goes on; ...)` beside two different statements)."""
    import io
    import tokenize
    source = open(fit.__file__).read()
    open_ended = [(t.start[0], t.string) for t in tokenize.generate_tokens(
        io.StringIO(source).readline) if t.type == tokenize.COMMENT and
        t.line.strip() != t.string and t.string.count("(") != t.string.count(")")]
    assert open_ended == [], open_ended


def test_t8_step_metrics_see_an_nnx_state_without_its_frozen_base(tmp_path):
    """T8: inside a step with a frozen base, the state's batch_stats is a `_WithBase` (named parts
    `rest` and `base`, not a bare tuple); step_metrics get the state as the step returns it:
    batch_stats the model's other variables, the base apart. (7711fde had a bare tuple.)"""
    from test_finetune import DATA, build, mesh_of, token_loss
    seen = []

    def look(step):
        seen.append(step.state.batch_stats)
        return {"adapter_norm": optax.tree.norm(step.state.params)}

    mesh = mesh_of((1, 1, 1))
    model, opt = build(mesh)
    _, history = fit.fit(model, DATA, optimizer=opt, loss_fn=token_loss, step_metrics=look,
                         mesh=mesh, workdir=str(tmp_path), **QUIET)
    assert seen and all(isinstance(stats, dict) for stats in seen), seen
    assert "train/adapter_norm" in history
    assert fit._WithBase._fields == ("rest", "base")


ADD_BATCHES = ("        return values\n\n\ndef _eval_kind(",
               "        values['batches'] = float(batches)\n        return values\n\n\n"
               "def _eval_kind(")
NAME_BATCHES = ("        given = self.names + list(self.arrays)",
                "        self.names.append('batches')\n"
                "        given = self.names + list(self.arrays)")


def test_t9_the_host_sums_have_one_name_where_they_are_kept_and_saved():
    """T9: the train sums on the host are `_Readings.meter`, the name they are saved under
    (`_Progress.meter`); "sums" is left to the device arrays and their layout. (7711fde kept
    them as `_Readings.sums` and saved them as `meter`.)"""
    import dataclasses
    import inspect
    source = inspect.getsource(fit._Readings)
    assert "self.meter" in source and "self.sums" not in source
    assert "meter" in inspect.signature(fit._Readings).parameters
    assert "meter" in {f.name for f in dataclasses.fields(fit._Progress)}


def test_t10_the_reference_sends_a_per_step_quantity_to_step_metrics():
    """T10: docs/reference.md's per-step paragraph names `step_metrics`, which sees the gradients,
    not `_step_values`, which cannot. (7711fde's sent the fraction of clipped gradients there.)"""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "reference.md")) as f:
        reference = f.read()
    assert "A quantity of the step to log is `step_metrics=fn(step)`" in reference
    assert "`_step_values` sees the step's metrics after it, not its gradients" in reference


def test_t11_a_metric_added_in_the_eval_code_is_named_in_one_place(tmp_path, monkeypatch,
                                                                  one_device_mesh):
    """T11: a metric added where an eval's values are computed (`_EvalSums.read`: the batches
    counted) raises at the first eval, naming `_EvalSums.names`, the one place that the monitor
    is checked against; named there too, it is a monitor like any other. (7711fde logged it and
    refused it as the monitor, silently about why.)"""
    kwargs = dict(loss_fn=loss_fn, eval_step=eval_step, mesh=one_device_mesh, **QUIET)
    unnamed = edited_fit(tmp_path, monkeypatch, ADD_BATCHES)
    with pytest.raises(ValueError, match=r"the eval gave \['eval/batches'\], which the plan does "
                                         r"not know .* _EvalSums\.names"):
        unnamed.fit(unnamed.TrainState.create(apply_fn=MLP().apply, tx=optax.adam(1e-3),
                                              params=make_state(MLP()).params),
                    batches(2), batches(3, seed=1), workdir=str(tmp_path / "a"), **kwargs)
    (tmp_path / "named").mkdir()
    named = edited_fit(tmp_path / "named", monkeypatch, ADD_BATCHES, NAME_BATCHES)
    _, history = named.fit(named.TrainState.create(apply_fn=MLP().apply, tx=optax.adam(1e-3),
                                                   params=make_state(MLP()).params),
                           batches(2), batches(3, seed=1), workdir=str(tmp_path / "b"),
                           monitor="eval/batches", mode="max", **kwargs)
    assert history["eval/batches"] == [3.0]
