"""What carries from one call of fit to the next (#40): a finished run trained on with
`lr_schedule(continue_from=)` and the options it changed; hooks' saved state keyed by name, not
by position (so `verbose`/`tensorboard` may change on resume, and a checkpoint of the file before
#40 still restores it); any number of learning rates (`optax.multi_transform`), logged by label;
any state layout (a GAN's state with a nested discriminator TrainState) checked whole for NaN
before saves and each step under `on_nonfinite="skip"`, while +-inf in an optimizer state stays
legitimate; a list is batches, a tuple (x, y) arrays; `history.timing` on every return.

Every test here fails on the file before #40 (5402c9f) but the reduce_on_plateau one, which
guards the new whole-state check against treating optax's legitimate inf as a fault. Small
models on 1 of the 8 simulated devices, a few steps each; every fit writes under tmp_path."""
import json
import math
import os
import shutil
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, eval_step, fit_at, loss_fn, make_state
from flax.training import train_state
from jax.sharding import Mesh

import fit as fit_module
from fit import TrainState, fit, load_ckpt, lr_schedule

BATCH, SPE = 32, 4          # 128 training rows: 4 steps an epoch
BASE_LR, WARMUP = 1e-2, 1   # the schedule's peak and warmup (epochs)
FIRST, MORE = 3, 6          # a finished run of FIRST epochs, trained on to MORE


def mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def committed_steps(ckpt_dir):
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(
        ckpt_dir) else []


def finite(tree):
    """Whether every floating leaf of `tree` is finite (no NaN, no Inf)."""
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(
        jax.device_get(tree)) if np.issubdtype(np.asarray(x).dtype, np.floating))


def saved_meta(ckpt_dir):
    """The JSON `meta` item of a run's latest checkpoint."""
    step = committed_steps(ckpt_dir)[-1]
    with open(os.path.join(ckpt_dir, str(step), "meta", "metadata")) as f:
        return json.load(f)


def recorder(events=("log",)):
    """A hook that keeps (event, step, metrics, total_steps, monitor) of every call in `events`."""
    seen = []

    def hook(event, run):
        if event in events:
            seen.append((event, run.step, dict(run.metrics), run.total_steps, run.monitor))
    hook.seen = seen
    return hook


def cosine_with_warmup(init, peak, end, warmup_steps, total_steps):
    """lr_schedule's curve written out with optax alone: a linear warmup from `init` to `peak` over
    `warmup_steps`, then a cosine reaching `end` at step total_steps - 1."""
    return optax.warmup_cosine_decay_schedule(init, peak, warmup_steps, total_steps - 1, end)


# The run of FIRST epochs, its schedule spent (0 from its last step on), trained once per module;
# the tests that go on with it resume a copy of its workdir.
FIRST_CURVE = cosine_with_warmup(0.0, BASE_LR, 0.0, WARMUP * SPE, FIRST * SPE)


def first_tx():
    return optax.inject_hyperparams(optax.adam)(lr_schedule(BASE_LR, SPE, FIRST, WARMUP))


@pytest.fixture(scope="module")
def finished(digits, tmp_path_factory):
    """(workdir, history) of a finished run: MLP, FIRST epochs, lr_schedule(epochs=FIRST)."""
    x, y, _, _ = digits
    workdir = tmp_path_factory.mktemp("finished")
    _, history = fit(make_state(MLP(), first_tx()), (x[:128], y[:128]), loss_fn=loss_fn,
                     batch_size=BATCH, num_epochs=FIRST, log_every=1, verbose=0, mesh=mesh1(),
                     workdir=str(workdir))
    assert committed_steps(history.ckpt_dir)[-1] == FIRST * SPE
    return workdir, history


def copy_of(finished, tmp_path):
    workdir = tmp_path / "work"
    shutil.copytree(finished[0], workdir)
    return str(workdir)


# ----------------------------------------------------------------------------------------------
# 1. Continuing a finished run: lr_schedule(continue_from=), the options it changed, the check

