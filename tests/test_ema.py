"""fit.ema (#29): the average of the params kept in the optimizer state, evaluated beside the raw
weights, the best checkpoint chosen by either, loaded for inference; sharded, resumed exactly."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fit as fit_module
from conftest import CNN, MLP, eval_step, loss_fn, make_state, nnx_mlp
from fit import TrainState, evaluate, fit, load_ckpt

ema = fit_module.ema


def _hand_ema(params_by_step, decay, warmup=True):
    """The average over the params after each update, 1..N, from the initial params (step 0)."""
    average = params_by_step[0]
    for t in range(1, len(params_by_step)):
        d = min(decay, (1 + (t - 1)) / (10 + (t - 1))) if warmup else decay
        average = jax.tree.map(lambda e, p: d * e + (1 - d) * p, average, params_by_step[t])
    return average


def _params_after_each_step(run_kwargs, state, data, test, tmp_path, **options):
    """fit's params after every update (an eval at every step shows each state), and the state."""
    seen = {}

    def hook(event, run):
        if run.state is not None and event in ("train_start", "eval", "log"):
            seen[int(jax.device_get(run.state.step))] = jax.device_get(run.state.params)
    state, history = fit(state, data, test, hooks=[hook], eval_every=1, workdir=str(tmp_path),
                         verbose=0, tensorboard=False, **run_kwargs, **options)
    return [seen[t] for t in range(len(seen))], state, history


def _close(a, b, atol=1e-6):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=atol, rtol=1e-6)


def test_the_average_is_the_hand_computed_one_linen_cnn(digits, tmp_path, one_device_mesh):
    x, y, xt, yt = digits
    state = make_state(CNN(), tx=ema(optax.adam(1e-2), decay=0.9))
    params, state, history = _params_after_each_step(
        dict(loss_fn=loss_fn, eval_step=eval_step, batch_size=32, max_steps=12,
             mesh=one_device_mesh), state, (x[:384], y[:384]), (xt[:64], yt[:64]), tmp_path)
    assert len(params) == 13  # steps 0..12
    _close(fit_module._ema_params(state.opt_state), _hand_ema(params, 0.9))
    assert int(state.opt_state.fit_ema_count) == 12
    # Evaluated beside the raw weights at every eval, in the history (and so TensorBoard).
    assert len(history["eval_ema/accuracy"]) == len(history["eval/accuracy"]) == 12
    assert history["eval_ema/accuracy"] != history["eval/accuracy"]


def test_the_average_is_the_hand_computed_one_nnx(digits, tmp_path, one_device_mesh):
    from flax import nnx

    x, y, xt, yt = digits
    model = nnx_mlp(0)
    optimizer = nnx.Optimizer(model, ema(optax.adam(1e-2), decay=0.95), wrt=nnx.Param)
    params, _, _ = _params_after_each_step(
        dict(loss_fn=lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
            logits, labels).mean(), optimizer=optimizer, batch_size=32, max_steps=10,
             mesh=one_device_mesh), model, (x[:320], y[:320]), (xt[:64], yt[:64]), tmp_path)
    average = fit_module._ema_params(nnx.as_pure(optimizer.opt_state))
    _close(nnx.to_pure_dict(nnx.state(average)) if isinstance(average, nnx.State) else average,
           _hand_ema(params, 0.95))


def test_warmup_and_the_average_at_step_0():
    # sgd(1) on a gradient of -1: the params after update t are t; the average starts at 0.
    for warmup in (True, False):
        tx = ema(optax.sgd(1.0), decay=0.9, warmup=warmup)
        params = {"w": jnp.float32(0.0)}
        opt_state = tx.init(params)
        np.testing.assert_array_equal(opt_state.fit_ema_params["w"], 0.0)  # the EMA at step 0
        expected = 0.0
        for t in range(30):
            updates, opt_state = tx.update({"w": jnp.float32(-1.0)}, opt_state, params)
            params = optax.apply_updates(params, updates)
            d = min(0.9, (1 + t) / (10 + t)) if warmup else 0.9
            expected = d * expected + (1 - d) * float(t + 1)
            np.testing.assert_allclose(float(opt_state.fit_ema_params["w"]), expected, rtol=1e-6)
    # The first update's decay is 0.1 with the warm-up: the random init fades at once.
    tx = ema(optax.sgd(1.0), decay=0.999)
    _, opt_state = tx.update({"w": jnp.float32(-1.0)}, tx.init({"w": jnp.float32(0.0)}),
                             {"w": jnp.float32(0.0)})
    np.testing.assert_allclose(float(opt_state.fit_ema_params["w"]), 0.9, rtol=1e-6)


