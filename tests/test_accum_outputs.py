"""grad_accum true for every loss (#50). A loss that couples the rows of a batch (a two-tower
model's symmetric InfoNCE: each row's negatives are the batch's other rows) gets the whole
batch's update from `grad_accum_mode="outputs"` (GradCache), on 1 and 4 devices and per device
under `axis_name`; the default mode refuses it at the first step, before any update, and stays
silent for losses that sum over rows; a resume mid-run stays exact in both modes."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fit as fit_module
from conftest import CNN, flat, loss_fn, make_state
from fit import TrainState, fit
from test_accum import (max_abs, max_abs_diff, mean_of_microbatch_loss, uneven_tokens, update,
                        weighted_loss)
from test_weighted import common, lm_state

F = 16  # each tower's input features


class Towers(nn.Module):
    """Two small Dense towers; outputs both L2-normalised embeddings and a learnable logit scale
    (a leaf without rows: one value for any batch)."""

    @nn.compact
    def __call__(self, x, train):
        tower = lambda h, name: nn.Dense(8, name=f"{name}_out")(nn.relu(nn.Dense(
            32, name=f"{name}_in")(h)))
        unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
        scale = self.param("log_scale", lambda key: jnp.log(jnp.float32(10.0)))
        return unit(tower(x[:, :F], "a")), unit(tower(x[:, F:], "b")), jnp.exp(scale)


def info_nce(outputs, positive):
    """Symmetric InfoNCE: row i of the first tower pairs with row `positive[i]` of the second
    (a permutation, so that the loss depends on the rows' order, not only on their set)."""
    za, zb, scale = outputs
    logits = scale * za @ zb.T
    back = jnp.argsort(positive)
    ce = optax.softmax_cross_entropy_with_integer_labels
    return (ce(logits, positive).mean() + ce(logits.T, back).mean()) / 2


def clip_loss(outputs, _):
    """InfoNCE as CLIP writes it: row i pairs with row i of the batch it is given."""
    return info_nce(outputs, jnp.arange(outputs[0].shape[0]))


def blocked(local, rows):
    """Row indices of the whole batch from indices within each device's `rows` rows."""
    return local + rows * (jnp.arange(local.shape[0]) // rows)


def gathered_info_nce(outputs, local):
    """InfoNCE written for pmap: every device gathers all rows over the axis first; `local`: the
    positives' indices within each device's rows."""
    gather = lambda a: jax.lax.all_gather(a, "batch", tiled=True)
    za, zb, scale = outputs
    return info_nce((gather(za), gather(zb), scale), blocked(gather(local), local.shape[0]))


def towers_state(seed=0):
    model = Towers()
    params = model.init(jax.random.key(seed), np.zeros((1, 2 * F), np.float32), train=False)
    return TrainState.create(apply_fn=model.apply, params=params["params"], tx=optax.sgd(1.0))


def pairs(n, seed=0, block=None, shuffle=True):
    """`n` rows: the second tower's input is a noisy copy of the first's, at row `positive` (with
    `block`: within each `block` rows, the indices local to them; `shuffle=False`: row i)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, F)).astype(np.float32)
    block = block or n
    order = rng.permutation if shuffle else np.arange
    local = np.concatenate([order(block) for _ in range(n // block)]).astype(np.int32)
    positive = np.asarray(blocked(local, block))
    b = np.empty_like(a)
    b[positive] = a + 0.3 * rng.normal(size=a.shape).astype(np.float32)
    return np.concatenate([a, b], 1), local


def contrastive_batches(count, rows=64, block=None, shuffle=True):
    return [pairs(rows, seed, block, shuffle) for seed in range(count)]


def whole_batch_gradient(state, batch):
    x, positive = batch
    return jax.grad(lambda p: info_nce(state.apply_fn({"params": p}, x, train=True),
                                       positive))(state.params)


def mesh_of(devices):
    return Mesh(np.array(jax.devices()[:devices]), ("data",))


def trained(tmp_path, name, state0, batches, devices=1, fn=info_nce, **options):
    state, _ = fit(state0, batches, loss_fn=fn, mesh=mesh_of(devices), **common(tmp_path / name),
                   **options)
    return state


OUTPUTS = dict(grad_accum=4, grad_accum_mode="outputs")


# ----------------------------------------------------------------------------------------------
# 1. grad_accum_mode="outputs": the whole batch's update for a loss that couples the rows

@pytest.mark.parametrize("devices", [1, 4])
def test_the_outputs_mode_gives_the_whole_batchs_step(tmp_path, devices):
    batch = pairs(64)
    want = jax.tree.map(np.negative, jax.device_get(whole_batch_gradient(towers_state(), batch)))
    one = update(trained(tmp_path, "one", towers_state(), [batch], devices, **OUTPUTS),
                 towers_state())
    assert max_abs_diff(one, want) <= 1e-6 * max_abs(want)
    # Counter-check, so the test can fail: the microbatches' own losses (what the default mode
    # would sum, here by hand: each of 4 devices' j-th 4 rows) miss a quarter of the negatives.
    x, positive = batch
    rows = np.arange(64).reshape(devices, 4, -1).transpose(1, 0, 2).reshape(4, -1)
    parts = [whole_batch_gradient(towers_state(), (x[r], np.argsort(np.argsort(positive[r]))))
             for r in rows]
    summed = jax.tree.map(lambda *g: -sum(np.asarray(a, np.float64) for a in g) / 4, *parts)
    assert max_abs_diff(summed, want) > 0.1 * max_abs(want)
    # Ten steps end where grad_accum=1's do.
    batches = contrastive_batches(10)
    ten = trained(tmp_path, "ten", towers_state(), batches, devices, **OUTPUTS)
    ref = trained(tmp_path, "ref", towers_state(), batches, devices)
    np.testing.assert_allclose(flat(ten.params), flat(ref.params), atol=1e-5)


def test_the_outputs_mode_per_device_under_axis_name_is_the_step_of_one_batch(tmp_path):
    """With axis_name each device joins its own microbatches' outputs and calls the loss once, as
    its grad_accum=1 step does: a loss that gathers over the axis (pmap-era InfoNCE) sees all
    rows and gets the whole batch's update; a plain one sees the device's rows, as at k=1."""
    batches = contrastive_batches(2, block=16)  # (each device's 16 rows pair among themselves)
    per_device = dict(devices=4, axis_name="batch")
    gathered = trained(tmp_path, "g", towers_state(), batches, fn=gathered_info_nce,
                       **per_device, **OUTPUTS)
    whole = trained(tmp_path, "w", towers_state(), batches, fn=lambda o, local: info_nce(
        o, blocked(local, 16)))
    np.testing.assert_allclose(flat(gathered.params), flat(whole.params), atol=1e-6)
    local = trained(tmp_path, "l", towers_state(), batches, **per_device, **OUTPUTS)
    local_1 = trained(tmp_path, "l1", towers_state(), batches, **per_device)
    np.testing.assert_allclose(flat(local.params), flat(local_1.params), atol=1e-6)
    assert np.abs(flat(local.params) - flat(whole.params)).max() > 1e-2  # (the layouts differ)


def test_the_outputs_mode_keeps_dropout_masks_and_batchnorm_statistics(tmp_path, digits):
    """Each microbatch's second forward draws the dropout masks of its first (the same key), and
    BatchNorm normalises each microbatch by its own statistics, as in the default mode: for a
    mean loss the two modes take the same step, linen and nnx alike."""
    from flax import nnx
    from test_nnx import CNN as NnxCNN
    x, y, _, _ = digits
    data = dict(batch_size=32, max_steps=2, mesh=mesh_of(1))
    linen = [fit(make_state(CNN(), optax.sgd(0.1)), (x[:64], y[:64]), loss_fn=loss_fn, **data,
                 grad_accum=k, grad_accum_mode=mode, **common(tmp_path / f"{mode}{k}"))[0]
             for k, mode in ((4, "losses"), (4, "outputs"), (1, "losses"))]
    for part in ("params", "batch_stats"):
        np.testing.assert_allclose(flat(getattr(linen[1], part)), flat(getattr(linen[0], part)),
                                   atol=1e-6)
        # Counter-check: the microbatches' masks and statistics are not the whole batch's, so
        # the equality above says the two modes agree on them.
        assert np.abs(flat(getattr(linen[2], part)) - flat(getattr(linen[0], part))).max() > 1e-4
    ce = lambda logits, labels: loss_fn(logits, labels)[0]
    models = []
    for mode in ("losses", "outputs"):
        model = NnxCNN(nnx.Rngs(0))
        fit(model, (x[:64], y[:64]), optimizer=nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
            loss_fn=ce, grad_accum=4, grad_accum_mode=mode, **data, **common(tmp_path / f"n{mode}"))
        models.append(flat(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState)))))
    np.testing.assert_allclose(models[1], models[0], atol=1e-6)


def test_the_outputs_mode_refuses_what_it_cannot_split(tmp_path):
    """Outputs without the rows as leading axis; losses that call the model themselves; a bad
    mode: each refused before any work, saying what to do."""
    class Similarity(nn.Module):  # couples the rows inside the model: no output per row
        @nn.compact
        def __call__(self, x, train):
            z = nn.Dense(8)(x)
            return z @ z.T

    model = Similarity()
    state = TrainState.create(apply_fn=model.apply, params=model.init(
        jax.random.key(0), np.zeros((1, 2 * F)), train=False)["params"], tx=optax.sgd(1.0))
    with pytest.raises(TypeError, match=r"output \(the whole\) has shape \(16, 16\) for a "
                                        r"microbatch of 16 rows and \(64, 64\) for the batch"):
        trained(tmp_path, "sim", state, [pairs(64)], fn=lambda s, t: s.mean(), **OUTPUTS)
    with pytest.raises(ValueError, match=r"grad_accum_mode='outputs' .* your train_step calls "
                                         r"it itself"):
        fit(towers_state(), [pairs(64)], train_step=lambda s, b: (s, {}),
            grad_accum_mode="outputs")
    with pytest.raises(ValueError, match="grad_accum_mode must be 'losses' or 'outputs', got "
                                         "'exact'"):
        fit(towers_state(), [pairs(64)], loss_fn=info_nce, grad_accum=4, grad_accum_mode="exact")


def test_the_outputs_mode_refuses_an_nnx_loss_fn(tmp_path):
    from conftest import nnx_mlp
    from flax import nnx
    model = nnx_mlp(0)
    with pytest.raises(ValueError, match=r"your nnx_loss_fn calls it itself. Pass loss_fn="):
        fit(model, [pairs(64)], optimizer=nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param),
            nnx_loss_fn=lambda m, b, r: m(b[0]).mean(), **OUTPUTS, **common(tmp_path))


# ----------------------------------------------------------------------------------------------
# 2. The default mode: a loss that couples the rows raises at the first step, before any update

@pytest.mark.parametrize("devices", [1, 4])
def test_the_default_mode_refuses_a_loss_that_couples_the_batch(tmp_path, devices, monkeypatch):
    ran, step = [], fit_module._train_and_accumulate

    def counted(*args):  # the train step, marked where it runs (on the device, not at its trace)
        jax.debug.callback(lambda: ran.append(1))
        return step(*args)
    monkeypatch.setattr(fit_module, "_train_and_accumulate", counted)
    monkeypatch.setattr(fit_module, "_STEPS", type(fit_module._STEPS)())
    with pytest.raises(ValueError, match=r"with grad_accum=4 each microbatch's loss sees only its "
                                         r"own rows, but loss_fn couples the rows of a batch .* "
                                         r"is \d+\.\d% of its norm away .* Use "
                                         r"grad_accum_mode='outputs'"):
        trained(tmp_path, "acc", towers_state(), contrastive_batches(3, shuffle=False), devices,
                fn=clip_loss, grad_accum=4)
    assert ran == []  # no update ran (the step compiled beside the check, and never ran)
    # Counter-check: the marking sees a step that runs.
    trained(tmp_path, "one", towers_state(), contrastive_batches(1), devices)
    assert ran == [1]


def test_the_default_mode_refuses_a_coupled_nnx_loss_fn_naming_the_way_out(tmp_path):
    from flax import nnx

    class NnxTowers(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(F, 8, rngs=rngs), nnx.Linear(F, 8, rngs=rngs)

        def __call__(self, x):
            unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
            return unit(self.a(x[:, :F])), unit(self.b(x[:, F:])), jnp.float32(10.0)

    def nnx_loss(model, batch, rngs):
        return clip_loss(model(batch[0]), batch[1])
    model = NnxTowers(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"nnx_loss_fn couples the rows of a batch .* Use "
                                         r"loss_fn\(outputs, targets\) with grad_accum_mode="
                                         r"'outputs'"):
        fit(model, contrastive_batches(2, shuffle=False), optimizer=optimizer,
            nnx_loss_fn=nnx_loss, grad_accum=4, mesh=mesh_of(1), **common(tmp_path))


def test_losses_that_sum_over_rows_raise_nothing_and_are_checked_once(tmp_path, digits,
                                                                      monkeypatch):
    """No false alarm: a mean loss with BatchNorm and Dropout (eval mode: they do not count), a
    Weighted token loss over uneven microbatches, an nnx model's mean loss in nnx_loss_fn. The
    check runs once a call (at its first step), never in the compiled step."""
    from flax import nnx
    from test_nnx import CNN as NnxCNN
    calls = []
    check = fit_module._check_accum
    monkeypatch.setattr(fit_module, "_check_accum", lambda *a: calls.append(1) or check(*a))
    x, y, _, _ = digits
    data = dict(batch_size=32, max_steps=4, mesh=mesh_of(1))
    fit(make_state(CNN()), (x[:128], y[:128]), loss_fn=loss_fn, grad_accum=4, **data,
        **common(tmp_path / "cnn"))
    assert calls == [1]
    tokens = uneven_tokens()
    fit(lm_state(optax.sgd(0.1)), [tokens, tokens[::-1]], loss_fn=weighted_loss, grad_accum=4,
        mesh=mesh_of(1), **common(tmp_path / "lm"))
    model = NnxCNN(nnx.Rngs(0))

    def nnx_loss(model, batch, rngs):
        return loss_fn(model(batch[0]), batch[1])
    fit(model, (x[:128], y[:128]), optimizer=nnx.Optimizer(model, optax.adam(1e-3),
                                                           wrt=nnx.Param),
        nnx_loss_fn=nnx_loss, grad_accum=2, **data, **common(tmp_path / "nnx"))
    assert calls == [1, 1, 1]


# ----------------------------------------------------------------------------------------------
# 3. A resume in the middle of an accumulating run is exact in both modes

@pytest.mark.parametrize("mode", ["losses", "outputs"])
def test_a_resume_mid_run_is_exact(tmp_path, mode):
    """10 steps at once against 4, stopped mid-epoch, then resumed to 10: the same state. The
    default mode with a Weighted token loss; the outputs mode with InfoNCE. The resumed call of
    the default mode checks its first step again: a coupled loss raises there, and the run's
    checkpoint stays as it was."""
    if mode == "losses":
        x, y = uneven_tokens()
        batches = [(x[np.roll(np.arange(16), i)], y[np.roll(np.arange(16), i)]) for i in range(10)]
        make, fn = (lambda: lm_state(optax.adam(1e-2))), weighted_loss
    else:
        batches, make, fn = contrastive_batches(10), towers_state, info_nce
    run = lambda name, **kw: fit(make(), batches, loss_fn=fn, grad_accum=4, grad_accum_mode=mode,
                                 mesh=mesh_of(1), log_name=name, **common(tmp_path), **kw)[0]
    whole = run("whole")
    run("cut", max_steps=4)
    if mode == "losses":  # the resumed call's check runs before its first update
        with pytest.raises(ValueError, match="couples the rows of a batch"):  # (a token mean)
            fit(make(), batches, loss_fn=mean_of_microbatch_loss, grad_accum=4, resume=True,
                mesh=mesh_of(1), log_name="cut", **common(tmp_path))
    resumed = run("cut", resume=True)
    assert int(resumed.step) == 10
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_exact_in_the_outputs_mode(tmp_path):
    from test_robust import killed_once_and_resumed
    ref, final = killed_once_and_resumed("accum_outputs", tmp_path)  # (final params etc. bitwise)
    assert final.result()["history"]["train/loss"] == ref.result()["history"]["train/loss"]


def test_the_outputs_mode_keeps_one_copy_of_a_frozen_base_and_is_exact_with_it(tmp_path):
    """An nnx LoRA two-tower model (a 1024 x 1024 frozen base kernel, 4 MB, and rank-4
    adapters, `wrt=nnx.LoRAParam`) under CLIP's loss: grad_accum_mode="outputs" gives the
    whole batch's update with the base held once, however many microbatches (the base is closed
    over, not carried through the scan, whose backward would keep a copy a microbatch: 8
    microbatches against 2 would need 24 MB more temporaries)."""
    from flax import nnx

    class LoRATowers(nnx.Module):
        def __init__(self, rngs):
            self.base = nnx.LoRALinear(1024, 1024, lora_rank=4, rngs=rngs)
            self.a, self.b = nnx.Linear(1024, 8, rngs=rngs), nnx.Linear(1024, 8, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.base(x))
            unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
            return unit(self.a(h)), unit(self.b(h)), jnp.float32(10.0)

    x = np.random.default_rng(0).normal(size=(64, 1024)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    adapters, temps = {}, {}
    for k in (1, 2, 8):
        model = LoRATowers(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.LoRAParam)
        _, history = fit(model, [(x, np.zeros(64, np.int32))], optimizer=optimizer,
                         loss_fn=clip_loss, grad_accum=k, grad_accum_mode="outputs",
                         num_epochs=1, mesh=mesh, workdir=str(tmp_path / str(k)), verbose=0,
                         tensorboard=False)
        adapters[k], temps[k] = nnx.state(model, nnx.LoRAParam), history.timing[
            "step_temp_bytes"]
    assert max_abs_diff(adapters[8], adapters[1]) < 1e-6 * max(1.0, max_abs(adapters[1]))
    assert temps[8] - temps[2] < 8e6, temps  # (not 6 more copies of the 4 MB base)
