"""Length-bucketed batches: train and eval batches whose shapes differ beyond the batch size
(token batches (4, 8), then (4, 16)). Each new train shape compiles once and is timed as a
compile; eval over buckets stays exact; a stop mid-epoch resumes bit-identically; many shapes,
and shapes that break steps_per_jit's runs, warn once; a second call whose first batch comes from
another bucket compiles nothing; perf/compile_s is logged again when it grows; processes that
feed different shapes all raise the same error. Every fit call writes under pytest's tmp_path."""
import json
import os
import signal
import socket
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from fit import TrainState, Weighted, fit

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_buckets_child.py")
VOCAB, CLASSES, B = 32, 4, 4


# ----------------------------------------------------------------------------------------------
# A bag-of-tokens model that takes any length, and token batches of two lengths

class Bag(nn.Module):
    """Embed -> mean over the sequence -> Dense: one set of parameters for every length."""

    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(CLASSES)(nn.Embed(VOCAB, 16)(x).mean(1))


def bag_state(tx=None, model=None):
    model = model or Bag()
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.int32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx or optax.adam(1e-2))


def token_batch(rng, length, size=B):
    """Tokens 1..VOCAB-1 (0 pads) and a learnable label: the first token mod CLASSES."""
    x = rng.integers(1, VOCAB, (size, length)).astype(np.int32)
    return x, (x[:, 0] % CLASSES).astype(np.int32)


def token_batches(lengths, seed=0, size=B):
    rng = np.random.default_rng(seed)
    return [token_batch(rng, n, size) for n in lengths]


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


ALTERNATING = [8, 16] * 4  # 8 batches an epoch: L = 8, 16, 8, 16, ...


def quiet(tmp_path, **kw):
    return dict(workdir=str(tmp_path), verbose=0, **kw)


def leaves(state):
    """Every array the rest of a run depends on, by path, as numpy."""
    tree = jax.device_get((state.params, state.opt_state, state.step, state.rng))
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (
            k, np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))


def scalars(log_dir, tag):
    """[(step, value)] of one TensorBoard scalar tag in a run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


# ----------------------------------------------------------------------------------------------
# 1. Two lengths alternating: two train shapes, two compiles, and the run trains

def test_two_lengths_compile_two_train_shapes(tmp_path, one_device_mesh, compile_log):
    train = token_batches(ALTERNATING)
    start = compile_log.count()
    state, history = fit(bag_state(optax.adam(1e-2)), train, loss_fn=loss_fn, num_epochs=3,
                         log_every=3, mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    assert compile_log.count() - start == 2, compile_log.shapes()
    shapes = compile_log.shapes()[-2:]
    assert any("int32[4,8]" in m for m in shapes) and any("int32[4,16]" in m for m in shapes), \
        shapes
    assert history.timing["compile_count"] == 2, history.timing
    assert history.timing["steps"] == 24 and int(state.step) == 24
    assert history["step"] == [8, 16, 24]
    losses = history["train/loss"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------------------------
# 2. Dict batches whose varying leaf is not the first: the shape key covers every leaf

def dict_train_step(state, batch):
    def loss_of(params):
        logits = state.apply_fn({"params": params}, batch["z_tokens"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["a_label"]).mean()
    loss, grads = jax.value_and_grad(loss_of)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def dict_eval_step(state, batch):
    logits = state.apply_fn({"params": state.params}, batch["z_tokens"], train=False)
    return {"accuracy": (logits.argmax(-1) == batch["a_label"]).mean()}


def test_dict_batches_varying_in_a_later_leaf_compile_each_shape_once(tmp_path, one_device_mesh,
                                                                       compile_log):
    # In sorted key order "a_label" (B,) comes first and never changes; "z_tokens" (B, L) does.
    as_dicts = lambda batches: [{"a_label": y, "z_tokens": x} for x, y in batches]
    train, test = as_dicts(token_batches(ALTERNATING)), as_dicts(token_batches([8, 16, 8], 1))
    start = compile_log.count()
    state, history = fit(bag_state(), train, test, train_step=dict_train_step,
                         eval_step=dict_eval_step, num_epochs=2, log_every=2,
                         mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    assert compile_log.count() - start == 2, compile_log.shapes()
    # Two compiles timed as compiles (a key on the first leaf alone would see one shape, and
    # time the second compile as steady training).
    assert history.timing["compile_count"] == 2, history.timing
    assert int(state.step) == 16 and history["step"] == [8, 16]
    assert all(np.isfinite(history["train/loss"])) and len(history["eval/accuracy"]) == 2


# ----------------------------------------------------------------------------------------------
# 3. Eval over buckets is exact: Weighted metrics and per-batch means against a hand computation

def bucket_metrics(logits, x, y):
    """Per-row cross-entropy; `tokens`: a row's non-pad tokens (its weight in the token loss)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    tokens = (x > 0).sum(1).astype(jnp.float32)
    return ce, tokens