def test_bad_arguments_and_a_step_without_params(digits, tmp_path, one_device_mesh):
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\).*got 1.5"):
        ema(optax.adam(1e-3), decay=1.5)
    with pytest.raises(TypeError, match="warmup must be True or False"):
        ema(optax.adam(1e-3), warmup="yes")
    tx = ema(optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"fit.ema needs the params: call "
                                         r"tx.update\(grads, opt_state, params\)"):
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))

    def train_step(state, batch):  # a hand-written step that forgets the params
        grads = jax.tree.map(jnp.zeros_like, state.params)
        updates, opt_state = state.tx.update(grads, state.opt_state)
        return state.replace(opt_state=opt_state), {"loss": jnp.float32(0)}
    x, y, _, _ = digits
    with pytest.raises(ValueError, match="fit.ema needs the params"):
        fit(make_state(MLP(), tx=tx), (x[:64], y[:64]), train_step=train_step, batch_size=32,
            workdir=str(tmp_path), verbose=0, mesh=one_device_mesh)


def test_multisteps_averages_once_per_real_update_steps_per_jit_and_train_step_agree(
        digits, tmp_path, one_device_mesh):
    x, y, xt, yt = digits
    common = dict(loss_fn=loss_fn, batch_size=32, max_steps=12, mesh=one_device_mesh)
    tx = optax.MultiSteps(ema(optax.adam(1e-2), decay=0.9), every_k_schedule=3)
    params, state, _ = _params_after_each_step(common, make_state(MLP(), tx=tx),
                                               (x[:384], y[:384]), (xt[:64], yt[:64]),
                                               tmp_path / "a")
    assert int(state.opt_state.inner_opt_state.fit_ema_count) == 4  # 12 micro steps / 3
    _close(fit_module._ema_params(state.opt_state), _hand_ema(params[::3], 0.9))
    # steps_per_jit=4 runs the same updates, so the same average.
    single, _ = fit(make_state(MLP(), tx=ema(optax.adam(1e-2), 0.9)), (x[:384], y[:384]),
                    workdir=str(tmp_path / "b"), verbose=0, **common)
    grouped, _ = fit(make_state(MLP(), tx=ema(optax.adam(1e-2), 0.9)), (x[:384], y[:384]),
                     workdir=str(tmp_path / "c"), verbose=0, steps_per_jit=4, **common)
    _close(fit_module._ema_params(grouped.opt_state), fit_module._ema_params(single.opt_state))

    def train_step(state, batch):  # a hand-written step: apply_gradients passes the params
        loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn(
            {"params": p}, batch[0], train=True), batch[1])[0])(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}
    custom, _ = fit(make_state(MLP(), tx=ema(optax.adam(1e-2), 0.9)), (x[:384], y[:384]),
                    workdir=str(tmp_path / "d"), verbose=0, train_step=train_step, **common)
    _close(fit_module._ema_params(custom.opt_state), fit_module._ema_params(single.opt_state))


class Scalar:
    """A 'model' with one parameter w and output w: with loss -w and sgd(1), w after step t is t."""

    def apply(self, variables, x, train=False, **kwargs):
        return variables["params"]["w"] * jnp.ones(x.shape[0])


def _scalar_run(tmp_path, **options):
    state = TrainState.create(apply_fn=Scalar().apply, params={"w": jnp.float32(0.0)},
                              tx=ema(optax.sgd(1.0), decay=0.5, warmup=False))
    data = (np.zeros((8, 1), np.float32), np.zeros(8, np.float32))
    # The raw score peaks at step 3 (w = 3); the average's lags: 0.5, 1.25, 2.125, 3.0625 (step 4).
    score = lambda state, batch: {"score": -(state.params["w"] - 3.0) ** 2}
    return fit(state, data, data, loss_fn=lambda w, _: -w.mean(), eval_step=score, batch_size=8,
               num_epochs=8, workdir=str(tmp_path), verbose=0, **options)


