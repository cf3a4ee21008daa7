"""nnx models written the way Flax's own NNX guides write them, through fit: a CNN in the style
of the NNX MNIST tutorial (a Dropout built without rngs, called as `model(x, rngs=rngs)`)
trained with `nnx_loss_fn(model, batch, rngs)`; `nnx.ModelAndOptimizer` as the optimizer; an
object that is no optimizer; and a model whose parameters were created sharded over a
("data", "model") mesh, which keeps that layout without `state_sharding=`. Every fit call writes
under tmp_path."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from conftest import assert_bitwise, nnx_arrays
from jax.sharding import NamedSharding, PartitionSpec as P

import fit


class TutorialCNN(nnx.Module):
    """Two 3x3 convolutions with BatchNorm, 2x2 average pooling (8x8 -> 4x4), a hidden Linear
    layer and a Linear classifier, with Dropout after the first convolution and the hidden layer.
    As in the NNX MNIST tutorial, the Dropouts have no Rngs of their own: the caller hands them
    over at call time."""

    def __init__(self, *, rngs, dropout=0.025):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.drop1 = nnx.Dropout(dropout)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)
        self.hidden = nnx.Linear(4 * 4 * 64, 256, rngs=rngs)
        self.drop2 = nnx.Dropout(dropout)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = nnx.relu(self.bn1(self.drop1(self.conv1(x), rngs=rngs)))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
        x = nnx.relu(self.drop2(self.hidden(x.reshape(x.shape[0], -1)), rngs=rngs))
        return self.out(x)


def nnx_loss_fn(model, batch, rngs):
    x, y = batch
    logits = model(x, rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": (logits.argmax(-1) == y).mean()}


def eval_step(model, batch):  # the model in eval mode: Dropout off, no rngs needed
    x, y = batch
    return (model(x).argmax(-1) == y).mean()


def fresh(seed=0, lr=3e-3):
    model = TutorialCNN(rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def stop_at(step):
    def stop_hook(event, run):
        if event == "log" and run.step >= step:
            run.stop = True
    return stop_hook


QUIET = dict(verbose=0, tensorboard=False)


# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_tutorial_cnn_learns_the_digits(digits, tmp_path):
    """Measured on the 8 simulated CPU devices, seeds 0 and 1: 0.972 and 0.966 after 10 epochs
    (the last 357 digits are other writers' than the first 1440)."""
    x, y, xt, yt = digits
    epochs, steps = 10, 45  # 1440 / 32
    model = TutorialCNN(rngs=nnx.Rngs(0))
    tx = optax.adam(fit.lr_schedule(1e-2, steps_per_epoch=steps, epochs=epochs, warmup_epochs=1))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    out, h = fit.fit(model, (x, y), (xt, yt), optimizer=opt, nnx_loss_fn=nnx_loss_fn,
                     eval_step=eval_step, batch_size=32, num_epochs=epochs,
                     workdir=str(tmp_path), **QUIET)
    assert out is model
    assert int(opt.step[...]) == epochs * steps
    print("test accuracy:", h["eval/accuracy"])
    assert h["eval/accuracy"][-1] >= 0.95
    assert "train/accuracy" in h and h["train/loss"][-1] < h["train/loss"][0]
    # The model written back in place scores, in eval mode, what fit's last eval logged.
    model.eval()
    acc = float(np.mean(np.asarray(model(xt)).argmax(-1) == yt))
    assert acc == pytest.approx(h["eval/accuracy"][-1], abs=1e-6)


def test_the_tutorial_cnn_stopped_and_resumed_is_bitwise_the_uninterrupted_run(digits, tmp_path):
    """The dropout key of each step comes from fit (seed and step), not from the model, so a run
    stopped mid-epoch and resumed draws the same masks. Each run starts from freshly built
    objects with the same seeds."""
    x, y, _, _ = digits
    x, y = x[:256], y[:256]  # 8 steps an epoch
    common = dict(nnx_loss_fn=nnx_loss_fn, batch_size=32, log_every=1, workdir=str(tmp_path),
                  **QUIET)
    model, opt = fresh()
    before = nnx_arrays(model, opt)
    fit.fit(model, (x, y), optimizer=opt, num_epochs=2, log_name="full", **common)
    full = nnx_arrays(model, opt)
    assert int(opt.step[...]) == 16
    kernel = "model['hidden']['kernel']"
    assert not np.array_equal(before[kernel], full[kernel])

    # The same run again, fresh objects, same seeds: the same bits (nothing else is random).
    again, again_opt = fresh()
    fit.fit(again, (x, y), optimizer=again_opt, num_epochs=2, log_name="again", **common)
    assert_bitwise(nnx_arrays(again, again_opt), full)

    # Stopped by a hook mid-epoch (a hook's stop is final, README: the continuation asks for
    # more epochs), then resumed with resume=True into fresh objects.
    part, part_opt = fresh()
    fit.fit(part, (x, y), optimizer=part_opt, num_epochs=1, log_name="part", hooks=[stop_at(3)],
            **common)
    assert 3 <= int(part_opt.step[...]) < 8
    rest, rest_opt = fresh()
    _, h = fit.fit(rest, (x, y), optimizer=rest_opt, num_epochs=2, log_name="part", resume=True,
                   **common)
    assert h.run == "part_1" and int(rest_opt.step[...]) == 16
    assert_bitwise(nnx_arrays(rest, rest_opt), full)

    # Another seed draws other dropout masks: the key really comes from fit's seed.
    other, other_opt = fresh()
    fit.fit(other, (x, y), optimizer=other_opt, num_epochs=2, log_name="other", seed=1, **common)
    after = nnx_arrays(other, other_opt)
    assert not np.array_equal(after[kernel], full[kernel])


def test_model_and_optimizer_is_an_optimizer(digits, tmp_path):
    x, y, xt, yt = digits
    model = TutorialCNN(rngs=nnx.Rngs(0))
    opt = nnx.ModelAndOptimizer(model, optax.adam(3e-3), wrt=nnx.Param)  # (it holds the model)
    kernel = np.asarray(model.hidden.kernel[...])
    out, h = fit.fit(model, (x[:512], y[:512]), (xt, yt), optimizer=opt, nnx_loss_fn=nnx_loss_fn,
                     eval_step=eval_step, batch_size=32, num_epochs=3, log_every=4,
                     workdir=str(tmp_path), **QUIET)
    assert out is model and opt.model is model
    assert int(opt.step[...]) == 3 * 16
    assert h["train/loss"][-1] < 0.7 * h["train/loss"][0]
    assert not np.array_equal(np.asarray(model.hidden.kernel[...]), kernel)  # in place
    assert h["eval/accuracy"][-1] > 0.5
    # the optimizer's state was written back too (adam's first moment)
    assert np.abs(np.asarray(opt.opt_state[0].mu["hidden"]["kernel"][...])).max() > 0


class OwnRngsMLP(nnx.Module):
    """A Dropout with Rngs of its own: the model's state holds typed keys beside its weights."""

    def __init__(self, seed):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))))