def weighted_eval_step(state, batch):
    x, y = batch
    logits = state.apply_fn({"params": state.params}, x, train=False)
    ce, tokens = bucket_metrics(logits, x, y)
    return {"token_loss": Weighted((ce * tokens).sum(), tokens.sum()),  # weighted by tokens
            "loss": ce.mean(),  # per-batch means: fit weights them by rows
            "accuracy": (logits.argmax(-1) == y).mean()}


def padded(batches, seed):
    """Rows padded (token 0) to random lengths, so tokens per row differ."""
    rng = np.random.default_rng(seed)
    out = []
    for x, y in batches:
        keep = rng.integers(1, x.shape[1] + 1, len(x))
        out.append((np.where(np.arange(x.shape[1]) < keep[:, None], x, 0).astype(np.int32), y))
    return out


def test_eval_over_buckets_is_exact(tmp_path, one_device_mesh):
    train = token_batches(ALTERNATING)
    rng = np.random.default_rng(7)
    # Buckets of lengths 8, 16, 24 and batch sizes 4, 4, 3, 2, 4: weights matter both ways.
    test = padded([token_batch(rng, n, size) for n, size in
                   [(8, 4), (16, 4), (24, 3), (8, 2), (16, 4)]], seed=8)
    state, history = fit(bag_state(), train, test, loss_fn=loss_fn, eval_step=weighted_eval_step,
                         num_epochs=2, mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    apply = jax.jit(lambda p, x: state.apply_fn({"params": p}, x, train=False))
    totals, tokens, losses, accuracies, rows = [], [], [], [], []
    for x, y in test:
        logits = apply(state.params, x)
        ce, tok = (np.asarray(a, np.float64) for a in bucket_metrics(logits, x, y))
        totals.append((ce * tok).sum())
        tokens.append(tok.sum())
        losses.append(ce.mean())
        accuracies.append((np.asarray(logits).argmax(-1) == y).mean())
        rows.append(len(x))
    rows = np.array(rows, np.float64)
    want = {"eval/token_loss": sum(totals) / sum(tokens),
            "eval/loss": (np.array(losses) * rows).sum() / rows.sum(),
            "eval/accuracy": (np.array(accuracies) * rows).sum() / rows.sum()}
    for name, value in want.items():
        got = history[name][-1]
        assert abs(got - value) <= 1e-6 * max(1.0, abs(value)), (name, got, value)
    # The weights matter here: an unweighted mean of the batches' means is another number.
    assert abs(np.mean(losses) - want["eval/loss"]) > 1e-3
    assert abs(np.mean(np.array(totals) / np.array(tokens)) - want["eval/token_loss"]) > 1e-3


# ----------------------------------------------------------------------------------------------
# 4. A stop mid-epoch (SIGINT from a hook) resumes bit-identically

RESUME_KW = dict(loss_fn=loss_fn, num_epochs=2, log_every=1, tensorboard=False, verbose=0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that the interrupted ones must end equal to: 2 epochs of ALTERNATING."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state, history = fit(bag_state(), token_batches(ALTERNATING), mesh=mesh,
                         workdir=str(tmp_path_factory.mktemp("full")), **RESUME_KW)
    assert history["step"] == [8, 16]
    return leaves(state), history


def test_sigint_mid_epoch_then_resume_is_bitwise_equal_to_an_uninterrupted_run(
        tmp_path, one_device_mesh, uninterrupted):
    train = token_batches(ALTERNATING)

    def interrupt(event, run):  # Ctrl-C in epoch 2 (the log of step 10 comes a step late)
        if event == "log" and run.step == 10:
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)
    try:
        stopped, h1 = fit(bag_state(), train, hooks=[interrupt], mesh=one_device_mesh,
                          workdir=str(tmp_path), **RESUME_KW)
    finally:
        signal.signal(signal.SIGINT, previous)
    stop = int(stopped.step)
    assert 10 < stop < 16 and h1["stopped"] == [f"SIGINT at step {stop}"], h1
    resumed, h2 = fit(bag_state(), train, resume=True, mesh=one_device_mesh,
                      workdir=str(tmp_path), **RESUME_KW)
    assert h2.run == h1.run and int(resumed.step) == 16
    full, full_history = uninterrupted
    assert_bitwise(leaves(resumed), full)
    assert h2["step"] == full_history["step"]
    assert h2["train/loss"] == full_history["train/loss"]


