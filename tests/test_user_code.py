"""Programs written the way public Flax code is written, run through fit as their authors would
run them, following the README: each test is a case that failed on fit.py before it was fixed (a
list of bare array batches, the NNX tutorial's own loss function, a run cut by max_steps and
resumed, the messages of five common mistakes), and a resumed run whose best checkpoint came
before the stop."""
import os

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import MLP, eval_step, loss_fn, make_state
from flax import nnx

import fit as fit_module
from fit import EarlyStopping, TrainState, fit, load_ckpt

QUIET = dict(verbose=0, tensorboard=False)


def _batches(n_batches, seed=0, size=16):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, size).astype(np.int32)) for _ in range(n_batches)]


# A list of bare arrays: an autoencoder's batches are its inputs alone (Flax's VAE example).

class AutoEncoder(nn.Module):
    @nn.compact
    def __call__(self, x, noise):
        h = nn.relu(nn.Dense(16)(x + 0.01 * noise))
        return nn.Dense(x.shape[-1])(h)


def test_a_list_of_bare_array_batches_trains_with_your_own_steps(tmp_path, one_device_mesh):
    """Each batch is one numpy array. Iterating the list compared each batch with None, which
    a numpy array answers elementwise: fit failed at the second batch."""
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(8, 12)).astype(np.float32) for _ in range(4)]
    model = AutoEncoder()
    params = model.init(jax.random.key(0), batches[0], batches[0])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

    def train_step(state, batch, rng):
        noise = jax.random.normal(rng, batch.shape)
        loss_of = lambda p: ((state.apply_fn({"params": p}, batch, noise) - batch) ** 2).mean()
        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def eval_mse(state, batch):
        out = state.apply_fn({"params": state.params}, batch, jax.numpy.zeros_like(batch))
        return {"mse": ((out - batch) ** 2).mean()}

    _, history = fit(state, batches, batches, train_step=train_step, eval_step=eval_mse,
                     num_epochs=3, workdir=str(tmp_path), mesh=one_device_mesh, **QUIET)
    assert history["step"] == [4, 8, 12]
    assert history["eval/mse"][-1] < history["eval/mse"][0], history


# A run cut short by max_steps, then resumed to its end.

def test_a_run_cut_by_max_steps_and_resumed_logs_the_whole_epochs_means(
        tmp_path, one_device_mesh):
    """The cut call's last epoch gets a row, its means so far; resumed, that epoch goes on, and
    its row at its end holds the means of the whole epoch, as in an uninterrupted run (it held
    the means of the steps after the cut only). The cut's row stays: it was reported, and it
    counted for the best checkpoint and the hooks."""
    data = _batches(10)
    kwargs = dict(loss_fn=loss_fn, num_epochs=3, log_every=4, mesh=one_device_mesh, **QUIET)
    _, whole = fit(make_state(MLP()), data, workdir=str(tmp_path / "whole"), **kwargs)
    _, cut = fit(make_state(MLP()), data, workdir=str(tmp_path / "cut"), max_steps=9, **kwargs)
    assert cut["step"] == [9] and cut["epoch"] == [1]  # the cut epoch's row, in the cut call
    _, resumed = fit(make_state(MLP()), data, workdir=str(tmp_path / "cut"), resume=True,
                     **kwargs)
    assert whole["step"] == [10, 20, 30] and resumed["step"] == [9, 10, 20, 30], resumed
    assert resumed["epoch"] == [1, 1, 2, 3]
    for name in ("train/loss", "train/accuracy"):
        np.testing.assert_allclose(resumed[name][1:], whole[name], rtol=1e-6, err_msg=name)
        assert resumed[name][0] == cut[name][0], name


def test_a_save_due_at_the_cut_step_holds_the_cut_epochs_row_and_eval(tmp_path, one_device_mesh):
    """max_steps=9 with ckpt_every=3: the save of step 9 came before the cut epoch's row and
    eval, and the final save was skipped (the same step), so the checkpoint lacked both: the
    resumed run's history had no row and no eval at step 9."""
    kwargs = dict(loss_fn=loss_fn, eval_step=eval_step, num_epochs=2, ckpt_every=3,
                  workdir=str(tmp_path), mesh=one_device_mesh, **QUIET)
    _, cut = fit(make_state(MLP()), _batches(10), _batches(1, 1), max_steps=9, **kwargs)
    assert cut["step"] == [9] and cut["eval/step"] == [9], cut
    _, resumed = fit(make_state(MLP()), _batches(10), _batches(1, 1), resume=True, **kwargs)
    assert resumed["step"] == [9, 10, 20] and resumed["eval/step"] == [9, 10, 20], resumed
    assert resumed["train/loss"][0] == cut["train/loss"][0]


