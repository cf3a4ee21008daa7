"""What users met in the field, each a regression test of a fix:

A. A signal after the last train step (in the last eval, the final save or its commit, the
   train_end hooks) is honoured once the final checkpoint is committed: SIGTERM exits 143,
   Ctrl-C raises KeyboardInterrupt. Before, fit returned as if nothing had happened.
B. fit called off the main thread warns that it cannot catch signals, and trains.
C. Bad input fails early with a message that names it: a resume with another batch size (and a
   checkpoint of the older fit.py, which recorded none, still resumes); a loss_fn returning a
   dict; `~` in workdir and load_ckpt's directory; a URL as workdir; non-boolean switches.
D. An nnx model created sharded (FSDP, as Flax's nnx_toy_examples/10_fsdp_and_optimizer.py)
   trained with `state_sharding` of its own shardings failed on "incompatible devices": fit's
   rng sat on one device. One-device leaves are now replicated if scalar, else named.
E. A jitted step's errors print neither fit's options nor the user's optimizer: JAX prints the
   jitted function (a partial over the options) in its "incompatible devices" error.

Every fit call writes under tmp_path. The subprocess runs on one CPU device (`XLA_FLAGS=`)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import fit_at, nnx_arrays
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import fit
from fit import TrainState, load_ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = "3afe40f"  # the last fit.py whose checkpoints hold no batching record
QUIET = dict(verbose=0, tensorboard=False)


class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def tiny_state(state_class=TrainState):
    model = Tiny()
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.float32), train=False)["params"]
    return state_class.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def tiny_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def arrays(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)


def committed_steps(ckpt_dir):
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def tmp_dirs(ckpt_dir):
    return [d for d in os.listdir(ckpt_dir) if "orbax-checkpoint-tmp" in d]


def signal_at(sig, event, step):
    """A hook that sends this process `sig` at `event` of `step`."""
    def hook(e, run):
        if e == event and run.step == step:
            os.kill(os.getpid(), sig)
    return hook


def handler_for_test(signum, frame):  # pragma: no cover - only compared by identity
    raise AssertionError("the test's own SIGINT handler should not run")


# ----------------------------------------------------------------------------------------------
# A. A signal after the last step

CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    from test_field import arrays, signal_at, tiny_loss, tiny_state
    from fit import fit
    fit(tiny_state(), arrays(), batch_size=16, num_epochs=2, loss_fn=tiny_loss, verbose=0,
        tensorboard=False, workdir=sys.argv[2], hooks=[signal_at(signal.SIGTERM, "save", 8)])
    print("RETURNED", flush=True)
""")


@pytest.mark.slow  # (a fresh process: 5-25 s on 2 shared cores)
def test_sigterm_during_the_final_save_exits_143_after_committing_it(tmp_path):
    """A scheduler's SIGTERM that lands in the final save (step 8 of 8): the checkpoint of step
    8 is committed, then the process exits 143, as schedulers expect; fit does not return."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", CHILD, ROOT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, (done.returncode, done.stderr[-3000:])
    assert "RETURNED" not in done.stdout
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert committed_steps(ckpt_dir) == [8] and tmp_dirs(ckpt_dir) == []
    assert int(load_ckpt(tiny_state(), ckpt_dir).step) == 8


@pytest.mark.parametrize("event", ["save", "train_end"])
def test_ctrl_c_after_the_last_step_commits_the_final_checkpoint_then_interrupts(
        tmp_path, one_device_mesh, event):
    """Ctrl-C in the final save, or in the train_end hooks: the run was complete, so fit
    commits its checkpoint and then stops the script (KeyboardInterrupt) rather than swallow
    the Ctrl-C; the caller's handler comes back, and the run counts as finished."""
    kwargs = dict(batch_size=16, num_epochs=2, loss_fn=tiny_loss, mesh=one_device_mesh,
                  workdir=str(tmp_path), **QUIET)
    previous = signal.signal(signal.SIGINT, handler_for_test)
    try:
        with pytest.raises(KeyboardInterrupt):
            fit.fit(tiny_state(), arrays(), hooks=[signal_at(signal.SIGINT, event, 8)], **kwargs)
        assert signal.getsignal(signal.SIGINT) is handler_for_test
    finally:
        signal.signal(signal.SIGINT, previous)
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert committed_steps(ckpt_dir) == [8] and tmp_dirs(ckpt_dir) == []
    state, history = fit.fit(tiny_state(), arrays(), resume=True, **kwargs)
    assert int(state.step) == 8 and history.run == "run_1" and "stopped" not in history


# ----------------------------------------------------------------------------------------------
# B. Off the main thread

