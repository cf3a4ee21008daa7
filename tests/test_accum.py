"""A `Weighted` loss and `grad_accum` (#30): the update of k microbatches equals the large batch's,
also for padded tokens whose microbatches hold different token counts (where a mean of means and
optax.MultiSteps do not); on 8 devices without moving data; resumed exactly; and the error a batch
of a new feature shape gets."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fit as fit_module
from conftest import MLP, flat, loss_fn, make_state, nnx_mlp
from fit import Weighted, fit
from test_weighted import _token_metrics, common, hand_sums, lm_arrays, lm_state


def weighted_loss(logits, y):
    total, n, correct = _token_metrics(logits, y)
    return Weighted(total, n), {"accuracy": Weighted(correct, n)}


def mean_of_microbatch_loss(logits, y):  # each (micro)batch's own token mean
    total, n, _ = _token_metrics(logits, y)
    return total / jnp.maximum(n, 1.0)


def uneven_tokens(rows=16, seed=0):
    """Rows sorted so that 4 microbatches of 4 rows hold 4, 8, 28 and 40 real tokens."""
    x, y = lm_arrays(400, seed)
    lengths = (y >= 0).sum(1)
    pick = [np.flatnonzero(lengths == n)[:4] for n in (1, 2, 7, 10)]
    idx = np.concatenate(pick)
    assert len(idx) == rows
    return x[idx], y[idx]


def update(state, state0):
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                        jax.device_get(state.params), jax.device_get(state0.params))


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_abs(a):
    return max(float(np.max(np.abs(u))) for u in jax.tree.leaves(a))


# ----------------------------------------------------------------------------------------------
# 1. Weighted as a loss

def test_a_weighted_loss_trains_in_both_forms_as_its_ratio(tmp_path, one_device_mesh):
    x, y = lm_arrays(64, seed=1)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    run = lambda fn, name: fit(lm_state(optax.sgd(0.1)), batches, loss_fn=fn, mesh=one_device_mesh,
                               **common(tmp_path / name))[0]
    ratio = run(mean_of_microbatch_loss, "ratio")
    alone = run(lambda logits, y: weighted_loss(logits, y)[0], "alone")
    paired = run(weighted_loss, "paired")
    np.testing.assert_allclose(flat(alone.params), flat(ratio.params), atol=1e-6)
    np.testing.assert_allclose(flat(paired.params), flat(ratio.params), atol=1e-6)
    # An unsummed mask as the weight is refused (it was taken for the model's output).
    unsummed = lambda logits, y: Weighted(_token_metrics(logits, y)[0], (y >= 0))
    with pytest.raises(TypeError, match=r"weights.sum\(\).*got shapes \(\) and \(16, 10\)"):
        run(unsummed, "unsummed")


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_train_loss_of_a_weighted_loss_is_token_exact_per_interval(tmp_path, one_device_mesh,
                                                                   grad_accum):
    x, y = lm_arrays(96, seed=2)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 96, 8)]
    state0 = lm_state(optax.sgd(0.0))  # the params stay: every step's loss is known by hand
    rows = []
    hook = lambda event, run: event == "log" and rows.append((run.step, run.metrics["train/loss"]))
    test = batches[:3]
    _, history = fit(state0, batches, test, loss_fn=weighted_loss, log_every=4, hooks=[hook],
                     mesh=one_device_mesh, grad_accum=grad_accum, **common(tmp_path))
    # The eval without eval_step is the loss's too: token-exact over the eval set.
    want = hand_sums(state0, test)
    want = sum(s[0] for s in want) / sum(s[1] for s in want)
    assert abs(history["eval/loss"][-1] - want) <= 2e-6 * abs(want)
    sums = hand_sums(state0, batches)
    assert [s for s, _ in rows] == [4, 8, 12]
    for i, (_, logged) in enumerate(rows):
        part = sums[4 * i:4 * i + 4]
        want = sum(s[0] for s in part) / sum(s[1] for s in part)
        assert abs(logged - want) <= 2e-6 * abs(want), (logged, want)


def test_a_weighted_loss_per_device_equals_one_device(tmp_path, one_device_mesh):
    x, y = uneven_tokens()  # each of 4 devices holds a different number of tokens
    batches = [(x, y)] * 2
    one, _ = fit(lm_state(optax.sgd(0.1)), batches, loss_fn=weighted_loss, mesh=one_device_mesh,
                 **common(tmp_path / "one"))
    for k in (1, 2):  # and in 2 microbatches per device (2 rows each)
        four, _ = fit(lm_state(optax.sgd(0.1)), batches, loss_fn=weighted_loss, axis_name="batch",
                      grad_accum=k, mesh=Mesh(np.array(jax.devices()[:4]), ("data",)),
                      **common(tmp_path / f"four{k}"))
        np.testing.assert_allclose(flat(four.params), flat(one.params), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# 2. grad_accum: the large batch's update

def _two_steps(tmp_path, name, state0, batches, fn, mesh, **options):
    state, history = fit(state0, batches, loss_fn=fn, mesh=mesh, **common(tmp_path / name),
                         **options)
    return update(state, state0), state, history


@pytest.mark.parametrize("devices", [1, 8])
def test_grad_accum_is_the_large_batch_update(tmp_path, devices):
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    x, y = uneven_tokens()
    x, y = np.tile(x, (devices, 1)), np.tile(y, (devices, 1))  # each device: those 16 rows
    lm = lambda: lm_state(optax.sgd(0.1))
    batches = [(x, y), (x[::-1], y[::-1])]  # 2 steps in a row
    whole = _two_steps(tmp_path, "whole", lm(), batches, weighted_loss, mesh)[0]
    accum = _two_steps(tmp_path, "accum", lm(), batches, weighted_loss, mesh, grad_accum=4)[0]
    assert max_abs_diff(accum, whole) <= 1e-5 * max_abs(whole)
    # Counter-checks, so the test can fail: a mean of the microbatches' token means, and
    # MultiSteps over the same microbatches, are not the large batch's update. fit refuses the
    # first (#50): the token mean couples the rows (its normaliser is the batch's token count).
    with pytest.raises(ValueError, match=r"grad_accum=4 each microbatch's loss sees only its own "
                                         r"rows, but loss_fn couples the rows of a batch .* is "
                                         r"\d+\.\d% of its norm away"):
        _two_steps(tmp_path, "means", lm(), batches, mean_of_microbatch_loss, mesh, grad_accum=4)
    if devices == 1:
        micro = [(bx[i:i + 4], by[i:i + 4]) for bx, by in batches for i in range(0, 16, 4)]
        multi0 = lm_state(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))
        multi = _two_steps(tmp_path, "multi", multi0, micro, mean_of_microbatch_loss, mesh)[0]
        assert max_abs_diff(multi, whole) > 1e-2 * max_abs(whole)
    # A mean loss (per example) accumulates to the large batch's too.
    d = jax.random.normal(jax.random.key(0), (16 * devices, 8, 8, 1))
    labels = np.arange(16 * devices) % 10
    img = [(np.asarray(d), labels)] * 2
    whole = _two_steps(tmp_path, "img", make_state(MLP(), optax.sgd(0.1)), img, loss_fn, mesh)[0]
    accum = _two_steps(tmp_path, "img4", make_state(MLP(), optax.sgd(0.1)), img, loss_fn, mesh,
                       grad_accum=4)[0]
    assert max_abs_diff(accum, whole) <= 1e-5 * max_abs(whole)


def test_microbatches_move_no_data_between_devices(eight_device_mesh, monkeypatch):
    x, y = lm_arrays(64, seed=3)
    opts = fit_module.Options(loss_fn=weighted_loss, grad_accum=4)
    state = fit_module._place_state(lm_state(optax.sgd(0.1)), 0, fit_module.NamedSharding(
        eight_device_mesh, fit_module.P()))
    train = fit_module._Data([(x, y)], "train_ds", opts, train=True)
    config = fit_module._StepConfig.of(opts, fit_module._linen_forward, None, eight_device_mesh,
                                       linen=True)
    monkeypatch.setattr(fit_module, "_STEPS", __import__("collections").OrderedDict())
    steps = fit_module._build_steps(state, train, None, config, eight_device_mesh)
    batch = fit_module._putter(eight_device_mesh, "data")((x, y))
    hlo = steps.train.lower(state, steps.acc0, batch).compile().as_text()
    assert " while(" in hlo  # the rolled scan over microbatches
    for op in ("all-to-all", "collective-permute", "all-gather"):
        assert f" {op}(" not in hlo and f" {op}-start(" not in hlo, op


def test_a_ragged_last_batch_trains_exactly_and_a_bad_batch_size_is_refused(
        tmp_path, one_device_mesh, digits):
    x, y, _, _ = digits
    x, y = x[:70], y[:70]  # batches of 32, 32 and 6 (6 rows: 3 microbatches of 2)
    run = lambda name, **kw: _two_steps(tmp_path, name, make_state(MLP(), optax.sgd(0.1)), (x, y),
                                        loss_fn, one_device_mesh, batch_size=32, **kw)
    whole, accum = run("whole")[0], run("accum", grad_accum=4)[0]
    assert max_abs_diff(accum, whole) <= 1e-5 * max_abs(whole)
    with pytest.raises(ValueError, match=r"grad_accum=4 splits each device's rows into 4 equal "
                                         r"microbatches, but the train batch size \(30\)"):
        fit(make_state(MLP()), (x, y), loss_fn=loss_fn, batch_size=30, grad_accum=4,
            mesh=one_device_mesh, **common(tmp_path / "bad"))
    with pytest.raises(ValueError, match="your train_step accumulates on its own"):
        fit(make_state(MLP()), (x, y), train_step=lambda s, b: (s, {}), grad_accum=2,
            batch_size=32)
    with pytest.raises(ValueError, match="grad_accum must be a positive integer"):
        fit(make_state(MLP()), (x, y), loss_fn=loss_fn, grad_accum=0, batch_size=32)


def test_grad_accum_with_steps_per_jit_and_nnx(tmp_path, one_device_mesh, digits):
    from flax import nnx
    x, y, _, _ = digits
    x, y = x[:128], y[:128]
    run = lambda name, **kw: _two_steps(tmp_path, name, make_state(MLP(), optax.sgd(0.1)), (x, y),
                                        loss_fn, one_device_mesh, batch_size=32, **kw)
    whole = run("whole")[0]
    assert max_abs_diff(run("both", grad_accum=2, steps_per_jit=2)[0], whole) <= \
        1e-5 * max_abs(whole)

    ce = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
    models = []
    for k in (1, 4):
        model = nnx_mlp(0)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        fit(model, (x, y), optimizer=optimizer, loss_fn=ce, batch_size=32, grad_accum=k,
            mesh=one_device_mesh, **common(tmp_path / f"nnx{k}"))
        models.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    before = nnx.to_pure_dict(nnx.state(nnx_mlp(0), nnx.Param))
    a, b = (jax.tree.map(lambda p, q: np.asarray(p) - np.asarray(q), m, before) for m in models)
    assert max_abs_diff(b, a) <= 1e-5 * max_abs(a)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_exact_with_grad_accum(tmp_path):
    from test_robust import killed_once_and_resumed
    ref, final = killed_once_and_resumed("accum", tmp_path)  # (final params etc. bitwise)
    assert final.result()["history"]["train/loss"] == ref.result()["history"]["train/loss"]


# ----------------------------------------------------------------------------------------------
# 3. A batch of another feature shape gets fit's error

def test_a_new_feature_shape_gets_fits_error(tmp_path, one_device_mesh, digits):
    from flax import nnx
    x, y, _, _ = digits
    flat_x = x.reshape(len(x), -1)
    batches = [(flat_x[:32], y[:32]), (flat_x[32:64, :32], y[32:64])]  # 64 features, then 32

    def own_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn(
            {"params": p}, batch[0], train=True), batch[1])[0])(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    model = nnx_mlp(0)
    cases = {"linen": (make_state(MLP()), dict(loss_fn=loss_fn)),
             "train_step": (make_state(MLP()), dict(train_step=own_step)),
             "nnx": (model, dict(optimizer=nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
                                 loss_fn=lambda o, t: loss_fn(o, t)[0]))}
    for name, (state, kwargs) in cases.items():
        want = (r"failed on the batch of shapes \(\(32, 32\), \(32,\)\) \(epoch 1, batch 1\), "
                r"which differ from the first batch's \(\(32, 64\), \(32,\)\)")
        with pytest.raises(ValueError, match=want) as e:
            fit(state, batches, mesh=one_device_mesh, **common(tmp_path / name), **kwargs)
        assert e.value.__cause__ is not None, name