def test_max_steps_then_resume_is_bitwise_equal_to_an_uninterrupted_run(
        tmp_path, one_device_mesh, uninterrupted):
    train = token_batches(ALTERNATING)
    first, _ = fit(bag_state(), train, max_steps=5, mesh=one_device_mesh,
                   workdir=str(tmp_path), **RESUME_KW)
    assert int(first.step) == 5  # the resumed run starts with the other bucket (L=16)
    resumed, history = fit(bag_state(), train, resume=True, mesh=one_device_mesh,
                           workdir=str(tmp_path), **RESUME_KW)
    assert int(resumed.step) == 16
    full, full_history = uninterrupted
    assert_bitwise(leaves(resumed), full)
    # (the cut at max_steps=5 left a row of its partial epoch in the history)
    assert history["step"][-2:] == full_history["step"]
    assert history["train/loss"][-2:] == full_history["train/loss"]


# ----------------------------------------------------------------------------------------------
# 5. Warnings: many shapes, and shapes that break steps_per_jit's runs, each warn once

def _fit_warnings(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, history = fit(*args, **kwargs)
    return state, history, [w for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.slow  # 11 compiles: ~10 s alone, ~30 s on 2 cores shared with other runs
def test_many_shapes_warn_once_to_pad_to_buckets(tmp_path, one_device_mesh):
    lengths = list(range(2, 13))  # 11 distinct lengths: the warning comes at the 10th, once
    state, history, caught = _fit_warnings(
        bag_state(), token_batches(lengths), loss_fn=loss_fn, log_every=4,
        mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    about_buckets = [str(w.message) for w in caught if "bucket" in str(w.message)]
    assert len(about_buckets) == 1, [str(w.message) for w in caught]
    assert "pad" in about_buckets[0] and "10 shapes" in about_buckets[0], about_buckets
    assert not [w for w in caught if "steps_per_jit" in str(w.message)]
    assert int(state.step) == 11 and history.timing["compile_count"] == 11, history.timing


def test_steps_per_jit_with_alternating_shapes_warns_once_and_trains_every_step(
        tmp_path, one_device_mesh):
    state, history, caught = _fit_warnings(
        bag_state(), token_batches(ALTERNATING), loss_fn=loss_fn, log_every=2,
        steps_per_jit=2, mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    about_k = [str(w.message) for w in caught if "steps_per_jit" in str(w.message)]
    assert len(about_k) == 1, [str(w.message) for w in caught]
    assert "at step 1" in about_k[0], about_k  # batch 2 (L=16) broke the first run of 2
    assert int(state.step) == 8 and history["step"] == [8]
    assert history.timing["steps"] == 8 and history.timing["compile_count"] == 2
    assert all(np.isfinite(history["train/loss"]))


def test_steps_per_jit_warning_comes_once_per_fit_not_once_per_epoch(tmp_path, one_device_mesh):
    _, _, caught = _fit_warnings(
        bag_state(), token_batches([8, 16]), loss_fn=loss_fn, num_epochs=3, steps_per_jit=2,
        mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    about_k = [str(w.message) for w in caught if "steps_per_jit" in str(w.message)]
    assert len(about_k) == 1, about_k


# ----------------------------------------------------------------------------------------------
# 6. A second call whose first batch comes from the other bucket compiles nothing

def accuracy_eval_step(state, batch):
    x, y = batch
    logits = state.apply_fn({"params": state.params}, x, train=False)
    return (logits.argmax(-1) == y).mean()


def test_a_second_call_starting_with_the_other_bucket_compiles_nothing(tmp_path,
                                                                       one_device_mesh,
                                                                       compile_log):
    model, tx = Bag(), optax.adam(1e-2)
    train = token_batches(ALTERNATING)
    test = token_batches([8, 16], seed=1)
    kwargs = dict(loss_fn=loss_fn, eval_step=accuracy_eval_step, num_epochs=1,
                  mesh=one_device_mesh, **quiet(tmp_path, tensorboard=False))
    train_0, eval_0 = compile_log.count(), compile_log.count("_eval_and_accumulate")
    fit(bag_state(tx, model), train, test, **kwargs)
    train_1, eval_1 = compile_log.count(), compile_log.count("_eval_and_accumulate")
    assert train_1 - train_0 == 2 and eval_1 - eval_0 == 2, compile_log.shapes()
    # The same functions and optimizer, the batches reordered to start with L=16 (and the eval
    # batches too): the first call's steps are reused for both shapes.
    state, history = fit(bag_state(tx, model), train[1:] + train[:1], test[::-1], **kwargs)
    assert compile_log.count() - train_1 == 0, compile_log.shapes()[-2:]
    assert compile_log.count("_eval_and_accumulate") - eval_1 == 0
    assert int(state.step) == 8 and history["eval/accuracy"]
    assert history.timing["compile_count"] == 2  # (still timed as compiles: cache hits, fast)


# ----------------------------------------------------------------------------------------------
# 7. perf/compile_s is logged again when a new shape appears after the first log point

def test_compile_seconds_are_logged_again_for_a_later_shape(tmp_path, one_device_mesh):
    train = token_batches([8] * 6 + [16] * 6)  # L=16 first at step 7, after the log at step 2
    _, history = fit(bag_state(), train, loss_fn=loss_fn, num_epochs=1, log_every=2,
                     mesh=one_device_mesh, **quiet(tmp_path))
    points = scalars(history.log_dir, "perf/compile_s")
    assert len(points) == 2, points
    (s1, v1), (s2, v2) = points
    assert s1 == 2 and 2 < s2 <= 8 and 0 < v1 < v2, points
    assert v2 == pytest.approx(history.timing["compile_s"], rel=1e-5)
    assert history.timing["compile_count"] == 2


# ----------------------------------------------------------------------------------------------
# 8. Two processes that feed different lengths at one step both raise the same error

@pytest.mark.slow  # two processes with jax.distributed: ~20-40 s on 2 shared cores
def test_processes_feeding_different_lengths_raise_the_same_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 1 device a process (one GPU a process, as under SLURM; test_multihost runs 2): fit placed
    # its state there through addressable_shards, which JAX cannot list in that layout (#24).
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    procs = []
    for pid in range(2):
        with open(tmp_path / f"stderr_{pid}", "wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, CHILD, str(pid), str(port), str(tmp_path / "work"),
                 str(tmp_path)], stdout=subprocess.DEVNULL, stderr=err, env=env,
                start_new_session=True))
    try:
        codes = [p.wait(timeout=150) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    tails = "\n".join((tmp_path / f"stderr_{i}").read_text(errors="replace")[-2000:]
                      for i in range(2))
    assert codes is not None, "the processes hung (killed after 150 s):\n" + tails
    results = []
    for pid in range(2):
        path = tmp_path / f"result_{pid}.json"
        assert path.exists(), f"process {pid} wrote no result (exit {codes[pid]}):\n{tails}"
        results.append(json.loads(path.read_text()))
    for pid, result in enumerate(results):
        assert result.get("error"), (pid, result)
        assert result["error"]["type"] == "ValueError", result["error"]
        assert "different shapes" in result["error"]["message"], result["error"]
    assert results[0]["error"]["message"] == results[1]["error"]["message"]
    message = results[0]["error"]["message"]
    assert "process 0" in message and "process 1" in message and "step 3" in message, message
    # Each process stopped at the first log point after the mismatch (step 3), not later.
    assert all(r["last_log"] is None or r["last_log"] < 3 for r in results), results
    assert codes == [1, 1], (codes, tails)