# The NNX MNIST tutorial's own loss function.

class TutorialMLP(nnx.Module):
    """As in the NNX MNIST tutorial: a Dropout without rngs of its own, called with rngs."""

    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        h = self.dropout(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))), rngs=rngs)
        return self.out(h)


def tutorial_loss_fn(model, rngs, batch):  # the tutorial's order, and its (loss, logits)
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits,
                                                           labels=batch["label"]).mean()
    return loss, logits


def test_the_nnx_tutorials_loss_fn_trains_as_it_is(digits, tmp_path):
    """`loss_fn(model, rngs, batch) -> (loss, logits)`, passed as nnx_loss_fn unchanged: fit
    calls it by its parameters' names and leaves out an aux that is not a dict of metrics. It
    failed twice: `batch` got the Rngs, then the logits were refused as metrics."""
    x, y, xt, yt = digits
    data = [{"image": x[i:i + 64], "label": y[i:i + 64]} for i in range(0, 640, 64)]
    test = [{"image": xt[i:i + 100], "label": yt[i:i + 100]} for i in range(0, 300, 100)]
    model = TutorialMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    _, history = fit(model, data, test, optimizer=optimizer, nnx_loss_fn=tutorial_loss_fn,
                     num_epochs=3, workdir=str(tmp_path), **QUIET)
    assert "train/loss" in history and "eval/loss" in history, history  # (no logits metric)
    assert history["eval/loss"][-1] < 0.5 * history["eval/loss"][0], history["eval/loss"]
    model.eval()
    logits = model(np.asarray(xt[:300]))
    exact = optax.softmax_cross_entropy_with_integer_labels(logits, yt[:300]).mean()
    np.testing.assert_allclose(history["eval/loss"][-1], float(exact), rtol=1e-5)


def test_a_dropout_without_rngs_under_loss_fn_points_to_nnx_loss_fn(tmp_path):
    model = TutorialMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    plain = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
    with pytest.raises(ValueError, match=r"^fit: .*Dropout.*nnx_loss_fn\(model, batch, rngs\)"):
        fit(model, _batches(2), optimizer=optimizer, loss_fn=plain, workdir=str(tmp_path),
            **QUIET)


def test_a_model_and_optimizer_given_as_the_state_is_explained(tmp_path):
    model = TutorialMLP(rngs=nnx.Rngs(0))
    both = nnx.ModelAndOptimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"fit\(state\.model, \.\.\., optimizer=state\)"):
        fit(both, _batches(2), nnx_loss_fn=tutorial_loss_fn, workdir=str(tmp_path), **QUIET)


# Messages.

class NoTrainArg(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def test_a_model_without_train_and_an_eval_of_loss_fn_is_told_to_pass_eval_step(
        tmp_path, one_device_mesh):
    """Your own train_step calls the model its way; the eval of loss_fn (no eval_step) is fit's
    call with train=False, so the advice is an eval_step (it was Flax's raw TypeError)."""
    model = NoTrainArg()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    def train_step(state, batch):
        x, y = batch
        loss_of = lambda p: loss_fn(state.apply_fn({"params": p}, x), y)[0]
        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with pytest.raises(TypeError, match=r"^fit: the model does not take train=") as info:
        fit(state, _batches(2), _batches(1), train_step=train_step, loss_fn=loss_fn,
            workdir=str(tmp_path), mesh=one_device_mesh, **QUIET)
    assert "own eval_step(state, batch)" in str(info.value), info.value
    with pytest.raises(TypeError, match=r"own eval_step\(state, batch\)"):
        fit_module.evaluate(state, _batches(1), loss_fn=loss_fn, mesh=one_device_mesh)


class NeedsTrain(nnx.Module):
    """An nnx model whose call requires a train flag, as many ported linen models do."""

    def __init__(self, *, rngs):
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x, train):
        return self.out(x.reshape(x.shape[0], -1))


def test_an_nnx_model_that_requires_train_is_told_to_pass_nnx_loss_fn(tmp_path):
    """fit calls an nnx model as model(inputs) under loss_fn; one that requires `train` got
    Python's raw "missing 1 required positional argument", and the advice for linen (your own
    train_step) does not apply to nnx models."""
    model = NeedsTrain(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"^fit: the model needs arguments that fit does not "
                                        r"pass") as info:
        fit(model, _batches(2), optimizer=optimizer, loss_fn=loss_fn, workdir=str(tmp_path),
            **QUIET)
    assert "own nnx_loss_fn(model, batch, rngs) and eval_step(model, batch)" in str(info.value)
    assert "'train'" in str(info.value) and "train_step" not in str(info.value), info.value
    # Called its way, it trains; the eval of nnx_loss_fn is the user's call too.
    call = lambda model, batch, rngs: loss_fn(model(batch[0], train=True), batch[1])
    _, history = fit(model, _batches(2), _batches(1), optimizer=optimizer, nnx_loss_fn=call,
                     workdir=str(tmp_path), **QUIET)
    assert history["step"] == [2] and "eval/loss" in history, history


class TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, x, mask, train):
        return nn.Dense(10)(x.reshape(x.shape[0], -1) * mask)


def test_a_linen_model_that_needs_more_inputs_is_told_to_pass_its_own_steps(
        tmp_path, one_device_mesh):
    """fit's default step calls apply_fn(variables, inputs, train=True): a model with a second
    input got Flax's raw "missing 1 required positional argument"."""
    model, x = TwoInputs(), np.zeros((4, 8), np.float32)
    params = model.init(jax.random.key(0), x, x, train=True)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"^fit: the model needs arguments that fit does not "
                                        r"pass") as info:
        fit(state, [(x, np.zeros(4, np.int32))], loss_fn=loss_fn, workdir=str(tmp_path),
            mesh=one_device_mesh, **QUIET)
    assert "'mask'" in str(info.value), info.value
    assert "own train_step(state, batch) -> (state, metrics)" in str(info.value), info.value


class Unreadable:
    """A callable whose signature Python cannot read (as some C or wrapped callables)."""
    __signature__ = 1

    def __call__(self, model, batch, rngs):
        return loss_fn(model(batch[0], train=True), batch[1])


def test_an_nnx_loss_fn_without_a_readable_signature_is_called_positionally(tmp_path):
    model = NeedsTrain(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    _, history = fit(model, _batches(2), optimizer=optimizer, nnx_loss_fn=Unreadable(),
                     workdir=str(tmp_path), **QUIET)
    assert history["step"] == [2], history


def test_a_fresh_run_from_a_trained_state_says_starting(tmp_path, one_device_mesh, capfd):
    """A notebook that trains a state further in a new run: that run starts (at the state's
    step), it does not resume."""
    kwargs = dict(loss_fn=loss_fn, workdir=str(tmp_path), mesh=one_device_mesh, verbose=2,
                  log_name="more")
    state, _ = fit(make_state(MLP()), _batches(3), **kwargs)
    fit(state, _batches(3), **kwargs)
    out, err = capfd.readouterr()
    assert "starting run 'more_2' at step 3" in out + err, out + err
    assert "resuming" not in out + err, out + err
    _, history = fit(make_state(MLP()), _batches(3), resume=True, num_epochs=2, **kwargs)
    assert "resuming run 'more_2' at step 6" in "".join(capfd.readouterr()), history


def test_the_bar_shows_the_latest_eval(tmp_path, one_device_mesh, capfd, monkeypatch):
    """The bar shows the monitored metric; after an eval it shows that eval's value (it kept
    the previous one until the next log point)."""
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    scripted = jax.numpy.array([0.25, 0.75])

    def scripted_eval(state, batch):  # 4 steps an epoch: 0.25 after epoch 1, 0.75 after 2
        return scripted[state.step // 4 - 1]

    fit(make_state(MLP()), _batches(4), _batches(1, 1), loss_fn=loss_fn,
        eval_step=scripted_eval, num_epochs=2, log_every=100, tensorboard=False,
        workdir=str(tmp_path), mesh=one_device_mesh)
    _, err = capfd.readouterr()
    bars = [s for s in err.replace("\r", "\n").splitlines() if "%|" in s]
    assert "accuracy=0.75" in bars[-1], bars


# The best checkpoint of a resumed run.

def _scripted_eval(accuracies, steps_per_epoch):
    table = jax.numpy.array(accuracies)

    def scripted(state, batch):  # the eval accuracy of each epoch, from the state's step
        return table[state.step // steps_per_epoch - 1]
    return scripted


def test_a_resumed_run_keeps_the_best_checkpoint_of_its_first_call(tmp_path, one_device_mesh):
    """The best eval (step 15) came before the stop; none after the resume beats it. orbax wrote
    no metrics to disk without best_fn, so the resumed manager took step 15 for a checkpoint
    without metrics and deleted it at its first save, and load_ckpt(..., "best") failed. And the
    kept best were recorded before the checkpoint's own value joined them, so after the resume
    an eval worse than the best (0.8 at step 20) was saved as if it entered the best."""
    scripted = _scripted_eval([0.5, 0.7, 0.9, 0.8, 0.65, 0.68], 5)
    kwargs = dict(loss_fn=loss_fn, eval_step=scripted, num_epochs=6, workdir=str(tmp_path),
                  mesh=one_device_mesh, **QUIET)
    fit(make_state(MLP()), _batches(5), _batches(1, 1), max_steps=15, **kwargs)
    saves = []
    record = lambda event, run: saves.append(run.step) if event == "save" else None
    _, history = fit(make_state(MLP()), _batches(5), _batches(1, 1), resume=True, hooks=[record],
                     **kwargs)
    assert history["eval/step"] == [5, 10, 15, 20, 25, 30]
    assert saves == [30], saves  # only the end: no eval after the resume enters the best
    kept = sorted(int(d) for d in os.listdir(history.ckpt_dir) if d.isdigit())
    assert kept == [15, 30], kept
    assert int(load_ckpt(make_state(MLP()), history.ckpt_dir, "best").step) == 15


def test_early_stopping_after_a_resume_restores_the_best_of_the_first_call(
        tmp_path, one_device_mesh):
    """EarlyStopping(restore_best=True) loads the best checkpoint at train_end: after a resume
    it raised, as that checkpoint had been deleted, and the run's result was lost."""
    scripted = _scripted_eval([0.5, 0.7, 0.9, 0.8, 0.65, 0.68], 5)
    kwargs = dict(loss_fn=loss_fn, eval_step=scripted, num_epochs=6, workdir=str(tmp_path),
                  mesh=one_device_mesh, **QUIET)
    fit(make_state(MLP()), _batches(5), _batches(1, 1), max_steps=15,
        hooks=[EarlyStopping(patience=2)], **kwargs)
    state, history = fit(make_state(MLP()), _batches(5), _batches(1, 1), resume=True,
                         hooks=[EarlyStopping(patience=2)], **kwargs)
    assert history["stopped"] == ["EarlyStopping at step 25"], history
    assert int(state.step) == 15


# Found on review.

class Annotated(nn.Module):
    """Written for model parallelism (Flax's "scale up" guide): a kernel split over a "model"
    axis, which fit's data-only mesh does not have. Outside a mesh of that axis the annotation
    is a no-op, so it trains data-parallel as it is."""

    @nn.compact
    def __call__(self, x, train):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        h = nn.relu(nn.Dense(16, kernel_init=init)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(h)


def test_a_model_annotated_for_a_model_axis_trains_on_the_default_mesh(tmp_path):
    model = Annotated()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32),
                        train=False)["params"]  # (boxed: nn.Partitioned, as init returns them)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    _, history = fit(state, _batches(4), loss_fn=loss_fn, num_epochs=2, workdir=str(tmp_path),
                     **QUIET)
    assert history["step"] == [4, 8]


class NextOnly:
    """An iterator with __next__ and no __iter__: iter() of its loader accepts it."""

    def __init__(self, batches):
        self.batches = list(batches)

    def __next__(self):
        if not self.batches:
            raise StopIteration
        return self.batches.pop(0)


class Loader:
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return NextOnly(self.batches)


def test_a_loader_whose_iterator_has_only_next(tmp_path, one_device_mesh):
    _, history = fit(make_state(MLP()), Loader(_batches(4)), loss_fn=loss_fn, num_epochs=2,
                     workdir=str(tmp_path), mesh=one_device_mesh, **QUIET)
    assert history["step"] == [4, 8]


def test_a_scalar_second_output_of_loss_fn_is_refused_with_the_fix(tmp_path, one_device_mesh):
    """`return loss, accuracy` means a metric without a name: refused (logits, an array, are left
    out for the NNX tutorial's loss_fn; a scalar was dropped without a word)."""
    def loss_and_accuracy(logits, labels):
        loss, metrics = loss_fn(logits, labels)
        return loss, metrics["accuracy"]

    with pytest.raises(TypeError, match=r"^fit: loss_fn's second output must be a dict"):
        fit(make_state(MLP()), _batches(2), loss_fn=loss_and_accuracy, workdir=str(tmp_path),
            mesh=one_device_mesh, **QUIET)


def test_fit_inside_jax_set_mesh_trains_on_that_mesh(tmp_path):
    """Code written for JAX's explicit sharding runs under `with jax.set_mesh(mesh):`. fit took
    all devices on a mesh of its own, which did not match the context's, and failed in its own
    step ("context mesh ... should match the aval mesh"); it now takes the context's mesh."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        state, history = fit(make_state(MLP()), _batches(4), _batches(1, 1), loss_fn=loss_fn,
                             eval_step=eval_step, num_epochs=2, workdir=str(tmp_path), **QUIET)
        assert int(load_ckpt(make_state(MLP()), history.ckpt_dir).step) == 8
    assert history["step"] == [4, 8] and len(history["eval/accuracy"]) == 2
    assert state.params["Dense_0"]["kernel"].sharding.mesh.devices.size == 4