def test_weights_only_load_of_a_model_with_rngs(digits, tmp_path):
    x, y, _, _ = digits
    model = OwnRngsMLP(0)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
    _, h = fit.fit(model, (x[:256], y[:256]), optimizer=opt, loss_fn=loss, batch_size=32,
                   workdir=str(tmp_path), **QUIET)
    weights = lambda m: [np.asarray(x) for x in jax.tree.leaves(nnx.state(m, nnx.Param))]
    for tx in (optax.sgd(0.1), None):  # into another optimizer, and into a bare model
        other = OwnRngsMLP(1)
        other_opt = tx and nnx.Optimizer(other, tx, wrt=nnx.Param)
        assert not np.array_equal(weights(other)[0], weights(model)[0])
        fit.load_ckpt(other, h.ckpt_dir, weights_only=True, optimizer=other_opt)
        for a, b in zip(weights(other), weights(model), strict=True):
            assert np.array_equal(a, b)
        assert other_opt is None or int(other_opt.step[...]) == 0


class NotAnOptimizer:
    """Has tx, step and wrt, but no opt_state; its repr is the whole model's, like nnx objects."""

    def __init__(self, model):
        self.model, self.tx, self.wrt = model, optax.adam(1e-3), nnx.Param
        self.step = nnx.OptState(jnp.array(0, jnp.uint32))

    def __repr__(self):
        return repr(self.model)


