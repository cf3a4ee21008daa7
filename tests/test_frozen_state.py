"""#47: an nnx model's frozen base is the Params outside the optimizer's `wrt` that the step
leaves unchanged, and a resume trains on the base its checkpoint holds.

1. Flax's `nnx.EMA` kept inside the model (its averages are `nnx.Param`s outside `wrt`, updated
   in `nnx_loss_fn`) is state, not a frozen base: fit trains the model as the same loop written
   with `nnx.jit` does, saves the EMA, `load_ckpt(..., optimizer=)` restores it, and a run
   SIGKILLed mid-epoch resumes bit-identically. (The file before #47 refused the model at its
   first step: "the step changes ema/..., an nnx.Param outside the optimizer's wrt".)
2. A LoRA fine-tune on 8 simulated devices (tests/test_finetune.py's model, mesh data 2 x fsdp 2
   x tp 2), cut by `max_steps` or SIGKILLed after a step checkpoint, resumed into a model built
   anew whose base has other values: the adapters, the optimizer state and the evals equal the
   uninterrupted run's bit for bit (the steps read the checkpoint's base from the resumed run's
   first step); with save_frozen=False that resume is refused, naming the first path. (The file
   before #47 trained the resumed run against the caller's base, silently.)
3. What reads the base besides the step: `eval_metrics` (the model in eval mode, base and all) and
   `EarlyStopping(restore_best=True)` (the best checkpoint, base and all) on a LoRA run.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from conftest import assert_bitwise, nnx_arrays
from flax import nnx

import fit
from test_finetune import DATA, adapters, build, eval_tokens, mesh_of, token_loss

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUIET = dict(verbose=0, tensorboard=False)


# ----------------------------------------------------------------------------------------------
# 1. nnx.EMA inside the model

WRT = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("ema")))  # the optimizer leaves the EMA out


class WithEMA(nnx.Module):
    """An MLP for 8x8 inputs and, beside it, Flax's nnx.EMA of its parameters."""

    def __init__(self, rngs):
        self.net = nnx.Sequential(nnx.Linear(64, 16, rngs=rngs), nnx.relu,
                                  nnx.Linear(16, 10, rngs=rngs))
        self.ema = nnx.EMA(self.net, decay=0.9)

    def __call__(self, x):
        return self.net(x)


def ema_loss(model, batch, rngs):
    """The loss, and the EMA's update in it (as Flax's NNX diffusion example does in its step)."""
    x, y = batch
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    model.ema.update(model.net)
    return loss


def ema_model(seed=0):
    model = WithEMA(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=WRT)