def test_continue_from_is_the_finished_runs_curve_then_a_warm_restart():
    """`lr_schedule(..., epochs=MORE, continue_from=FIRST)` equals, at every step, the FIRST-epoch
    curve before step FIRST * SPE and from there a warm restart (warmup from end_value back to
    base_lr, cosine to end_value at the new last step), both written out with optax alone. Bad
    values of continue_from are refused by name. (5402c9f: no continue_from, a TypeError.)"""
    end = 1e-4
    schedule = lr_schedule(BASE_LR, SPE, MORE, WARMUP, init_value=1e-3, end_value=end,
                           continue_from=FIRST)
    before = cosine_with_warmup(1e-3, BASE_LR, end, WARMUP * SPE, FIRST * SPE)
    restart = cosine_with_warmup(end, BASE_LR, end, WARMUP * SPE, (MORE - FIRST) * SPE)
    got = [float(schedule(s)) for s in range(MORE * SPE + 3)]
    want = [float(before(s)) if s < FIRST * SPE else float(restart(s - FIRST * SPE))
            for s in range(MORE * SPE + 3)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    assert got[FIRST * SPE] == pytest.approx(end, rel=1e-5)
    assert got[MORE * SPE - 1] == pytest.approx(end, rel=1e-5)
    assert max(got[FIRST * SPE:]) == pytest.approx(BASE_LR, rel=1e-5)  # back to the peak
    for bad in (0, MORE, MORE + 1, 2.5):
        with pytest.raises(ValueError, match="continue_from"):
            lr_schedule(BASE_LR, SPE, MORE, continue_from=bad)


def test_a_finished_run_trained_on_follows_the_restart_and_records_the_changed_options(
        digits, finished, tmp_path):
    """The documented recipe: a run trained FIRST epochs with lr_schedule(epochs=FIRST) is resumed
    with `num_epochs=MORE` and the state rebuilt with lr_schedule(epochs=MORE,
    continue_from=FIRST). At every step of the second call the logged `train/lr` (at log step s,
    the rate of the update from s - 1) is the warm restart's, computed with optax; no schedule
    warning. The changed option is recorded: `history["options_changed"]` says "step 12:
    num_epochs 3 -> 6" and TensorBoard holds that text at step 12, the resumed call's first.
    (5402c9f: no continue_from; the rate jumped into the middle of a 6-epoch cosine.)"""
    x, y, _, _ = digits
    workdir = copy_of(finished, tmp_path)
    tx = optax.inject_hyperparams(optax.adam)(lr_schedule(BASE_LR, SPE, MORE, WARMUP,
                                                          continue_from=FIRST))
    hook = recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, history = fit(make_state(MLP(), tx), (x[:128], y[:128]), loss_fn=loss_fn,
                             batch_size=BATCH, num_epochs=MORE, log_every=1, verbose=0,
                             resume=True, hooks=[hook], mesh=mesh1(), workdir=workdir)
    assert not [w for w in caught if "learning" in str(w.message)], [str(w.message) for w in caught]
    assert int(state.step) == MORE * SPE
    restart = cosine_with_warmup(0.0, BASE_LR, 0.0, WARMUP * SPE, (MORE - FIRST) * SPE)
    logged = {step: m for _, step, m, *_ in hook.seen}
    assert sorted(logged) == list(range(FIRST * SPE + 1, MORE * SPE + 1)), sorted(logged)
    for s, metrics in logged.items():
        assert {k for k in metrics if k.startswith("train/lr")} == {"train/lr"}, metrics
        assert metrics["train/lr"] == pytest.approx(float(restart(s - 1 - FIRST * SPE)),
                                                    rel=1e-5, abs=1e-9), s
    # The restart begins at the finished run's end value (0) and climbs back to the peak.
    assert logged[FIRST * SPE + 1]["train/lr"] == pytest.approx(0.0, abs=1e-9)
    assert max(m["train/lr"] for m in logged.values()) == pytest.approx(BASE_LR, rel=1e-5)

    changed = f"step {FIRST * SPE}: num_epochs {FIRST} -> {MORE}"
    assert history["options_changed"] == [changed], history.get("options_changed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(history.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    assert "options_changed/text_summary" in acc.Tags()["tensors"], acc.Tags()["tensors"]
    events = acc.Tensors("options_changed/text_summary")
    assert [e.step for e in events] == [FIRST * SPE]
    text = b"".join(events[0].tensor_proto.string_val).decode()
    assert "num_epochs" in text and f"{FIRST} -> {MORE}" in text, text


def test_a_new_run_from_a_loaded_spent_state_warns_and_counts_its_total_from_the_states_step(
        digits, finished, tmp_path):
    """A NEW run (resume=False) from the finished run's last checkpoint, loaded whole with
    load_ckpt, keeps that run's schedule, which is 0 from step 11 on: fit warns that the rate "is
    0 at every step of this run" (the check samples from the state's step, 12, not from 0). Its
    `run.total_steps` (the bar's total), read by a hook at train_start, counts from the state's
    step: 12 + one epoch's 4 = 16, and the run trains to step 16. (5402c9f: sampled 0..4, where
    the schedule is warming up: no warning; total 4.)"""
    x, y, _, _ = digits
    state = load_ckpt(make_state(MLP(), first_tx()), finished[1].ckpt_dir, "last")
    assert int(state.step) == FIRST * SPE
    hook = recorder(("train_start",))
    with pytest.warns(UserWarning, match=r"learning rate.* is 0 at every step of this run"):
        state, _ = fit(state, (x[:128], y[:128]), loss_fn=loss_fn, batch_size=BATCH,
                       num_epochs=1, verbose=0, hooks=[hook], mesh=mesh1(),
                       workdir=str(tmp_path))
    assert [total for *_, total, _ in hook.seen] == [FIRST * SPE + SPE]
    assert int(state.step) == FIRST * SPE + SPE


# ----------------------------------------------------------------------------------------------
# 2. Hooks' saved state is keyed by a stable name

EPOCHS = 4  # EarlyStopping's runs: 4 epochs of 4 steps, an eval each epoch


def early_stopping(module=fit_module):
    # min_delta=1.0: no eval ever improves on the first by more than 1 (accuracy), so `bad`
    # counts every eval after the first, whatever the training: uninterrupted, 3 after 4 evals.
    return module.EarlyStopping(patience=10, min_delta=1.0, restore_best=False)


def early_kwargs(digits, **kw):
    x, y, xt, yt = digits
    return dict(train_ds=(x[:128], y[:128]), test_ds=(xt[:64], yt[:64]), loss_fn=loss_fn,
                eval_step=eval_step, batch_size=BATCH, log_every=SPE, mesh=mesh1(), **kw)


@pytest.fixture(scope="module")
def uninterrupted_early(digits, tmp_path_factory):
    """(best, bad) of EarlyStopping after an uninterrupted EPOCHS-epoch run."""
    hook = early_stopping()
    _, history = fit(make_state(MLP()), num_epochs=EPOCHS, hooks=[hook], verbose=0,
                     tensorboard=False, workdir=str(tmp_path_factory.mktemp("early")),
                     **early_kwargs(digits))
    assert len(history["eval/accuracy"]) == EPOCHS and hook.bad == EPOCHS - 1
    return hook.best, hook.bad


def test_early_stopping_resumed_with_other_verbose_and_tensorboard_keeps_its_count(
        digits, uninterrupted_early, tmp_path):
    """EarlyStopping's count survives a resume whose `verbose`/`tensorboard` differ from the first
    call's (2 built-in hooks before it, then none): after 2 + 2 epochs its `best` and `bad` are
    exactly the uninterrupted run's, and the checkpoint keys its state by the hook's name. (5402c9f
    keyed it by position among built-in + user hooks: "2", then looked for "0": the count was
    lost, bad 1 instead of 3.)"""
    first = early_stopping()
    fit(make_state(MLP()), num_epochs=2, hooks=[first], verbose=1, tensorboard=True,
        workdir=str(tmp_path), **early_kwargs(digits))
    assert first.bad == 1
    hook = early_stopping()
    _, history = fit(make_state(MLP()), num_epochs=EPOCHS, hooks=[hook], verbose=0,
                     tensorboard=False, resume=True, workdir=str(tmp_path),
                     **early_kwargs(digits))
    assert len(history["eval/accuracy"]) == EPOCHS
    assert (hook.best, hook.bad) == uninterrupted_early
    saved = saved_meta(history.ckpt_dir)["hooks"]
    assert saved == {"EarlyStopping": {"best": hook.best, "bad": hook.bad}}, saved


def test_hook_states_of_a_checkpoint_written_before_40_are_restored(
        digits, uninterrupted_early, tmp_path, monkeypatch):
    """A checkpoint written by the file before #40 (5402c9f) keyed hook states by position ("2":
    after its ProgressBar and TensorBoard). Resumed by this file with verbose=0 and no
    TensorBoard, the states go, in order, to the hooks that have set_state: EarlyStopping's
    `best` and `bad` after 2 + 2 epochs equal the uninterrupted run's. (5402c9f resuming its own
    checkpoint this way looked for "0": the count was lost.)"""
    old = fit_at("5402c9f", tmp_path, monkeypatch)
    model = MLP()
    var = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)
    first = early_stopping(old)
    old.fit(old.TrainState.create(apply_fn=model.apply, params=var["params"],
                                  tx=optax.adam(1e-3)),
            num_epochs=2, hooks=[first], verbose=1, tensorboard=True,
            workdir=str(tmp_path / "work"), **early_kwargs(digits))
    assert first.bad == 1
    hook = early_stopping()
    _, history = fit(make_state(MLP()), num_epochs=EPOCHS, hooks=[hook], verbose=0,
                     tensorboard=False, resume=True, workdir=str(tmp_path / "work"),
                     **early_kwargs(digits))
    assert len(history["eval/accuracy"]) == EPOCHS
    assert hook.bad == uninterrupted_early[1]
    assert hook.best == pytest.approx(uninterrupted_early[0], abs=1e-6)
    # From here on the checkpoint keys the state by the hook's name.
    assert list(saved_meta(history.ckpt_dir)["hooks"]) == ["EarlyStopping"]


# ----------------------------------------------------------------------------------------------
# 3. Any number of learning rates

def test_two_learning_rates_of_multi_transform_are_each_logged_by_label(digits, tmp_path):
    """`optax.multi_transform` of two injected Adams, "slow" (a constant 1e-4) for the first layer
    and "fast" (a linear schedule) for the second, trains, and every log point has
    `train/lr/slow` == 1e-4 and `train/lr/fast` == the schedule at the step that ended there (s -
    1), and no plain `train/lr`. (5402c9f died: optax's "KeyError: Found multiple values".)"""
    x, y, _, _ = digits
    fast = optax.linear_schedule(1e-2, 1e-3, 2 * SPE)
    model = MLP()
    params = model.init(jax.random.key(0), x[:1], train=False)["params"]
    labels = {k: jax.tree.map(lambda _, k=k: "slow" if k == "Dense_0" else "fast", v)
              for k, v in params.items()}
    tx = optax.multi_transform({"slow": optax.inject_hyperparams(optax.adam)(1e-4),
                                "fast": optax.inject_hyperparams(optax.adam)(fast)}, labels)
    hook = recorder()
    state, _ = fit(TrainState.create(apply_fn=model.apply, params=params, tx=tx),
                   (x[:128], y[:128]), loss_fn=loss_fn, batch_size=BATCH, num_epochs=2,
                   log_every=1, verbose=0, hooks=[hook], mesh=mesh1(), workdir=str(tmp_path))
    assert int(state.step) == 2 * SPE
    logged = {step: m for _, step, m, *_ in hook.seen}
    assert sorted(logged) == list(range(1, 2 * SPE + 1))
    for s, m in logged.items():
        assert {k for k in m if k.startswith("train/lr")} == {"train/lr/slow", "train/lr/fast"}, m
        assert m["train/lr/slow"] == pytest.approx(1e-4, rel=1e-6)
        assert m["train/lr/fast"] == pytest.approx(float(fast(s - 1)), rel=1e-6), s


def test_no_learning_rate_logs_nothing_and_says_so_once(digits, tmp_path, capsys):
    """A plain `optax.adam(1e-3)` keeps no rate: no `train/lr...` metric at any log point, and
    with verbose >= 1 fit says so once ("no train/lr") on stdout, however many steps and log
    points. (5402c9f said nothing.)"""
    x, y, _, _ = digits
    hook = recorder()
    fit(make_state(MLP(), optax.adam(1e-3)), (x[:128], y[:128]), loss_fn=loss_fn,
        batch_size=BATCH, num_epochs=2, log_every=1, verbose=2, hooks=[hook], mesh=mesh1(),
        workdir=str(tmp_path))
    assert len(hook.seen) == 2 * SPE
    assert not [k for _, _, m, *_ in hook.seen for k in m if k.startswith("train/lr")]
    assert capsys.readouterr().out.count("no train/lr") == 1


# ----------------------------------------------------------------------------------------------
# 4. Any state layout; the whole state checked for NaN; data forms

class Disc(nn.Module):
    @nn.compact
    def __call__(self, logits):
        return nn.Dense(1)(logits)


def gan_state_class():
    """A GAN's state: fit's TrainState plus a discriminator TrainState field without a default.
    (Defined on call: with the file before #40 the class itself is a TypeError, "non-default
    argument 'disc' follows default argument", which must fail only these tests.)"""
    class GANState(TrainState):
        disc: train_state.TrainState
    return GANState


def gan_state(GANState):
    gen, disc = MLP(), Disc()
    g = gen.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)["params"]
    d = disc.init(jax.random.key(1), np.zeros((1, 10), np.float32))["params"]
    return GANState.create(apply_fn=gen.apply, params=g, tx=optax.adam(1e-3),
                           disc=train_state.TrainState.create(apply_fn=disc.apply, params=d,
                                                              tx=optax.adam(1e-3)))


