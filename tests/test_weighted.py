"""Weighted(total, weight) metrics on padded, variable-length token batches (exact over the eval
set, each log interval and each epoch, on 1 and 2 devices), their bad inputs, gradient
accumulation with optax.MultiSteps (and its exact resume), `evaluate`, `load_ckpt(...,
weights_only=True)` and `resume=` by run name. Every fit call writes under pytest's tmp_path."""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from conftest import flat

from fit import TrainState, Weighted, evaluate, fit, load_ckpt

V, L = 16, 10  # vocabulary, padded sequence length


# ----------------------------------------------------------------------------------------------
# A tiny language-model-like model, data and the functions fit is given

class TinyLM(nn.Module):
    """Per-token logits from an embedding and two Dense layers (no dropout, no BatchNorm)."""

    @nn.compact
    def __call__(self, x, train):
        h = nn.Embed(V, 8)(x)
        return nn.Dense(V)(jnp.tanh(nn.Dense(16)(h)))


def lm_state(tx=None, seed=0):
    model = TinyLM()
    params = model.init(jax.random.key(seed), np.zeros((1, L), np.int32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx or optax.adam(3e-2))


def lm_arrays(n, seed):
    """`n` sequences of lengths 1..L padded to L: tokens x (0 where padded), targets y (-1 where
    padded). Long rows (length >= 6) have a learnable target, (3x + 1) mod V; short rows random
    targets, so tokens of short rows cost more and a per-row mean differs from a per-token one."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, L + 1, n)
    x = rng.integers(0, V, (n, L)).astype(np.int32)
    y = np.where((lengths >= 6)[:, None], (3 * x + 1) % V, rng.integers(0, V, (n, L)))
    pad = np.arange(L)[None, :] >= lengths[:, None]
    return np.where(pad, 0, x).astype(np.int32), np.where(pad, -1, y).astype(np.int32)


def batched(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def _token_metrics(logits, y):
    mask = y >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
    total = jnp.sum(jnp.where(mask, ce, 0.0))
    n = mask.sum().astype(jnp.float32)
    correct = jnp.sum((logits.argmax(-1) == y) & mask).astype(jnp.float32)
    return total, n, correct


def lm_loss_fn(logits, y):
    """The mean token loss to differentiate; the metrics as token-weighted sums."""
    total, n, correct = _token_metrics(logits, y)
    return total / jnp.maximum(n, 1.0), {"loss": Weighted(total, n),
                                         "accuracy": Weighted(correct, n)}


def lm_eval_step(state, batch):
    x, y = batch
    logits = state.apply_fn({"params": state.params}, x, train=False)
    total, n, correct = _token_metrics(logits, y)
    return {"loss": Weighted(total, n), "accuracy": Weighted(correct, n)}


def hand_sums(state, batches):
    """[(token-loss total, tokens, correct tokens, rows)] per batch, in float64 from the state's
    parameters: the exact values fit must log."""
    params = jax.device_get(state.params)
    apply = jax.jit(lambda p, x: state.apply_fn({"params": p}, x, train=False))
    out = []
    for x, y in batches:
        logits = np.asarray(apply(params, x), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        mask = y >= 0
        ce = -np.take_along_axis(logp, np.maximum(y, 0)[..., None], -1)[..., 0]
        correct = (logits.argmax(-1) == y) & mask
        out.append((float((ce * mask).sum()), float(mask.sum()), float(correct.sum()), len(x)))
    return out


def common(tmp_path, **kw):
    return dict(workdir=str(tmp_path), verbose=0, tensorboard=False, **kw)


def two_device_mesh():
    assert len(jax.devices()) >= 2
    return Mesh(np.array(jax.devices()[:2]), ("data",))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# ----------------------------------------------------------------------------------------------
# 1. Eval: the token-weighted mean over the whole eval set, on 1 and 2 devices

@pytest.mark.parametrize("devices", [1, 2])
def test_eval_loss_is_the_exact_token_weighted_mean(tmp_path, one_device_mesh, devices):
    mesh = one_device_mesh if devices == 1 else two_device_mesh()
    x, y = lm_arrays(48, seed=1)
    xe, ye = lm_arrays(15, seed=2)
    train = batched(x, y, 8)
    test = batched(xe, ye, 4)  # 4 batches, the last of 3 rows (on 2 devices: not split)
    assert [len(b[0]) for b in test] == [4, 4, 4, 3]
    state, history = fit(lm_state(), train, test, loss_fn=lm_loss_fn, eval_step=lm_eval_step,
                         num_epochs=3, mesh=mesh, **common(tmp_path))
    sums = hand_sums(state, test)
    tot, tok, cor, rows = (np.array(c, np.float64) for c in zip(*sums))
    exact_loss, exact_acc = tot.sum() / tok.sum(), cor.sum() / tok.sum()
    logged = history["eval/loss"][-1]
    assert rel(logged, exact_loss) < 1e-5, (logged, exact_loss)
    accuracy = history["eval/accuracy"][-1]
    assert rel(accuracy, exact_acc) < 1e-5, (accuracy, exact_acc)
    # The old rule (per-batch means, weighted by rows) gives another number: the test would
    # fail without the weighting.
    old = float((rows * (tot / tok)).sum() / rows.sum())
    assert abs(old - exact_loss) > 1e-3, (old, exact_loss)
    assert abs(logged - old) > 1e-3


# ----------------------------------------------------------------------------------------------
# 2. Train: exact over each log interval and each epoch

def test_train_metrics_exact_over_each_log_interval_and_epoch(tmp_path, one_device_mesh):
    x, y = lm_arrays(56, seed=3)
    train = batched(x, y, 8)  # 7 batches: the epoch ends between log points
    state0 = lm_state(tx=optax.sgd(0.0))  # parameters frozen: every step sees state0's
    sums = hand_sums(state0, train)
    seen = []

    def hook(event, run):
        if event == "log":
            seen.append((run.step, run.metrics["train/loss"]))

    _, history = fit(state0, train, loss_fn=lm_loss_fn, num_epochs=2, log_every=2,
                     hooks=[hook], mesh=one_device_mesh, **common(tmp_path))
    assert [s for s, _ in seen][:3] == [2, 4, 6] and seen[-1][0] == 14, seen
    prev = 0
    for step, value in seen:
        idx = [(s - 1) % len(train) for s in range(prev + 1, step + 1)]
        want = sum(sums[i][0] for i in idx) / sum(sums[i][1] for i in idx)
        assert rel(value, want) < 1e-5, (step, value, want)
        prev = step
    # The old rule (a plain mean over the interval's steps) gives another number.
    plain = np.mean([sums[i][0] / sums[i][1] for i in (0, 1)])
    assert abs(seen[0][1] - plain) > 1e-3, (seen[0][1], plain)
    epoch = sum(s[0] for s in sums) / sum(s[1] for s in sums)
    assert len(history["train/loss"]) == 2
    for value in history["train/loss"]:
        assert rel(value, epoch) < 1e-5, (history["train/loss"], epoch)
    acc = sum(s[2] for s in sums) / sum(s[1] for s in sums)
    assert rel(history["train/accuracy"][0], acc) < 1e-5


# ----------------------------------------------------------------------------------------------
# 3. Bad input

def _bad_weighted(kind, logits, y):
    """A Weighted whose weight (or total) is not a numeric scalar."""
    mask = y >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
    ce = jnp.where(mask, ce, 0.0)
    n = mask.sum().astype(jnp.float32)
    if kind == "vector_weight":  # one weight per row
        return Weighted(ce.sum(), mask.sum(-1).astype(jnp.float32))
    if kind == "vector_total":  # one total per row
        return Weighted(ce.sum(-1), n)
    return Weighted(ce.sum(), mask.any())  # a bool weight: not numeric


@pytest.mark.parametrize("where", ["loss_fn", "eval_step"])
@pytest.mark.parametrize("kind", ["vector_weight", "vector_total", "bool_weight"])
def test_non_scalar_or_non_numeric_weight_fails_before_compiling(tmp_path, one_device_mesh,
                                                                  compile_log, where, kind):
    x, y = lm_arrays(16, seed=4)

    def loss_fn(logits, y):
        total, n, _ = _token_metrics(logits, y)
        metrics = {"loss": _bad_weighted(kind, logits, y)} if where == "loss_fn" else {}
        return total / jnp.maximum(n, 1.0), metrics

    def eval_step(state, batch):
        logits = state.apply_fn({"params": state.params}, batch[0], train=False)
        total, n, _ = _token_metrics(logits, batch[1])
        good = Weighted(total, n)
        return {"loss": _bad_weighted(kind, logits, batch[1]) if where == "eval_step" else good}

    events = []
    workdir = tmp_path / "w"
    with pytest.raises(TypeError):
        fit(lm_state(), batched(x, y, 8), batched(x, y, 8), loss_fn=loss_fn, eval_step=eval_step,
            hooks=[lambda event, run: events.append(event)], mesh=one_device_mesh,
            **common(workdir))
    steps = compile_log.shapes("(_train_and_accumulate|_eval_and_accumulate)")
    assert steps == [], steps  # no train or eval step was compiled
    assert events == []  # no hook ran
    for sub in ("checkpoints", "logs"):
        assert not os.path.exists(workdir / sub) or not os.listdir(workdir / sub)


@pytest.mark.parametrize("where", ["train", "eval"])
def test_negative_weight_raises_naming_the_metric(tmp_path, one_device_mesh, where):
    x, y = lm_arrays(16, seed=5)

    def loss_fn(logits, y):
        total, n, _ = _token_metrics(logits, y)
        return total / jnp.maximum(n, 1.0), {"tok_loss": Weighted(total, -n if where == "train"
                                                                  else n)}

    def eval_step(state, batch):
        logits = state.apply_fn({"params": state.params}, batch[0], train=False)
        total, n, _ = _token_metrics(logits, batch[1])
        return {"tok_loss": Weighted(total, -n if where == "eval" else n)}

    with pytest.raises(ValueError) as info:
        fit(lm_state(), batched(x, y, 8), batched(x, y, 8), loss_fn=loss_fn, eval_step=eval_step,
            log_every=1, mesh=one_device_mesh, **common(tmp_path))
    assert "negative" in str(info.value) and "tok_loss" in str(info.value), str(info.value)


def test_eval_set_of_only_padding_raises(tmp_path, one_device_mesh):
    x, y = lm_arrays(16, seed=6)
    padding = [(np.zeros((4, L), np.int32), np.full((4, L), -1, np.int32))] * 2
    with pytest.raises(ValueError, match="weight"):
        fit(lm_state(), batched(x, y, 8), padding, loss_fn=lm_loss_fn, eval_step=lm_eval_step,
            mesh=one_device_mesh, **common(tmp_path))


def test_skipped_nonfinite_step_drops_its_weight(tmp_path, one_device_mesh):
    """The targets carry a per-row factor: 1, or NaN in one row of batch 2 only, which makes that
    step's loss (and gradients) NaN. With on_nonfinite="skip" the logged loss is the token-weighted
    mean over the other steps."""
    x, y = lm_arrays(40, seed=7)
    plain = batched(x, y, 8)
    factors = [np.ones(8, np.float32) for _ in plain]
    factors[2][3] = np.nan
    train = [(bx, (by, f)) for (bx, by), f in zip(plain, factors)]

    def loss_fn(logits, targets):
        y, factor = targets
        mask = y >= 0
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(y, 0))
        total = jnp.sum(jnp.where(mask, ce, 0.0) * factor[:, None])
        n = mask.sum().astype(jnp.float32)
        return total / jnp.maximum(n, 1.0), {"loss": Weighted(total, n)}

    state0 = lm_state(tx=optax.sgd(0.0))
    sums = hand_sums(state0, plain)
    seen = []

    def hook(event, run):
        if event == "log":
            seen.append((run.step, dict(run.metrics)))

    state, history = fit(state0, train, loss_fn=loss_fn, log_every=100, on_nonfinite="skip",
                         hooks=[hook], mesh=one_device_mesh, **common(tmp_path))
    good = [s for i, s in enumerate(sums) if i != 2]
    want = sum(s[0] for s in good) / sum(s[1] for s in good)
    assert np.all(np.isfinite(flat(state.params)))
    assert rel(history["train/loss"][0], want) < 1e-5, (history["train/loss"], want)
    assert len(seen) == 1 and seen[0][0] == 5
    assert rel(seen[0][1]["train/loss"], want) < 1e-5, (seen, want)
    assert seen[0][1]["train/skipped_steps"] == 1
    # Keeping the skipped step's weight (with its total zeroed) would give another number.
    diluted = sum(s[0] for s in good) / sum(s[1] for s in sums)
    assert abs(diluted - want) > 1e-3


# ----------------------------------------------------------------------------------------------
# 4. Gradient accumulation with optax.MultiSteps

def _mean_loss(logits, y):
    total, n, _ = _token_metrics(logits, y)
    return total / jnp.maximum(n, 1.0)


def test_multisteps_equals_a_hand_written_accumulation(tmp_path, one_device_mesh):
    x, y = lm_arrays(80, seed=8)
    train = batched(x, y, 8)  # 10 micro-batches: 2 updates, then 2 accumulated, not applied
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)
    state0 = lm_state(tx=tx)
    state, history = fit(state0, train, loss_fn=lm_loss_fn, mesh=one_device_mesh,
                         **common(tmp_path))
    assert int(jax.device_get(state.step)) == 10  # every micro-batch counts

    apply = state0.apply_fn
    grad = jax.jit(jax.grad(lambda p, x, y: _mean_loss(apply({"params": p}, x, train=True), y)))

    @jax.jit
    def update(params, opt, grads):
        updates, opt = inner.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    inner = optax.adam(1e-2)
    params = state0.params
    opt = inner.init(params)
    for g in range(len(train) // 4):
        gs = [grad(params, *train[4 * g + i]) for i in range(4)]
        mean = jax.tree.map(lambda *a: sum(a) / 4, *gs)
        params, opt = update(params, opt, mean)
    np.testing.assert_allclose(flat(state.params), flat(params), rtol=0, atol=1e-6)
    assert not np.allclose(flat(state.params), flat(state0.params))
    assert int(state.opt_state.gradient_step) == 2
    assert int(state.opt_state.mini_step) == 2


def test_multisteps_resume_mid_accumulation_is_bit_exact(tmp_path, one_device_mesh):
    x, y = lm_arrays(96, seed=9)
    train = batched(x, y, 8)  # 12 micro-batches, 3 updates
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)
    kw = dict(loss_fn=lm_loss_fn, log_every=2, mesh=one_device_mesh, verbose=0,
              tensorboard=False, log_name="acc")
    whole, _ = fit(lm_state(tx=tx), train, workdir=str(tmp_path / "a"), **kw)

    def stopper(event, run):
        if event == "log" and run.step >= 6:
            run.stop = True

    # A hook's stop is final for the same arguments (README, "Resuming"): the first call gives
    # max_steps=12 (the run's length) and the resume none, which asks it to go on.
    part, h1 = fit(lm_state(tx=tx), train, workdir=str(tmp_path / "b"), hooks=[stopper],
                   max_steps=12, **kw)
    stopped = int(jax.device_get(part.step))
    assert 6 <= stopped < 12 and stopped % 4, (stopped, h1.get("stopped"))
    assert int(part.opt_state.mini_step) == stopped % 4  # stopped mid-accumulation
    resumed, h2 = fit(lm_state(tx=tx), train, workdir=str(tmp_path / "b"), resume=True, **kw)
    assert h2.run == h1.run
    assert int(jax.device_get(resumed.step)) == int(jax.device_get(whole.step)) == 12
    assert np.array_equal(flat(resumed.params), flat(whole.params))
    assert np.array_equal(flat(resumed.opt_state), flat(whole.opt_state))


def test_multisteps_with_injected_hyperparams_logs_the_lr(tmp_path, one_device_mesh):
    x, y = lm_arrays(32, seed=10)
    tx = optax.MultiSteps(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
                          every_k_schedule=4)
    seen = []

    def hook(event, run):
        if event == "log":
            seen.append(run.metrics.get("train/lr"))

    _, history = fit(lm_state(tx=tx), batched(x, y, 8), loss_fn=lm_loss_fn, log_every=2,
                     hooks=[hook], mesh=one_device_mesh, **common(tmp_path))
    lrs = history.get("train/lr") or seen
    assert lrs and all(v is not None and abs(v - 1e-2) < 1e-9 for v in lrs), (history, seen)


# ----------------------------------------------------------------------------------------------
# 5. evaluate equals fit's own last eval

@pytest.mark.parametrize("with_eval_step", [True, False])
def test_evaluate_equals_fits_last_eval(tmp_path, with_eval_step):
    mesh = two_device_mesh()
    x, y = lm_arrays(32, seed=11)
    xe, ye = lm_arrays(15, seed=12)
    step = lm_eval_step if with_eval_step else None
    state, history = fit(lm_state(), (x, y), (xe, ye), loss_fn=lm_loss_fn, eval_step=step,
                         batch_size=4, num_epochs=2, mesh=mesh, **common(tmp_path))
    results = evaluate(state, (xe, ye), step, batch_size=4, mesh=mesh,
                       **({} if with_eval_step else {"loss_fn": lm_loss_fn}))
    assert set(results) == {"loss", "accuracy"}, results
    assert results["loss"] == history["eval/loss"][-1], (results, history["eval/loss"])
    assert results["accuracy"] == history["eval/accuracy"][-1]
    exact = hand_sums(state, batched(xe, ye, 4))
    want = sum(s[0] for s in exact) / sum(s[1] for s in exact)
    assert rel(results["loss"], want) < 1e-5, (results, want)


# ----------------------------------------------------------------------------------------------
# 6. load_ckpt(weights_only=True), resume by run name

def test_load_best_weights_only_into_another_optimizer(tmp_path, one_device_mesh):
    x, y = lm_arrays(32, seed=13)
    train = batched(x, y, 8)
    spe = len(train)
    scripted = [0.5, 0.2, 0.9]  # the eval loss after epochs 1, 2, 3: the best is epoch 2

    def eval_step(state, batch):
        return {"loss": jnp.asarray(scripted, jnp.float32)[state.step // spe - 1]}

    at_eval = {}

    def hook(event, run):
        if event == "eval":
            at_eval[run.step] = jax.device_get(run.state.params)

    state, history = fit(lm_state(tx=optax.adam(1e-2)), train, train[:1], loss_fn=lm_loss_fn,
                         eval_step=eval_step, num_epochs=3, monitor="eval/loss",
                         hooks=[hook], mesh=one_device_mesh, **common(tmp_path))
    assert sorted(at_eval) == [spe, 2 * spe, 3 * spe]
    best = at_eval[2 * spe]
    assert not np.array_equal(flat(best), flat(state.params))

    sgd_state = lm_state(tx=optax.sgd(0.1), seed=1)
    loaded = load_ckpt(sgd_state, history.ckpt_dir, "best", weights_only=True)
    assert np.array_equal(flat(loaded.params), flat(best))
    assert jax.tree.structure(loaded.opt_state) == jax.tree.structure(sgd_state.opt_state)
    for a, b in zip(jax.tree.leaves(loaded.opt_state), jax.tree.leaves(sgd_state.opt_state)):
        assert np.array_equal(a, b)
    assert int(jax.device_get(loaded.step)) == 0  # the rest of the state stays as it was
    assert sgd_state.rng is None and loaded.rng is None  # (not a key fit made up from seed 0)
    assert loaded.tx is sgd_state.tx
    # It trains on with its own optimizer.
    more, _ = fit(loaded, train, loss_fn=lm_loss_fn, mesh=one_device_mesh, log_name="tune",
                  **common(tmp_path))
    assert np.all(np.isfinite(flat(more.params)))
    assert not np.array_equal(flat(more.params), flat(best))


def test_resume_by_run_name(tmp_path, one_device_mesh):
    x, y = lm_arrays(32, seed=14)
    train = batched(x, y, 8)
    spe = len(train)
    kw = dict(loss_fn=lm_loss_fn, log_name="lm", mesh=one_device_mesh, **common(tmp_path))
    s1, h1 = fit(lm_state(), train, **kw)
    s2, h2 = fit(lm_state(seed=1), train, **kw)
    assert (h1.run, h2.run) == ("lm_1", "lm_2")
    s3, h3 = fit(lm_state(), train, resume="lm_1", num_epochs=2, **kw)
    assert h3.run == "lm_1"
    assert int(jax.device_get(s3.step)) == 2 * spe
    assert h3["step"] == [spe, 2 * spe]
    whole, _ = fit(lm_state(), train, num_epochs=2, loss_fn=lm_loss_fn, mesh=one_device_mesh,
                   **common(tmp_path / "whole"))
    assert np.array_equal(flat(s3.params), flat(whole.params))
    # lm_2 is untouched: resume=True would continue it, the latest
    s2b, h2b = fit(lm_state(seed=1), train, resume=True, **kw)
    assert h2b.run == "lm_2" and int(jax.device_get(s2b.step)) == spe

    runs = sorted(os.listdir(tmp_path / "checkpoints"))
    events = []
    with pytest.raises(ValueError, match="nope_7"):
        fit(lm_state(), train, resume="nope_7", hooks=[lambda e, r: events.append(e)], **kw)
    assert events == []
    assert sorted(os.listdir(tmp_path / "checkpoints")) == runs
    assert not os.path.exists(tmp_path / "logs" / "nope_7")
    assert not os.path.exists(tmp_path / "checkpoints" / "nope_7")