def test_the_best_checkpoint_by_either_weights(tmp_path):
    state, history = _scalar_run(tmp_path / "raw")
    assert np.argmax(history["eval/score"]) + 1 == 3
    assert np.argmax(history["eval_ema/score"]) + 1 == 4
    template = TrainState.create(apply_fn=Scalar().apply, params={"w": jnp.float32(0.0)},
                                 tx=ema(optax.sgd(1.0), decay=0.5, warmup=False))
    best = load_ckpt(template, history.ckpt_dir, "best")  # the default monitor: eval/score
    assert int(best.step) == 3 and float(best.params["w"]) == 3.0

    seen = []
    state, history = _scalar_run(tmp_path / "ema", monitor="eval_ema/score", hooks=[
        fit_module.EarlyStopping(patience=2),
        lambda event, run: event == "eval" and seen.append(sorted(run.metrics))])
    best = load_ckpt(template, history.ckpt_dir, "best")
    assert int(best.step) == 4  # the average's best step, kept and ranked by it
    assert seen[0] == ["eval/score", "eval_ema/score"]  # what hooks see at an eval
    from test_core import scalars  # ... and TensorBoard, with the best by the monitor
    assert [s for s, _ in scalars(history.log_dir, "eval_ema/score")] == list(range(1, 7))
    assert scalars(history.log_dir, "best/eval_ema/score")[-1] == (6, -(3.0625 - 3) ** 2)
    assert float(load_ckpt(template, history.ckpt_dir, "best", ema=True).params["w"]) == 3.0625
    # EarlyStopping follows the same monitor: the average got worse after step 4, twice.
    assert history["eval/step"][-1] == 6 and "EarlyStopping at step 6" in history["stopped"][0]
    assert float(state.params["w"]) == 4.0  # restore_best: step 4's state

    with pytest.raises(ValueError, match=r"monitor='eval_ema/score' is not a metric"):
        _scalar_run(tmp_path / "off", monitor="eval_ema/score", ema_eval=False)
    with pytest.raises(TypeError, match="ema_eval must be True or False"):
        _scalar_run(tmp_path / "bad", ema_eval=1)


def test_eval_ema_is_evaluate_on_the_loaded_average(digits, tmp_path, one_device_mesh):
    x, y, xt, yt = digits
    common = dict(mesh=one_device_mesh, batch_size=32)
    state, history = fit(make_state(CNN(), tx=ema(optax.adam(1e-2), decay=0.9)),
                         (x[:320], y[:320]), (xt, yt), loss_fn=loss_fn, eval_step=eval_step,
                         num_epochs=2, workdir=str(tmp_path), verbose=0, **common)
    for template, weights_only in ((make_state(CNN(), tx=ema(optax.adam(1e-2), 0.9)), False),
                                   (make_state(CNN(), tx=optax.sgd(0.1)), True),
                                   (TrainState.create(apply_fn=CNN().apply, params=make_state(
                                       CNN()).params, batch_stats=make_state(CNN()).batch_stats),
                                    True)):
        loaded = load_ckpt(template, history.ckpt_dir, ema=True, weights_only=weights_only)
        _close(loaded.params, fit_module._ema_params(state.opt_state), atol=0)
        _close(loaded.batch_stats, state.batch_stats, atol=0)
        got = evaluate(loaded, (xt, yt), eval_step, **common)
        assert got["accuracy"] == history["eval_ema/accuracy"][-1]
    # Without ema=True the raw weights, as before.
    raw = load_ckpt(make_state(CNN(), tx=optax.sgd(0.1)), history.ckpt_dir, weights_only=True)
    _close(raw.params, state.params, atol=0)
    with pytest.raises(ValueError, match="pass weights_only=True"):
        load_ckpt(make_state(CNN(), tx=optax.sgd(0.1)), history.ckpt_dir, ema=True)
    with pytest.raises(TypeError, match="ema must be True or False"):
        load_ckpt(make_state(CNN()), history.ckpt_dir, ema="yes")


def test_ema_load_of_a_run_without_one_is_refused(digits, tmp_path, one_device_mesh):
    x, y, _, _ = digits
    _, history = fit(make_state(MLP()), (x[:64], y[:64]), loss_fn=loss_fn, batch_size=32,
                     workdir=str(tmp_path), verbose=0, mesh=one_device_mesh)
    with pytest.raises(ValueError, match="holds no fit.ema average"):
        load_ckpt(make_state(MLP()), history.ckpt_dir, ema=True, weights_only=True)