def poisoned_step(nan_at, where):
    """A train_step (generator on the labels, discriminator on the generator's logits) whose
    losses stay finite while the update of step `nan_at` makes NaN of `where`: "disc" (the
    discriminator's params) or "opt_state" (the generator's Adam moments; its params stay
    finite at that step)."""
    def train_step(state, batch):
        x, y = batch

        def g_loss_of(params):
            logits = state.apply_fn({"params": params}, x, train=True)
            return loss_fn(logits, y)[0], logits
        (g_loss, logits), g_grads = jax.value_and_grad(g_loss_of, has_aux=True)(state.params)
        new = state.apply_gradients(grads=g_grads)
        poison = jnp.where(new.step == nan_at, jnp.nan, 1.0)
        spoil = lambda tree: jax.tree.map(
            lambda a: a * poison if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
        metrics = {"g_loss" if hasattr(state, "disc") else "loss": g_loss}
        if where == "opt_state":
            new = new.replace(opt_state=spoil(new.opt_state))
        if hasattr(state, "disc"):
            d_loss, d_grads = jax.value_and_grad(lambda p: jnp.mean(state.disc.apply_fn(
                {"params": p}, jax.lax.stop_gradient(logits)) ** 2))(state.disc.params)
            disc = state.disc.apply_gradients(grads=d_grads)
            if where == "disc":
                disc = disc.replace(params=spoil(disc.params))
            new, metrics = new.replace(disc=disc), {"d_loss": d_loss, **metrics}
        return new, metrics
    return train_step


def batch_list(digits, n=8):
    x, y, _, _ = digits
    return [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(n)]


@pytest.mark.parametrize("where", ["disc", "opt_state"])
def test_a_nan_anywhere_in_the_state_raises_before_the_save_and_is_never_saved(
        digits, tmp_path, where):
    """A NaN that the update of step 10 puts in the discriminator's params (GANState.disc: its
    losses finite, the generator's params finite) or in Adam's moments (a plain TrainState, its
    params finite at step 10), with ckpt_every=5: the check before the save of step 10 raises
    FloatingPointError naming step 10 and "no checkpoint was written after it"; the checkpoints
    kept are of earlier steps and finite in every floating leaf. The GANState builds with
    `GANState.create(..., disc=...)` and trains with `train_step=`, `monitor="train/d_loss"` (no
    eval set). (5402c9f checked the generator's params only: it saved the NaN at
    step 10; and the GANState class was a TypeError.)"""
    if where == "disc":
        GANState = gan_state_class()
        make = lambda: gan_state(GANState)
    else:
        make = lambda: make_state(MLP())
    hook = recorder(("train_start",))
    with pytest.raises(FloatingPointError, match=r"at step 10\b.*no checkpoint was written "
                                                 r"after it"):
        fit(make(), batch_list(digits), train_step=poisoned_step(10, where), num_epochs=2,
            ckpt_every=5, log_every=50, verbose=0, hooks=[hook], mesh=mesh1(),
            workdir=str(tmp_path), monitor="train/d_loss" if where == "disc" else None)
    if where == "disc":
        assert [monitor for *_, monitor in hook.seen] == ["train/d_loss"]
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    steps = committed_steps(ckpt_dir)
    assert steps and max(steps) < 10, steps
    for s in steps:
        restored = load_ckpt(make(), ckpt_dir, s)
        assert finite((restored.params, restored.opt_state, getattr(restored, "disc", None))), s


def test_on_nonfinite_skip_drops_the_update_that_made_the_discriminator_nan(digits, tmp_path):
    """on_nonfinite="skip" tests the whole state each step: the update of step 5 (a save, with
    ckpt_every=5) that makes the discriminator's params NaN, its losses finite, is dropped
    (skipped_steps 1) and training goes on to step 16: the returned `state.disc.params` and
    every checkpoint kept (step 5's included) are finite. (5402c9f tested the loss and the
    generator's params only, so the NaN stayed and was saved; and the GANState class was a
    TypeError.)"""
    GANState = gan_state_class()
    hook = recorder()
    state, history = fit(gan_state(GANState), batch_list(digits),
                         train_step=poisoned_step(5, "disc"), num_epochs=2, ckpt_every=5,
                         log_every=1, on_nonfinite="skip", verbose=0, hooks=[hook],
                         mesh=mesh1(), workdir=str(tmp_path))
    assert int(state.step) == 16 and isinstance(state, GANState)
    assert history["train/skipped_steps"] == [1, 1], history["train/skipped_steps"]
    skipped = {step: m["train/skipped_steps"] for _, step, m, *_ in hook.seen}
    assert skipped == {s: int(s >= 5) for s in range(1, 17)}, skipped  # step 5's update
    assert finite(state.disc.params) and finite(state.params)
    assert all(np.isfinite(history["train/d_loss"])), history["train/d_loss"]
    steps = committed_steps(history.ckpt_dir)
    assert steps and steps[-1] == 16, steps
    for s in steps:
        restored = load_ckpt(gan_state(GANState), history.ckpt_dir, s)
        assert finite((restored.params, restored.opt_state, restored.disc)), s


def plateau_step(state, batch):
    """fit's update, with the loss handed to the optimizer as reduce_on_plateau's `value`."""
    x, y = batch
    def loss_of(params):
        return loss_fn(state.apply_fn({"params": params}, x, train=True), y)[0]
    loss, grads = jax.value_and_grad(loss_of)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, value=loss)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state), {"loss": loss}


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_inf_in_an_optimizer_state_is_legitimate_reduce_on_plateau_saves_and_resumes(
        digits, tmp_path, on_nonfinite):
    """optax.contrib.reduce_on_plateau's state starts with best_value = inf (kept inf here:
    accumulation_size=1000 never ends its window): the whole-state checks, before saves and (with
    on_nonfinite="skip") each step, take it for what it is, not a fault. A 1-epoch run saves it
    (inf in the checkpoint), a resume to 2 epochs restores it and trains on to step 8, no update
    dropped (Adam counts 8 updates). (Passes on 5402c9f too, which checked the params
    only: this guards the new checks against raising on, or skipping for, +-inf.)"""
    tx = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau(accumulation_size=1000))
    kwargs = dict(train_step=plateau_step, on_nonfinite=on_nonfinite, verbose=0, mesh=mesh1(),
                  workdir=str(tmp_path))
    batches = batch_list(digits, SPE)
    _, history = fit(make_state(MLP(), tx), batches, num_epochs=1, **kwargs)
    assert committed_steps(history.ckpt_dir) == [SPE]
    saved = load_ckpt(make_state(MLP(), tx), history.ckpt_dir)
    assert int(saved.step) == SPE and math.isinf(float(saved.opt_state[1].best_value))
    state, history = fit(make_state(MLP(), tx), batches, num_epochs=2, resume=True, **kwargs)
    assert int(state.step) == 2 * SPE and history["step"] == [SPE, 2 * SPE]
    assert math.isinf(float(state.opt_state[1].best_value)) and finite(state.params)
    assert int(state.opt_state[0][0].count) == 2 * SPE  # Adam's count: every update kept
    assert history.get("train/skipped_steps", [0, 0]) == [0, 0], history["train/skipped_steps"]
    assert committed_steps(history.ckpt_dir)[-1] == 2 * SPE