def test_an_optimizer_without_opt_state_is_a_short_type_error_and_with_it_trains(digits, tmp_path):
    x, y, _, _ = digits
    model = TutorialCNN(rngs=nnx.Rngs(0))
    bad = NotAnOptimizer(model)
    assert len(repr(bad)) > 300
    with pytest.raises(TypeError, match="opt_state") as e:
        fit.fit(model, (x[:64], y[:64]), optimizer=bad, nnx_loss_fn=nnx_loss_fn, batch_size=32,
                workdir=str(tmp_path), **QUIET)
    message = str(e.value)
    assert len(message) < 300, message
    assert "Conv(" not in message and "Linear(" not in message and "Param(" not in message
    assert list(tmp_path.iterdir()) == []  # refused before any directory was made

    # Given an opt_state too, the same kind of object (no nnx.Optimizer) is an optimizer: fit
    # trains with its tx and writes its opt_state and step back.
    real = nnx.Optimizer(model, bad.tx, wrt=nnx.Param)
    bad.opt_state, bad.step = real.opt_state, real.step
    kernel = np.asarray(model.hidden.kernel[...])
    fit.fit(model, (x[:64], y[:64]), optimizer=bad, nnx_loss_fn=nnx_loss_fn, batch_size=32,
            workdir=str(tmp_path), **QUIET)
    assert int(bad.step[...]) == 2 and int(real.step[...]) == 2
    assert not np.array_equal(np.asarray(model.hidden.kernel[...]), kernel)
    assert np.abs(np.asarray(real.opt_state[0].mu["hidden"]["kernel"][...])).max() > 0


class ShardedMLP(nnx.Module):
    """The hidden features split over the mesh's "model" axis (Megatron style: the first kernel
    by columns, the second by rows), declared with nnx.with_partitioning. Under a mesh of
    Explicit axes, JAX needs the sharding of the second layer's output (its contraction runs
    over the split axis): the `out_sharding` of explicit-sharding code."""

    def __init__(self, rngs, explicit=False):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.l1 = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=nnx.with_partitioning(zeros, ("model",)), rngs=rngs)
        self.l2 = nnx.Linear(32, 10, kernel_init=nnx.with_partitioning(init, ("model", None)),
                             rngs=rngs)
        self.explicit = explicit

    def __call__(self, x):
        h = nnx.relu(self.l1(x.reshape(x.shape[0], -1)))
        return self.l2(h, out_sharding=P("data", None)) if self.explicit else self.l2(h)


def layout(node, filter=nnx.Param):
    """Where each of a node's arrays lives: spec (P() and P(None) alike), mesh shape and mesh
    axis types, by path."""
    spec = lambda v: tuple(v.sharding.spec) + (None,) * (v.ndim - len(v.sharding.spec))
    return {jax.tree_util.keystr(path): (spec(v), v.sharding.mesh.shape_tuple,
                                         v.sharding.mesh.axis_types)
            for path, v in jax.tree_util.tree_leaves_with_path(nnx.as_pure(nnx.state(node, filter)))
            if isinstance(v, jax.Array)}


@pytest.mark.parametrize("axes, fit_under_mesh", [("auto", False), ("auto", True),
                                                  ("explicit", True), ("explicit", False)])
def test_a_model_created_sharded_keeps_its_shardings(digits, tmp_path, axes, fit_under_mesh):
    """Parameters created sharded (nnx.with_partitioning under jax.set_mesh: flax shards each
    annotated variable as it is created), trained without mesh= or state_sharding=. The model
    of a mesh with Explicit axes (jax.make_mesh's default) names that mesh's axes: fit runs it
    under the mesh its parameters name, called inside `jax.set_mesh` or not (outside, it failed:
    a PartitionSpec without a mesh). The model keeps its parameters' shardings, and the
    optimizer its moments'."""
    x, y, _, _ = digits
    types = (jax.sharding.AxisType.Auto if axes == "auto" else jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=types, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        model = ShardedMLP(nnx.Rngs(0), explicit=axes == "explicit")
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # (its moments: annotated too)
    kernel = model.l1.kernel[...]
    assert isinstance(kernel.sharding, NamedSharding) and kernel.sharding.spec == P(None, "model")
    assert len({str(s.index) for s in kernel.addressable_shards}) == 2  # really split in two
    assert model.l2.kernel[...].sharding.spec == P("model", None)
    assert opt.opt_state[0].mu["l1"]["kernel"][...].sharding.spec == P(None, "model")
    before, before_opt, old = layout(model), layout(opt.opt_state, ...), np.asarray(kernel)

    loss = lambda model, batch, rngs: optax.softmax_cross_entropy_with_integer_labels(
        model(batch[0]), batch[1]).mean()
    with jax.set_mesh(mesh) if fit_under_mesh else contextlib.nullcontext():
        _, h = fit.fit(model, (x[:256], y[:256]), optimizer=opt, nnx_loss_fn=loss, batch_size=32,
                       num_epochs=2, log_every=4, workdir=str(tmp_path), **QUIET)
    assert int(opt.step[...]) == 16 and h["train/loss"][-1] < h["train/loss"][0]
    assert not np.array_equal(np.asarray(model.l1.kernel[...]), old)  # trained, in place
    assert layout(model) == before
    assert layout(opt.opt_state, ...) == before_opt
    assert len({str(s.index) for s in model.l1.kernel[...].addressable_shards}) == 2
