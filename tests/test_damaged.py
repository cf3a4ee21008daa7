"""Damaged checkpoints and failed saves: what the user sees, and that following it works.

1. A damaged latest checkpoint (a truncated or missing file, half a JSON file, a missing item, an
   emptied step directory) makes fit(resume=True), load_ckpt and load_ckpt(..., "best") raise one
   ValueError that names the step, its directory, the earlier steps and the `mv` that sets it
   aside: no raw tensorstore/JSON/KeyError text, no "another model or optimizer?".
2. Doing what it says (moving the step aside) resumes from the earlier step and ends bit-identical
   to the uninterrupted run, writing the moved step's number again.
3. A run whose only checkpoint is damaged is told there is none to go back to.
4. Nothing is printed after the caller has caught the error (reads still in flight used to print
   "Event loop is closed" tracebacks).
5. A failed save names the operating system's error wherever orbax put it (far past the first
   line, on a later line, or only in the exception's cause), and says "Free space" only for a
   full disk; a real full disk (a small tmpfs) raises it, and nothing is printed afterwards.

The damage is made in a copy of a run trained once per module (64 examples, batch 8, 2 epochs,
a checkpoint every 8 steps, max_to_keep=2: steps 8 and 16 both kept). Subprocess children run on
one CPU device (`XLA_FLAGS=` empty).
"""
import errno
import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fit as fit_module
from fit import TrainState, fit, load_ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # where fit.py is: the children import it from there too


# ----------------------------------------------------------------------------------------------
# Helpers: a tiny model, its data, the run's options, state comparison and the damage kinds

class TinyMLP(nn.Module):
    hidden: int = 16
    layers: int = 1

    @nn.compact
    def __call__(self, x, train):
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(4)(x)


def tiny_state(hidden=16, layers=1):
    model = TinyMLP(hidden, layers)
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.float32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def tiny_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def tiny_data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)


# 8 steps an epoch; no test set, and the monitor train/loss, so every save has a metric.
RUN = dict(loss_fn=tiny_loss, batch_size=8, num_epochs=2, ckpt_every=8, max_to_keep=2, verbose=0,
           tensorboard=False, monitor="train/loss")


def one_device():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def arrays(state):
    """Every array of a TrainState (params, opt_state, step, rng, batch_stats), by path."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(jax.device_get(state)):
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[jax.tree_util.keystr(path)] = np.asarray(x)
    return out


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def committed_steps(ckpt_dir):
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def empty_directory(path):
    for p in glob.glob(os.path.join(path, "*")):
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def truncate_state_file(step_dir):
    # state/d holds the OCDBT database's data (the process_0 files are merged into it).
    files = glob.glob(os.path.join(step_dir, "state", "d", "*"))
    assert files, os.listdir(os.path.join(step_dir, "state"))
    truncate(files[0], 10)


DAMAGES = {
    "state_file_truncated": truncate_state_file,
    "state_manifest_deleted": lambda d: os.remove(os.path.join(d, "state", "manifest.ocdbt")),
    "meta_truncated": lambda d: truncate(os.path.join(d, "meta", "metadata"),
                                         os.path.getsize(os.path.join(d, "meta", "metadata")) // 2),
    "meta_deleted": lambda d: shutil.rmtree(os.path.join(d, "meta")),
    "step_emptied": empty_directory,
    "state_metadata_deleted": lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
}


def damaged_copy(trained, tmp_path, damage, step=16):
    """A copy of the trained run's workdir with `step` damaged: (workdir, ckpt_dir)."""
    workdir = str(tmp_path / "work")
    shutil.copytree(trained["workdir"], workdir)
    ckpt_dir = os.path.join(workdir, "checkpoints", "run_1")
    DAMAGES[damage](os.path.join(ckpt_dir, str(step)))
    return workdir, ckpt_dir