def test_a_list_of_two_single_array_batches_is_two_batches(digits, tmp_path):
    """A list is batches whatever its length: `[X[:32], X[32:64]]` with a train_step trains two
    batches of 32 rows an epoch (not arrays x, y); its only metric is "recon_loss", and without an
    eval set or monitor= the run keeps no best (#48; no metric named "loss": the run starts). `batch_size=` with a list
    raises, naming the tuple form (x, y). (5402c9f took the two-element list as arrays (x, y):
    refused without batch_size, trained on X[:32] "labelled" X[32:64] with it.)"""
    x = digits[0]
    shapes = []

    def train_step(state, batch):
        shapes.append(batch.shape)  # (at trace time)
        def loss_of(params):
            return jnp.mean(state.apply_fn({"params": params}, batch, train=True) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"recon_loss": loss}

    hook = recorder(("train_start",))
    state, history = fit(make_state(MLP()), [x[:32], x[32:64]], train_step=train_step,
                         num_epochs=2, verbose=0, hooks=[hook], mesh=mesh1(),
                         workdir=str(tmp_path))
    assert int(state.step) == 4 and history["step"] == [2, 4]
    assert set(shapes) == {(32, 8, 8, 1)}, shapes
    assert [monitor for *_, monitor in hook.seen] == [None]
    with pytest.raises(ValueError, match=r"batch_size=32 .*a list is batches.*tuple \(x, y\)"):
        fit(make_state(MLP()), [x[:32], x[32:64]], train_step=train_step, batch_size=32,
            verbose=0, mesh=mesh1(), workdir=str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused" / "checkpoints")


# ----------------------------------------------------------------------------------------------
# 5. history.timing on every return path

def test_a_finished_runs_second_call_returns_timing_with_the_same_keys(digits, finished,
                                                                        tmp_path, capsys):
    """A second call of a finished run (resume=True, the same num_epochs) does nothing ("already
    finished") and returns a History whose `timing` has the first, training call's keys, with
    `steps` 0 and `compile_s` 0. (5402c9f returned `timing` None there.)"""
    x, y, _, _ = digits
    state, history = fit(make_state(MLP(), first_tx()), (x[:128], y[:128]), loss_fn=loss_fn,
                         batch_size=BATCH, num_epochs=FIRST, log_every=1, verbose=1, resume=True,
                         mesh=mesh1(), workdir=copy_of(finished, tmp_path))
    assert "already finished" in capsys.readouterr().out
    assert int(state.step) == FIRST * SPE
    first = finished[1].timing
    assert first["steps"] == FIRST * SPE and first["compile_s"] > 0
    assert isinstance(history.timing, dict), history.timing
    assert set(history.timing) == set(first), set(history.timing) ^ set(first)
    assert history.timing["steps"] == 0 and history.timing["compile_s"] == 0