def test_nnx_ema_loads_with_and_without_the_optimizer(digits, tmp_path, one_device_mesh):
    from flax import nnx

    x, y, xt, yt = digits
    model = nnx_mlp(0)
    optimizer = nnx.Optimizer(model, ema(optax.adam(1e-2), decay=0.9), wrt=nnx.Param)
    accuracy = lambda model, batch: (model(batch[0]).argmax(-1) == batch[1]).mean()
    _, history = fit(model, (x[:320], y[:320]), (xt, yt), optimizer=optimizer,
                     loss_fn=lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
                         logits, labels).mean(), eval_step=accuracy, batch_size=32, num_epochs=2,
                     workdir=str(tmp_path), verbose=0, mesh=one_device_mesh)
    average = fit_module._ema_params(nnx.as_pure(optimizer.opt_state))
    fresh = nnx_mlp(1)
    for kwargs in ({"optimizer": nnx.Optimizer(fresh, ema(optax.adam(1e-2), 0.9), wrt=nnx.Param)},
                   {"weights_only": True}):
        target = fresh if "optimizer" in kwargs else nnx_mlp(2)
        loaded = load_ckpt(target, history.ckpt_dir, ema=True, **kwargs)
        _close(nnx.to_pure_dict(nnx.state(loaded, nnx.Param)), average, atol=0)
        got = evaluate(loaded, (xt, yt), accuracy, batch_size=32, mesh=one_device_mesh)
        assert got["accuracy"] == history["eval_ema/accuracy"][-1]


def test_the_average_is_sharded_as_the_params(digits, tmp_path, eight_device_mesh):
    x, y, _, _ = digits
    sharded = lambda s: s.replace(  # the params split over the devices; all else replicated
        params=jax.tree.map(lambda p: P(None, "data") if p.ndim == 2 and p.shape[1] % 8 == 0
                            else P(), s.params),
        opt_state=jax.tree.map(lambda _: P(), s.opt_state), step=P(), rng=P())
    state, _ = fit(make_state(MLP(), tx=ema(optax.adam(1e-3))), (x[:128], y[:128]),
                   loss_fn=loss_fn, batch_size=32, workdir=str(tmp_path), verbose=0,
                   mesh=eight_device_mesh, state_sharding=sharded)
    params, average = state.params, fit_module._ema_params(state.opt_state)
    assert params["Dense_1"]["kernel"].sharding.spec == P(None, "data")  # (64, 32): split
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(average), strict=True):
        assert a.sharding.is_equivalent_to(p.sharding, a.ndim), (a.sharding, p.sharding)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_exact_with_the_average(tmp_path):
    from test_robust import killed_once_and_resumed
    ref, final = killed_once_and_resumed("ema", tmp_path)  # (final params etc. bitwise)
    got, want = final.result()["history"], ref.result()["history"]
    assert got["eval_ema/accuracy"] == want["eval_ema/accuracy"]
    assert len(got["eval_ema/accuracy"]) == 4
    assert os.path.isdir(final.result()["ckpt_dir"])


def test_an_nnx_ema_outside_wrt_loads_weights_only_without_the_optimizer(
        digits, tmp_path, monkeypatch, one_device_mesh):
    # Flax's NNX diffusion example keeps an nnx.EMA in the model, its copies outside the
    # optimizer's `wrt`: fit files them with the other variables, and a sampling script loads the
    # weights without an optimizer, where every Param is a param. Also from the file before #29.
    from flax import nnx

    from conftest import fit_at

    class Diffusion(nnx.Module):
        def __init__(self, seed):
            self.net = nnx_mlp(seed)
            self.ema = nnx.EMA(self.net, decay=0.9)

        def __call__(self, x):
            return self.net(x)

    x, y, _, _ = digits
    loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
    for writer in (fit, fit_at("93d6bda", tmp_path, monkeypatch).fit):
        model = Diffusion(0)
        model.ema.params["a"]["bias"][...] = 7.0  # (the average differs from the net's weights)
        optimizer = nnx.Optimizer(model, optax.adam(1e-2),
                                  wrt=nnx.All(nnx.Param, nnx.PathContains("net")))
        _, history = writer(model, (x[:64], y[:64]), loss_fn=loss, optimizer=optimizer,
                            batch_size=32, workdir=str(tmp_path / writer.__module__), verbose=0,
                            mesh=one_device_mesh)
        loaded = load_ckpt(Diffusion(1), history.ckpt_dir, "last", weights_only=True)
        want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        _close(nnx.to_pure_dict(nnx.state(loaded, nnx.Param)), want, atol=0)
        assert float(loaded.ema.params["a"]["bias"][0]) == 7.0
    # A model that does not fit still says what differs.
    with pytest.raises(ValueError, match="does not fit this state"):
        load_ckpt(nnx_mlp(1), history.ckpt_dir, "last", weights_only=True)