def ema_data():
    """4 batches of 32 rows: 4 steps an epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 64)).astype(np.float32)
    y = rng.integers(0, 10, 128).astype(np.int32)
    return [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]


EMA_RUN = dict(nnx_loss_fn=ema_loss, num_epochs=3, log_every=1, ckpt_every=5)


def ema_of(model):
    return {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.state(model.ema)))}


def test_an_nnx_ema_in_the_model_trains_as_its_nnx_jit_loop_saves_and_loads(tmp_path, capsys):
    """fit (one device) against the same 12 steps written with nnx.jit, nnx.grad over `wrt` and
    `optimizer.update`: every array of the model (the EMA's too) within 1e-6 (equal here), the
    EMA moved off the weights it started from; the first line says the split (0 frozen, 4
    carried); `load_ckpt(fresh, ckpt_dir, optimizer=)` into a model of another seed restores
    the EMA and the weights bit for bit."""
    data = ema_data()
    hand, hand_opt = ema_model()

    @nnx.jit
    def step(model, optimizer, batch):
        grads = nnx.grad(lambda m: ema_loss(m, batch, None), argnums=nnx.DiffState(0, WRT))(model)
        optimizer.update(model, grads)

    for _ in range(3):
        for batch in data:
            step(hand, hand_opt, batch)
    model, opt = ema_model()
    start = ema_of(model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    _, history = fit.fit(model, data, optimizer=opt, mesh=mesh, workdir=str(tmp_path),
                         verbose=2, tensorboard=False, **EMA_RUN)
    said = capsys.readouterr().out
    assert "of the Params outside wrt 0 frozen and 4 carried as state" in said, said
    got, want = nnx_arrays(model, opt), nnx_arrays(hand, hand_opt)
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    trained = ema_of(model)
    assert max(np.abs(trained[k] - start[k]).max() for k in start) > 1e-3
    fresh, fresh_opt = ema_model(seed=1)
    fit.load_ckpt(fresh, history.ckpt_dir, optimizer=fresh_opt)
    assert_bitwise(ema_of(fresh), trained)
    assert_bitwise(nnx_arrays(fresh, fresh_opt), got)


def child(tmp_path, name, code, *args, devices=1):
    """Runs `code` in a child process (1 or 8 CPU devices) with `args` as sys.argv[1:], fit and
    this file importable."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(f"""\
        import os, signal, sys, time
        sys.path[:0] = [{ROOT!r}, {HERE!r}]
        import numpy as np
        import fit
        from conftest import nnx_arrays
        import test_frozen_state as t

        def kill_after(ckpt_step, at):  # SIGKILL at step `at`, once `ckpt_step` is committed
            def hook(event, run):
                if event == "log" and run.step == at:
                    deadline = time.time() + 120
                    while not os.path.isdir(os.path.join(run.ckpt_dir, str(ckpt_step))):
                        assert time.time() < deadline, "no checkpoint"
                        time.sleep(0.02)
                    os.kill(os.getpid(), signal.SIGKILL)
            return hook
        """) + textwrap.dedent(code))
    flags = "" if devices == 1 else "--xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=str(tmp_path))


EMA_CHILD = """\
    mode, workdir = sys.argv[1], os.path.join(os.getcwd(), "work")
    model, opt = t.ema_model(seed=1 if mode == "resume" else 0)
    hooks = [kill_after(5, 7)] if mode == "kill" else []
    fit.fit(model, t.ema_data(), optimizer=opt, workdir=workdir, resume=mode == "resume",
            hooks=hooks, **t.QUIET, **t.EMA_RUN)
    np.savez(os.path.join(os.getcwd(), mode + ".npz"), **nnx_arrays(model, opt))
    """


def test_an_nnx_ema_run_sigkilled_mid_epoch_resumes_bit_identically(tmp_path):
    """A child process trains the EMA model (one device, checkpoints every 5 steps) and is
    SIGKILLed at step 7, mid-epoch, after its step-5 checkpoint; another resumes it into a model
    of another seed: every array of the model (the EMA's too) and of the optimizer equals an
    uninterrupted child run's, bit for bit."""
    for mode in ("full", "kill", "resume"):
        workdir = tmp_path / "work"
        if mode == "kill":
            shutil.rmtree(workdir)  # (the full run's)
        done = child(tmp_path, "ema", EMA_CHILD, mode)
        if mode == "kill":
            assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
            saved = [int(d) for d in os.listdir(workdir / "checkpoints" / "run_1") if d.isdigit()]
            assert max(saved) == 5, saved
        else:
            assert done.returncode == 0, done.stderr[-3000:]
    full, resumed = (np.load(tmp_path / f"{mode}.npz") for mode in ("full", "resume"))
    assert_bitwise(dict(resumed), dict(full))


# ----------------------------------------------------------------------------------------------
# 2. A LoRA fine-tune resumed into a model of another base

LORA_RUN = dict(num_epochs=4, log_every=1, ckpt_every=5, batch_axes=("data", "fsdp"), **QUIET)


def lora(workdir, seed=0, **options):
    """The LoRA model of tests/test_finetune.py (its base from `seed`) trained on 8 devices with
    an eval set: `(model, optimizer, history)`."""
    mesh = mesh_of()
    model, opt = build(mesh, seed=seed)
    _, history = fit.fit(model, DATA, DATA, optimizer=opt, loss_fn=token_loss,
                         eval_step=eval_tokens, mesh=mesh, workdir=str(workdir),
                         **{**LORA_RUN, **options})
    return model, opt, history


def evals(history):
    return dict(zip(history["eval/step"], history["eval/loss"]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, opt, history = lora(tmp_path_factory.mktemp("lora"))
    return dict(adapters=adapters(model), opt=nnx_arrays(model, opt), evals=evals(history))


def optimizer_arrays(arrays):
    return {k: v for k, v in arrays.items() if k.startswith("opt")}


def assert_as_uninterrupted(model, opt, history, uninterrupted):
    """The adapters, optimizer state and evals (at the uninterrupted run's steps) bit for bit."""
    assert history["step"][-1] == 16
    assert_bitwise(adapters(model), uninterrupted["adapters"])
    assert_bitwise(optimizer_arrays(nnx_arrays(model, opt)),
                   optimizer_arrays(uninterrupted["opt"]))
    got = evals(history)
    assert {s: got[s] for s in uninterrupted["evals"]} == uninterrupted["evals"], got


def test_a_lora_cut_by_max_steps_resumes_on_its_checkpoints_base(uninterrupted, tmp_path):
    """Cut at step 13 by max_steps (save_frozen=True), resumed with resume=True into a model
    whose base (and adapters) come from seed 1: the run ends as the uninterrupted one, bit for
    bit, and the model ends with the checkpoint's base. The same run cut with save_frozen=False
    and resumed into that model is refused, naming the first path of the base that differs."""
    lora(tmp_path / "a", max_steps=13)
    model, opt, history = lora(tmp_path / "a", seed=1, resume=True)
    assert_as_uninterrupted(model, opt, history, uninterrupted)
    lora(tmp_path / "b", max_steps=13, save_frozen=False)
    with pytest.raises(ValueError, match="the model's base differs from that run's at "
                                         "emb/embedding"):
        lora(tmp_path / "b", seed=1, resume=True, save_frozen=False)


LORA_CHILD = """\
    mesh = t.mesh_of()
    model, opt = t.build(mesh)
    fit.fit(model, t.DATA, t.DATA, optimizer=opt, loss_fn=t.token_loss, eval_step=t.eval_tokens,
            mesh=mesh, workdir=os.path.join(os.getcwd(), "work"), hooks=[kill_after(10, 11)],
            **t.LORA_RUN)
    """


def test_a_lora_sigkilled_after_a_checkpoint_resumes_on_its_checkpoints_base(uninterrupted,
                                                                           tmp_path):
    """A child process (8 devices) trains the LoRA fine-tune and is SIGKILLed at step 11, after
    its step-10 checkpoint; resumed here into a model whose base comes from seed 1, the run ends
    as the uninterrupted one, bit for bit."""
    done = child(tmp_path, "lora_kill", LORA_CHILD, devices=8)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert "10" in os.listdir(tmp_path / "work" / "checkpoints" / "run_1")
    model, opt, history = lora(tmp_path / "work", seed=1, resume=True)
    assert_as_uninterrupted(model, opt, history, uninterrupted)


# ----------------------------------------------------------------------------------------------
# 3. What reads the base besides the step

def one_device_lora(workdir, **options):
    mesh = mesh_of((1, 1, 1))
    model, opt = build(mesh)
    _, history = fit.fit(model, DATA, DATA, optimizer=opt, loss_fn=token_loss,
                         eval_step=eval_tokens, mesh=mesh, workdir=str(workdir), num_epochs=4,
                         **QUIET, **options)
    return model, history


def test_eval_metrics_get_a_lora_model_with_its_base(tmp_path):
    """On a LoRA run with a frozen base (one device), an `eval_metrics` function gets the model
    with its base: the token loss it computes in Python equals eval_step's. (The file before
    #47 raised "Incorrect number of leaves": the model without its base.)"""
    def python_loss(model, batches):
        totals = [token_loss(model(x), targets) for x, targets in batches]
        return float(sum(w.total for w in totals) / sum(w.weight for w in totals))

    _, history = one_device_lora(tmp_path, eval_metrics={"python_loss": python_loss})
    assert len(history["eval/python_loss"]) == 4
    np.testing.assert_allclose(history["eval/python_loss"], history["eval/loss"], rtol=1e-5)


def test_early_stopping_restores_a_lora_runs_best_checkpoint(tmp_path):
    """On a LoRA run with a frozen base (one device) that a hook stops after epoch 2, its best
    the first eval (mode='max'), EarlyStopping's restore_best loads the best checkpoint (base and
    all) at the end: the model returned holds the best step's adapters, not the last's. (The file before #47 raised there:
    "batch_stats/emb/embedding: in the checkpoint, not in the state".)"""
    stop_at_2 = lambda event, run: setattr(run, "stop", event == "epoch_end" and run.epoch == 1)
    model, history = one_device_lora(tmp_path, hooks=[fit.EarlyStopping(patience=9), stop_at_2],
                                     monitor="eval/loss", mode="max")  # (the best: the first)
    assert history["stopped"] == ["<lambda> at step 8"] and history["eval/step"] == [4, 8]
    assert history["eval/loss"][0] > history["eval/loss"][1]
    best = fit.load_ckpt(build(mesh_of((1, 1, 1)))[0], history.ckpt_dir, 4, weights_only=True)
    last = fit.load_ckpt(build(mesh_of((1, 1, 1)))[0], history.ckpt_dir, 8, weights_only=True)
    assert_bitwise(adapters(model), adapters(best))
    assert adapters(model).keys() == adapters(last).keys() and not all(
        np.array_equal(a, adapters(last)[k]) for k, a in adapters(model).items())