def assert_damaged_message(error, who, ckpt_dir, step, earlier):
    """One ValueError that names the step, its directory, the cause in a line, the earlier steps
    and how to go on; none of the raw text of tensorstore, json or a structure mismatch."""
    message = str(error)
    assert type(error) is ValueError, (type(error), message)  # (JSONDecodeError is a ValueError)
    path = os.path.join(ckpt_dir, str(step))
    assert message.startswith(f"{who}: the checkpoint of step {step} at {path} is damaged and "
                              f"cannot be restored: "), message
    if earlier:
        assert f"The run's earlier checkpoints: steps {earlier}." in message, message
        assert f"To go on from step {earlier[-1]}, move the damaged one aside " \
               f"(mv {path} {path}.damaged), then call fit again with resume=True " \
               f"(or load_ckpt(..., step={earlier[-1]}))." in message, message
    else:
        assert "It is the run's only checkpoint" in message and "start a fresh run" in message, message
        assert "earlier checkpoints" not in message and "mv " not in message, message
    for raw in ("another model", "tensorstore_spec", "Traceback", "\n"):
        assert raw not in message, (raw, message)
    assert len(message) < 1000, message


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The uninterrupted run, once: its workdir (steps 8 and 16) and its final arrays."""
    workdir = str(tmp_path_factory.mktemp("trained"))
    state, history = fit(tiny_state(), tiny_data(), workdir=workdir, mesh=one_device(), **RUN)
    assert history.ckpt_dir == os.path.join(workdir, "checkpoints", "run_1")
    assert committed_steps(history.ckpt_dir) == [8, 16]
    return {"workdir": workdir, "final": arrays(state)}


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """A run with a single checkpoint (step 8 of one epoch, max_to_keep=1)."""
    workdir = str(tmp_path_factory.mktemp("trained_once"))
    _, history = fit(tiny_state(), tiny_data(), workdir=workdir, mesh=one_device(),
                     **{**RUN, "num_epochs": 1, "max_to_keep": 1})
    assert committed_steps(history.ckpt_dir) == [8]
    return {"workdir": workdir}


# ----------------------------------------------------------------------------------------------
# 1-3. The error, following it, a run with nothing to go back to

@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_latest_checkpoint_is_one_clear_error_naming_the_earlier_step(
        trained, tmp_path, one_device_mesh, damage):
    workdir, ckpt_dir = damaged_copy(trained, tmp_path, damage)
    listed = sorted(os.listdir(ckpt_dir))
    with pytest.raises(Exception) as raised:
        fit(tiny_state(), tiny_data(), workdir=workdir, resume=True, mesh=one_device_mesh, **RUN)
    assert_damaged_message(raised.value, "fit", ckpt_dir, 16, [8])
    with pytest.raises(Exception) as raised:
        load_ckpt(tiny_state(), ckpt_dir)
    assert_damaged_message(raised.value, "load_ckpt", ckpt_dir, 16, [8])
    assert sorted(os.listdir(ckpt_dir)) == listed  # nothing deleted or written
    # The step it names is intact.
    assert int(load_ckpt(tiny_state(), ckpt_dir, step=8).step) == 8


@pytest.mark.parametrize("damage", ["state_file_truncated", "meta_deleted"])
def test_following_the_message_resumes_bit_identical_and_writes_the_step_again(
        trained, tmp_path, one_device_mesh, damage):
    workdir, ckpt_dir = damaged_copy(trained, tmp_path, damage)
    with pytest.raises(ValueError) as raised:
        fit(tiny_state(), tiny_data(), workdir=workdir, resume=True, mesh=one_device_mesh, **RUN)
    moved = re.search(r"\(mv (\S+) (\S+)\)", str(raised.value))
    assert moved, str(raised.value)
    os.rename(moved.group(1), moved.group(2))  # what the message says to do
    state, history = fit(tiny_state(), tiny_data(), workdir=workdir, resume=True,
                         mesh=one_device_mesh, **RUN)
    assert history.run == "run_1" and history["step"] == [8, 16]
    assert_bitwise(arrays(state), trained["final"])
    # Step 16 is written again (orbax would refuse a step at or below the latest it lists), and
    # it is the uninterrupted run's; the damaged one stays aside.
    assert committed_steps(ckpt_dir) == [8, 16]
    assert os.path.isdir(os.path.join(ckpt_dir, "16.damaged"))
    assert_bitwise(arrays(load_ckpt(tiny_state(), ckpt_dir)), trained["final"])


@pytest.mark.parametrize("damage", ["state_file_truncated", "meta_truncated"])
def test_a_damaged_only_checkpoint_says_there_is_none_to_go_back_to(
        trained_once, tmp_path, one_device_mesh, damage):
    workdir, ckpt_dir = damaged_copy(trained_once, tmp_path, damage, step=8)
    with pytest.raises(Exception) as raised:
        fit(tiny_state(), tiny_data(), workdir=workdir, resume=True, mesh=one_device_mesh,
            **{**RUN, "num_epochs": 1, "max_to_keep": 1})
    assert_damaged_message(raised.value, "fit", ckpt_dir, 8, [])
    with pytest.raises(Exception) as raised:
        load_ckpt(tiny_state(), ckpt_dir)
    assert_damaged_message(raised.value, "load_ckpt", ckpt_dir, 8, [])


@pytest.mark.parametrize("damage", ["meta_truncated", "meta_deleted"])
def test_load_ckpt_best_with_the_latest_meta_damaged_is_the_same_clear_error(
        trained, tmp_path, damage):
    """'best' reads the latest step's meta (its best_step): that part is the damaged one."""
    _, ckpt_dir = damaged_copy(trained, tmp_path, damage)
    with pytest.raises(Exception) as raised:
        load_ckpt(tiny_state(), ckpt_dir, "best")
    assert_damaged_message(raised.value, "load_ckpt", ckpt_dir, 16, [8])