def test_fit_off_the_main_thread_warns_that_it_cannot_catch_signals_and_trains(
        tmp_path, one_device_mesh):
    out = {}

    def target():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out["state"], _ = fit.fit(tiny_state(), arrays(), batch_size=16,
                                          loss_fn=tiny_loss, mesh=one_device_mesh,
                                          workdir=str(tmp_path), **QUIET)
            out["warnings"] = [w for w in caught if issubclass(w.category, UserWarning)]
        except BaseException as e:  # (to the main thread's assertions)
            out["error"] = e

    previous = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=target)
    thread.start()
    thread.join(300)
    assert "error" not in out, "".join(traceback.format_exception(out["error"]))
    assert int(out["state"].step) == 4
    said = [str(w.message) for w in out["warnings"] if "off the main thread" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in out["warnings"]]
    assert "resume=True" in said[0]  # what to do about it
    assert signal.getsignal(signal.SIGINT) is previous


# ----------------------------------------------------------------------------------------------
# C. Bad input, named early

def test_resuming_with_another_batch_size_is_refused_before_training(tmp_path, one_device_mesh):
    kwargs = dict(loss_fn=tiny_loss, mesh=one_device_mesh, workdir=str(tmp_path), **QUIET)
    fit.fit(tiny_state(), arrays(128), batch_size=64, num_epochs=1, **kwargs)
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert committed_steps(ckpt_dir) == [2]
    with pytest.raises(ValueError) as e:
        fit.fit(tiny_state(), arrays(128), batch_size=32, num_epochs=2, resume=True, **kwargs)
    message = str(e.value)
    assert "global batch size of 64" in message and "32" in message, message
    assert "batch_size=64)" in message, message  # the option to pass (#31)
    assert "resume=False" in message, message  # the fix
    assert committed_steps(ckpt_dir) == [2] and tmp_dirs(ckpt_dir) == []  # nothing trained


def test_a_checkpoint_of_the_older_fit_resumes_and_then_records_its_batching(
        tmp_path, one_device_mesh, monkeypatch):
    """A checkpoint written by fit.py at 3afe40f holds no batching record: it must resume (not
    a KeyError), and the checkpoints of the resumed run record it, so a later resume with
    another batch size is refused."""
    old = fit_at(OLD, tmp_path, monkeypatch)
    workdir = str(tmp_path / "run")
    kwargs = dict(loss_fn=tiny_loss, mesh=one_device_mesh, workdir=workdir, **QUIET)
    old.fit(tiny_state(old.TrainState), arrays(128), batch_size=32, num_epochs=1, **kwargs)
    state, history = fit.fit(tiny_state(), arrays(128), batch_size=32, num_epochs=2,
                             resume=True, **kwargs)
    assert history.run == "run_1" and int(state.step) == 8
    assert history["step"] == [4, 8]
    with pytest.raises(ValueError, match="global batch size of 32"):
        fit.fit(tiny_state(), arrays(128), batch_size=16, num_epochs=3, resume=True, **kwargs)


def test_a_loss_fn_returning_a_dict_is_a_short_type_error_naming_loss_fn(
        tmp_path, one_device_mesh):
    def dict_loss(logits, labels):
        return {"loss": tiny_loss(logits, labels)}

    with pytest.raises(TypeError) as e:
        fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=dict_loss, mesh=one_device_mesh,
                workdir=str(tmp_path), **QUIET)
    message = str(e.value)
    assert "loss_fn" in message and "dict" in message and "'loss'" in message, message
    assert "scalar" in message and "(loss, {" in message, message  # the forms it may return
    assert len(message) < 600, message


def test_workdir_and_load_ckpt_expand_the_home_directory(tmp_path, one_device_mesh, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _, history = fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=tiny_loss,
                         mesh=one_device_mesh, workdir="~/x", **QUIET)
    assert history.ckpt_dir == str(tmp_path / "x" / "checkpoints" / "run_1")
    assert committed_steps(history.ckpt_dir) == [4]
    assert os.listdir(cwd) == []  # no folder named "~"
    assert int(load_ckpt(tiny_state(), "~/x/checkpoints/run_1").step) == 4


def test_a_url_workdir_is_refused_before_any_directory_is_made(tmp_path, monkeypatch):
    # (gs:// is served: tests/test_store.py; another scheme is refused, naming it)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=tiny_loss,
                workdir="s3://bucket/runs", **QUIET)
    assert "workdir" in str(e.value) and "s3://bucket/runs" in str(e.value), str(e.value)
    assert os.listdir(tmp_path) == []  # no ./gs: folder


def test_tensorboard_must_be_a_boolean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError) as e:
        fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=tiny_loss, tensorboard="False",
                verbose=0, workdir=str(tmp_path))
    assert "tensorboard" in str(e.value) and "'False'" in str(e.value), str(e.value)
    assert os.listdir(tmp_path) == []


def test_load_ckpt_weights_only_must_be_a_boolean(tmp_path, one_device_mesh):
    _, history = fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=tiny_loss,
                         mesh=one_device_mesh, workdir=str(tmp_path), **QUIET)
    with pytest.raises(TypeError) as e:
        load_ckpt(tiny_state(), history.ckpt_dir, weights_only="yes")
    assert "weights_only" in str(e.value) and "'yes'" in str(e.value), str(e.value)


# ----------------------------------------------------------------------------------------------
# D. Leaves on one device of a larger mesh

class FSDPMLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
        self.l1 = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def fsdp_model(mesh):
    """Parameters (and Adam's moments) created split over the mesh's "data" axis."""
    with jax.set_mesh(mesh):
        model = FSDPMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_an_fsdp_nnx_model_trains_with_state_sharding_of_its_own_shardings(tmp_path):
    """The FSDP toy example's way: `state_sharding=` the arrays' own shardings. fit's rng,
    made outside the mesh, sat on one device, and every step failed on "incompatible devices".
    Now it trains, keeps the layout, and ends where the same run without state_sharding does."""
    mesh = jax.make_mesh((8,), ("data",))  # (Explicit axes: jax.make_mesh's default)
    kwargs = dict(loss_fn=tiny_loss, mesh=mesh, batch_size=16, num_epochs=2, **QUIET)
    model, optimizer = fsdp_model(mesh)
    start = np.asarray(model.l1.kernel[...])
    fit.fit(model, arrays(), optimizer=optimizer, workdir=str(tmp_path / "own"),
            state_sharding=lambda s: jax.tree.map(lambda x: x.sharding, s), **kwargs)
    assert int(optimizer.step[...]) == 8
    assert not np.array_equal(np.asarray(model.l1.kernel[...]), start)
    assert model.l1.kernel[...].sharding.spec == P("data", None)
    model2, optimizer2 = fsdp_model(mesh)
    fit.fit(model2, arrays(), optimizer=optimizer2, workdir=str(tmp_path / "plain"), **kwargs)
    ours, theirs = nnx_arrays(model, optimizer), nnx_arrays(model2, optimizer2)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert np.allclose(ours[key], theirs[key], atol=1e-5), key


def one_device_for(name):
    """state_sharding: `name`'s leaf on device 0 alone, every other leaf replicated."""
    def state_sharding(state):
        where = lambda path, _: (SingleDeviceSharding(jax.devices()[0]) if jax.tree_util.keystr(
            path, simple=True, separator="/") == name else P())
        return jax.tree_util.tree_map_with_path(where, state)
    return state_sharding


def test_a_scalar_that_state_sharding_puts_on_one_device_is_replicated(
        tmp_path, eight_device_mesh):
    state, _ = fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=tiny_loss,
                       mesh=eight_device_mesh, state_sharding=one_device_for("step"),
                       workdir=str(tmp_path), **QUIET)
    assert int(state.step) == 4 and len(state.step.sharding.device_set) == 8


def test_a_larger_leaf_that_state_sharding_puts_on_one_device_is_named(
        tmp_path, eight_device_mesh):
    with pytest.raises(ValueError) as e:
        fit.fit(tiny_state(), arrays(), batch_size=16, loss_fn=tiny_loss,
                mesh=eight_device_mesh, state_sharding=one_device_for("params/Dense_0/kernel"),
                workdir=str(tmp_path), **QUIET)
    message = str(e.value)
    assert "params/Dense_0/kernel" in message and "(16, 4)" in message, message
    assert "one device" in message and "P()" in message, message  # what it is, and the fix
    assert not os.path.exists(tmp_path / "checkpoints")


# ----------------------------------------------------------------------------------------------
# E. Errors from inside the jitted step

def test_errors_of_the_jitted_step_print_neither_the_options_nor_the_optimizer(
        tmp_path, one_device_mesh, eight_device_mesh):
    """JAX's "incompatible devices" error prints the jitted function, a partial over fit's
    options (with the user's nnx optimizer in them); trace-time errors of the user's loss_fn and
    train_step reach the user as they were raised."""
    half = Mesh(np.array(jax.devices()[:4]), ("data",))

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    model = Plain(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    # l1's kernel on 4 of the mesh's 8 devices: the jitted step fails on incompatible devices.
    on_half = lambda s: jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(half, P()) if jax.tree_util.keystr(
            path, simple=True, separator="/") == "params/l1/kernel" else P(), s)

    def shape_loss(logits, labels):
        return (jnp.ones(3) + jnp.ones(4)).sum()

    def failing_step(state, batch):
        raise ValueError("the user's own error")

    cases = [
        (model, dict(optimizer=optimizer, loss_fn=tiny_loss, mesh=eight_device_mesh,
                     state_sharding=on_half), ValueError, "incompatible devices"),
        (tiny_state(), dict(loss_fn=shape_loss, mesh=one_device_mesh), TypeError,
         "incompatible shapes"),
        (tiny_state(), dict(train_step=failing_step, mesh=one_device_mesh), ValueError,
         "the user's own error"),
    ]
    for i, (state, kwargs, error, said) in enumerate(cases):
        with pytest.raises(error) as e:
            fit.fit(state, arrays(), batch_size=16, workdir=str(tmp_path / str(i)), **kwargs,
                    **QUIET)
        assert said in str(e.value), str(e.value)
        text = str(e.value) + "".join(traceback.format_exception(e.value))
        for leaked in ("Options(", "Optimizer(", "GradientTransformation"):
            assert leaked not in text, (leaked, text[-3000:])