# ----------------------------------------------------------------------------------------------
# 4. Nothing printed after the caller caught the error

def child_env():
    return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def run_child(tmp_path, code, *args, timeout=240):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys, time
        sys.path[:0] = [{ROOT!r}, {HERE!r}]
        from fit import fit, load_ckpt
        from test_damaged import RUN, tiny_data, tiny_state
        """) + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, env=child_env(), timeout=timeout, cwd=str(tmp_path))


NOISE = ("Traceback", "Event loop is closed", "Task exception was never retrieved",
         "cannot schedule new futures")


def test_nothing_is_printed_after_the_damaged_checkpoint_error_is_caught(trained, tmp_path):
    workdir, ckpt_dir = damaged_copy(trained, tmp_path, "state_file_truncated")
    child = run_child(tmp_path, """\
        workdir, ckpt_dir = sys.argv[1:3]
        for who in ("fit", "load_ckpt"):
            try:
                if who == "fit":
                    fit(tiny_state(), tiny_data(), workdir=workdir, resume=True, **RUN)
                else:
                    load_ckpt(tiny_state(), ckpt_dir)
            except ValueError as e:
                print("CAUGHT", who, "damaged" in str(e), flush=True)
        time.sleep(1)  # reads still in flight come back meanwhile
        print("DONE", file=sys.stderr, flush=True)
        """, workdir, ckpt_dir)
    assert child.returncode == 0, child.stderr[-3000:]
    for noise in NOISE:
        assert noise not in child.stderr, child.stderr[-3000:]
    assert child.stderr.rstrip().endswith("DONE"), child.stderr[-3000:]
    assert child.stdout.splitlines() == ["CAUGHT fit True", "CAUGHT load_ckpt True"], child.stdout


# ----------------------------------------------------------------------------------------------
# 5. A failed save names the OS error wherever orbax put it

ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"


def far_on_the_first_line():
    return ValueError("RESOURCE_EXHAUSTED: Error writing " + "x" * 400 + f" [OS error 28: {ENOSPC}]")


def on_a_later_line():
    return ValueError("RESOURCE_EXHAUSTED: Error writing " + "x" * 400 + f"\n[OS error 28: {ENOSPC}]")


def only_in_the_cause():
    try:
        raise OSError(errno.ENOSPC, ENOSPC)
    except OSError as e:
        try:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing \"params.Dense_0.kernel/0.0\"") from e
        except ValueError as chained:
            return chained


def not_a_full_disk():
    try:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        try:
            raise ValueError("PERMISSION_DENIED: Error writing \"params.Dense_0.kernel/0.0\"") from e
        except ValueError as chained:
            return chained


@pytest.mark.parametrize("make_error", [far_on_the_first_line, on_a_later_line, only_in_the_cause,
                                        not_a_full_disk])
def test_a_failed_save_names_the_os_error_wherever_orbax_put_it(tmp_path, one_device_mesh,
                                                                monkeypatch, make_error):
    original, calls, raised_errors = fit_module.ocp.CheckpointManager.save, [], []

    def failing_save(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 2:
            raised_errors.append(make_error())
            raise raised_errors[-1]
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(fit_module.ocp.CheckpointManager, "save", failing_save)
    with pytest.raises(OSError) as raised:  # saves at steps 4 and 8 (the second fails)
        fit(tiny_state(), tiny_data(), workdir=str(tmp_path), mesh=one_device_mesh,
            **{**RUN, "num_epochs": 1, "ckpt_every": 4})
    monkeypatch.undo()
    assert calls == [4, 8]
    message = str(raised.value)
    assert raised.value.__cause__ is raised_errors[0]
    ckpt_dir = os.path.join(str(tmp_path), "checkpoints", "run_1")
    assert message.startswith(f"fit: saving the checkpoint of step 8 to {ckpt_dir} failed: "), message
    assert "The last good checkpoint is step 4, and it is intact." in message, message
    assert "call fit again with resume=True" in message, message
    if make_error is not_a_full_disk:
        assert "Permission denied" in message and "Fix the cause, then" in message, message
        assert "Free space" not in message and ENOSPC not in message, message
    else:
        assert f"({ENOSPC})" in message and "Free space, then" in message, message
        assert "Fix the cause" not in message, message
    assert "\n" not in message and "x" * 201 not in message, message  # one line, cut
    assert committed_steps(ckpt_dir) == [4]


def mount_tmpfs(path, size):
    os.makedirs(path)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@pytest.mark.slow
def test_a_full_disk_raises_no_space_and_nothing_is_printed_after_it_is_caught(tmp_path):
    """A 1500 KiB tmpfs holds one checkpoint of a 20-layer MLP (~1 MB), not two: the save of
    step 16 fails while step 8 is kept. Many arrays are written at once, so many writes are
    still in flight when the first one fails."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1500k")
    try:
        child = run_child(tmp_path, """\
            workdir = sys.argv[1]
            try:
                fit(tiny_state(hidden=64, layers=20), tiny_data(), workdir=workdir,
                    **{**RUN, "max_to_keep": 1})
            except OSError as e:
                print("CAUGHT", e, flush=True)
            print("DONE", file=sys.stderr, flush=True)
            """, disk / "work")
        ckpt_dir = disk / "work" / "checkpoints" / "run_1"
        steps = committed_steps(ckpt_dir) if ckpt_dir.is_dir() else None
    finally:
        subprocess.run(["umount", str(disk)], check=False, capture_output=True, timeout=60)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.startswith("CAUGHT fit: saving the checkpoint of step 16"), child.stdout
    assert f"({ENOSPC})" in child.stdout, child.stdout
    assert "The last good checkpoint is step 8, and it is intact. Free space, then" in child.stdout
    assert steps == [8]
    before, done, after = child.stderr.partition("DONE\n")
    assert done, child.stderr[-3000:]
    assert after == "", f"printed after the caught error:\n{after[:3000]}"
    for noise in NOISE:
        assert noise not in before, before[-3000:]
