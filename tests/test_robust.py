"""Robustness: what happens to a run when the world is unkind.

1. SIGKILL at random points (steps, evals, saves), resumed each time: the result is bitwise the
   uninterrupted run's, and TensorBoard shows it once.
2. SIGTERM (a scheduler's preemption): exit status 143, a checkpoint where it stopped, resumable.
3. SIGINT (Ctrl-C, a notebook's stop button): a clean stop with a checkpoint; a second one
   interrupts at once; the caller's handler comes back.
4. NaN/Inf: stops naming the step and never checkpoints a non-finite state; or skips such steps.
5. Checkpoints are atomic: a half-written one is ignored and cleaned; a failed save is reported.
6. Bad input fails before any directory is made, with a message naming what was given.
7. A long run stays flat: memory and the number of compilations do not grow with epochs.

Subprocess children (tests/_child.py) run on one CPU device (`XLA_FLAGS=` empty): they start
faster than with the eight simulated devices this process has (see conftest.py).
"""
import glob
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import eval_step as digits_eval_step
from flax.training import train_state
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboardX import SummaryWriter

from fit import TrainState, fit, load_ckpt, lr_schedule

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_child.py")
TMP_MARK = "orbax-checkpoint-tmp"


# ----------------------------------------------------------------------------------------------
# Helpers: a small model, batches with actions at chosen points, checkpoint and event readers

class SmallMLP(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(4)(nn.relu(nn.Dense(self.hidden)(x)))


def small_state(hidden=16, lr=1e-2):
    model = SmallMLP(hidden)
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.float32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr))


def small_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def small_eval(state, batch):
    x, y = batch
    return (state.apply_fn({"params": state.params}, x, train=False).argmax(-1) == y).mean()


def make_batches(n=10, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 8)).astype(np.float32), rng.integers(0, 4, size).astype(np.int32))
            for _ in range(n)]


class Batches:
    """A re-iterable loader: the same batches each epoch, and `actions[(epoch, index)](batch)`
    run as that batch is handed out (it may return a replacement batch). fit calls `set_epoch`
    before each epoch, like a torch DistributedSampler."""

    def __init__(self, batches, actions=None):
        self.batches, self.actions, self.epoch = batches, actions or {}, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            action = self.actions.get((self.epoch, i))
            if action is not None:
                batch = action(batch) or batch
            yield batch


def with_nan(batch):
    x, y = batch
    x = x.copy()
    x[0, 0] = np.nan
    return x, y


def sigint(times=1):
    def action(batch):
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
    return action


def committed_steps(ckpt_dir):
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


def tmp_dirs(ckpt_dir):
    return sorted(d for d in os.listdir(ckpt_dir) if TMP_MARK in d)


def leaves(state):
    """Params, optimizer state, step and rng as one float64 vector: exact for float32/int32."""
    tree = jax.device_get((state.params, state.opt_state, state.step, state.rng))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def all_finite(state):
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(jax.device_get(state.params)))


def accumulator(log_dir):
    """TensorBoard's own reader: it honours the SessionLog.START that purge_step writes."""
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_scalars(log_dir, tag):
    """(step, value) of each point TensorBoard shows for `tag`; [] if it shows none."""
    acc = accumulator(log_dir)
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def raw_steps(log_dir, tag):
    """Every point written for `tag`, in all event files, stale ones included."""
    steps = []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


def hparams_session(log_dir):
    """The hparams plugin's content in a run: {tag: HParamsPluginData}."""
    try:
        content = accumulator(log_dir).PluginTagToContent("hparams")
    except KeyError:  # no hparams summary at all
        return {}
    return {tag: plugin_data_pb2.HParamsPluginData.FromString(data) for tag, data in content.items()}


def child_env(cache_dir=None, **extra):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    if cache_dir:  # compiled steps load from disk on a relaunch (exact: the same executable)
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


class Child:
    """tests/_child.py in a subprocess, its stdout read line by line on a thread."""

    def __init__(self, mode, workdir, env, err_path):
        os.makedirs(workdir, exist_ok=True)
        self.out = os.path.join(workdir, "out.json")
        self.err_path = err_path
        with open(err_path, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, CHILD, mode, str(workdir), self.out],
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.lines, self.seen = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, predicate, timeout=300):
        """The first line that satisfies `predicate`, or None if the child closed its stdout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.proc.kill()
                raise TimeoutError(f"child gave no matching line in {timeout} s; seen {self.seen[-5:]}; "
                                   f"stderr tail: {self.stderr_tail()}") from None
            if line is None:
                return None
            self.seen.append(line)
            if predicate(line):
                return line

    def finish(self, timeout=300):
        self.wait_for(lambda line: False, timeout)
        return self.proc.wait(timeout)

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)

    def stderr_tail(self, n=3000):
        with open(self.err_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def result(self):
        with open(self.out) as f:
            return json.load(f)


def killed_once_and_resumed(mode, tmp_path, at_step=27):
    """An uninterrupted run of `mode`, then the same run SIGKILLed once past `at_step` (mid-epoch
    2 of _child.py's kill runs) and resumed to the end: `(reference, resumed)` Children."""
    env = child_env()
    ref = Child(mode, tmp_path / "ref", env, tmp_path / "ref.err")
    assert ref.finish() == 0, ref.stderr_tail()
    child = Child(mode, tmp_path / "run", env, tmp_path / "run.err")
    assert child.wait_for(progress_at_least(at_step)) is not None, child.stderr_tail()
    child.kill(signal.SIGKILL)
    assert child.proc.wait() == -signal.SIGKILL
    final = Child(mode, tmp_path / "run", env, tmp_path / "final.err")
    assert final.finish() == 0, final.stderr_tail()
    assert np.array_equal(np.load(tmp_path / "run" / "final.npy"),
                          np.load(tmp_path / "ref" / "final.npy"))
    return ref, final


def progress_at_least(step):
    """A child's progress line (LOG/EVAL/EPOCH <step>) at or past `step`."""
    def predicate(line):
        parts = line.split()
        return len(parts) == 2 and parts[0] in ("LOG", "EVAL", "EPOCH") and int(parts[1]) >= step
    return predicate


def epoch_end_at_least(step):
    def predicate(line):
        parts = line.split()
        return len(parts) == 2 and parts[0] in ("EPOCH", "EVAL") and int(parts[1]) >= step
    return predicate


def latest_run_ckpts(workdir, log_name):
    """(run, committed steps, tmp dirs) of the newest run directory of `log_name`."""
    root = os.path.join(workdir, "checkpoints")
    runs = sorted((d for d in os.listdir(root) if d.startswith(log_name + "_")),
                  key=lambda d: int(d.rsplit("_", 1)[1])) if os.path.isdir(root) else []
    if not runs:
        return None, [], []
    path = os.path.join(root, runs[-1])
    return runs[-1], committed_steps(path), tmp_dirs(path)


# ----------------------------------------------------------------------------------------------
# 1. SIGKILL at random points, resumed with the same command each time

KILL_TOTAL = 80  # _child.py kill mode: 20 steps x 4 epochs, ckpt_every=3, log_every=2


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """An uninterrupted reference run, then the same run killed (SIGKILL) at 12 seeded points
    and relaunched each time with the same command (`resume=True` from the first launch), then
    let finish. Kills are aimed by the child's progress lines, not by wall-clock time, so they
    land at spread-out points however loaded the machine is: one during startup (restore,
    compile), one just after the first checkpoint, eight at random steps, two right at an
    epoch's end (in the eval or the epoch-end save), each plus a random delay of up to 0.25 s."""
    root = tmp_path_factory.mktemp("kill")
    cache = root / "jax_cache"
    env = child_env(cache)
    t0 = time.monotonic()
    # The reference also fills the compilation cache, so relaunches skip compiling (an
    # interrupted relaunch never writes the cache half-way).
    ref = Child("kill", root / "ref", env, root / "ref.err")
    assert ref.finish() == 0, ref.stderr_tail()
    ref_seconds = time.monotonic() - t0

    rng = random.Random(1234)
    plan = ([("setup", 0)] + [("step", rng.randint(9, 11))] +
            [("step", t) for t in sorted(rng.sample(range(14, 74), 8))] + [("epoch", 40), ("epoch", 60)])
    plan.sort(key=lambda p: (p[1], p[0] == "epoch"))
    workdir = root / "run"
    kills, launches = [], 0
    for kind, target in plan:
        before = latest_run_ckpts(workdir, "kill")
        child = Child("kill", workdir, env, root / f"launch{launches}.err")
        launches += 1
        assert child.wait_for(lambda line: line == "READY") is not None, child.stderr_tail()
        if kind == "setup":
            time.sleep(rng.uniform(0.2, 1.5))
            line = "READY"
        else:
            line = child.wait_for(progress_at_least(target) if kind == "step" else epoch_end_at_least(target))
            if line is None:  # finished before the kill point: no kill
                assert child.proc.wait() == 0, child.stderr_tail()
                break
            time.sleep(0 if kind == "epoch" else rng.uniform(0, 0.25))
        child.kill()
        rc = child.proc.wait()
        last = child.seen[-1] if child.seen else None
        run, steps, tmps = latest_run_ckpts(workdir, "kill")
        kills.append({"kind": kind, "target": target, "rc": rc, "last_line": last, "run": run,
                      "resumed_from": before[1][-1] if before[1] else 0,
                      "latest_after": steps[-1] if steps else 0, "in_save": bool(tmps)})
    final = Child("kill", workdir, env, root / "final.err")
    assert final.finish() == 0, final.stderr_tail()
    print("\nkill points (kind, target, last line, resumed from -> latest checkpoint after, "
          "a save in flight):")
    for k in kills:
        print(f"  {k['kind']:5} {k['target']:3}  {str(k['last_line']):10} {k['resumed_from']:3} -> "
              f"{k['latest_after']:3}  {'in save' if k['in_save'] else ''}")
    print(f"reference run {ref_seconds:.1f} s, {launches + 1} launches in {time.monotonic() - t0:.1f} s")
    return {"ref": ref.result(), "ref_leaves": np.load(root / "ref" / "final.npy"),
            "final": final.result(), "final_leaves": np.load(workdir / "final.npy"),
            "kills": kills, "workdir": workdir, "final_lines": final.seen}


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bitwise_exact(killed_run):
    kills = killed_run["kills"]
    # At least 10 kills, all by SIGKILL, spread over the run: different checkpoints to resume
    # from, at least one while an asynchronous save was being written.
    assert len(kills) >= 10, kills
    assert all(k["rc"] == -signal.SIGKILL for k in kills), kills
    assert len({k["latest_after"] for k in kills}) >= 6, kills
    assert any(k["in_save"] for k in kills), kills
    assert any(k["kind"] == "epoch" for k in kills), kills
    # Progress is never lost beyond the last checkpoint: each launch resumed from the latest.
    latest = [k["latest_after"] for k in kills]
    assert latest == sorted(latest), kills
    # The result is bitwise the uninterrupted run's: params, Adam moments, step and rng.
    final, ref = killed_run["final"], killed_run["ref"]
    assert final["step"] == ref["step"] == KILL_TOTAL
    assert killed_run["final_leaves"].shape == killed_run["ref_leaves"].shape
    assert np.array_equal(killed_run["final_leaves"], killed_run["ref_leaves"])
    # So is the history (per-epoch train means from the sums kept in checkpoints, and evals).
    for key in ("epoch", "step", "train/loss", "eval/accuracy", "eval/step"):
        assert final["history"][key] == ref["history"][key], key
    assert final["history"]["epoch"] == [1, 2, 3, 4]
    # Nothing half-written is left behind.
    assert tmp_dirs(final["ckpt_dir"]) == []
    assert committed_steps(final["ckpt_dir"])[-1] == KILL_TOTAL


@pytest.mark.slow
def test_sigkill_tensorboard_has_no_duplicate_steps(killed_run):
    log_dir, ref_dir = killed_run["final"]["log_dir"], killed_run["ref"]["log_dir"]
    ref = dict(tb_scalars(ref_dir, "train/loss"))
    assert sorted(ref) == list(range(2, KILL_TOTAL + 1, 2))
    for tag in ("train/loss", "eval/accuracy"):
        shown = tb_scalars(log_dir, tag)
        steps = [s for s, _ in shown]
        # Each step at most once, in order, each value the uninterrupted run's.
        assert len(steps) == len(set(steps)) and steps == sorted(steps), (tag, steps)
        ref_tag = dict(tb_scalars(ref_dir, tag))
        assert all(s in ref_tag and ref_tag[s] == v for s, v in shown), (tag, shown)
    # (Raw event files may hold a step twice: a killed launch's points past its last checkpoint,
    # logged again after the resume; the resumed writer's purge_step hides the stale copies.)




@pytest.mark.slow
def test_sigkill_tensorboard_keeps_every_step_and_the_hparams_session(killed_run):
    log_dir, ref_dir = killed_run["final"]["log_dir"], killed_run["ref"]["log_dir"]
    problems = []
    for tag in ("train/loss", "eval/accuracy"):
        shown = [s for s, _ in tb_scalars(log_dir, tag)]
        missing = sorted(set(s for s, _ in tb_scalars(ref_dir, tag)) - set(shown))
        if missing:
            problems.append(f"{tag}: steps {missing} missing")
    session = hparams_session(log_dir)
    # (No experiment summary: each run writes its session only, so runs compare side by side.)
    if "_hparams_/session_start_info" not in session:
        problems.append(f"hparams summaries missing (has {sorted(session)})")
    else:
        hp = session["_hparams_/session_start_info"].session_start_info.hparams
        if hp["hidden"].number_value != 512:
            problems.append(f"hparams {dict(hp)}")
    assert not problems, problems


def test_event_accumulator_honours_purge_step(tmp_path):
    """The checker above is sound: TensorBoard's EventAccumulator drops points at and after a
    later writer's purge_step (a SessionLog.START in a file_version 2 file), while the raw files
    keep both copies."""
    first = SummaryWriter(str(tmp_path))
    for step in range(1, 7):
        first.add_scalar("a", step, step)
    first.close()
    time.sleep(1.1)  # event file names have one-second resolution
    second = SummaryWriter(str(tmp_path), purge_step=4)
    for step in range(4, 9):
        second.add_scalar("a", 10 * step, step)
    second.close()
    assert sorted(raw_steps(str(tmp_path), "a")) == [1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 8]
    assert tb_scalars(str(tmp_path), "a") == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (6, 60),
                                              (7, 70), (8, 80)]


# ----------------------------------------------------------------------------------------------
# 2. SIGTERM: exit 143 with a checkpoint, then resume

def test_sigterm_exits_143_with_a_checkpoint_and_resumes(tmp_path):
    workdir = tmp_path / "run"
    # The child's loader holds batch 6 of epoch 2 (index 1) after saying so, until the parent
    # creates workdir/release; SIGTERM arrives while fit waits for that batch.
    child = Child("sigterm", workdir, child_env(CHILD_HOLD="1,6"), tmp_path / "first.err")
    assert child.wait_for(lambda line: line == "FETCH 1 6") is not None, child.stderr_tail()
    child.kill(signal.SIGTERM)
    (workdir / "release").touch()
    assert child.finish() == 143, child.stderr_tail()
    assert not os.path.exists(child.out)  # fit raised SystemExit(143); it did not return
    ckpt_dir = os.path.join(workdir, "checkpoints", "term_1")
    steps = committed_steps(ckpt_dir)
    stop = steps[-1]
    # 10 steps per epoch, 3 epochs: the stop is inside epoch 2, before batch 6 was trained, and
    # it is not an epoch-end checkpoint (there is no ckpt_every): the SIGTERM save wrote it.
    assert 10 < stop <= 16, steps
    assert steps == [10, stop] or steps == [stop], steps
    assert tmp_dirs(ckpt_dir) == []  # the save finished before the process exited
    import _child
    restored = load_ckpt(_child.make_state(hidden=64), ckpt_dir)
    assert int(restored.step) == stop and all_finite(restored)

    resumed = Child("sigterm", workdir, child_env(), tmp_path / "second.err")
    assert resumed.finish() == 0, resumed.stderr_tail()
    result = resumed.result()
    assert result["step"] == 30
    assert result["ckpt_dir"] == ckpt_dir  # the same run, continued
    history = result["history"]
    assert history["epoch"] == [1, 2, 3] and history["step"] == [10, 20, 30]
    assert history["stopped"] == [f"SIGTERM at step {stop}"]
    # The resumed launch trained from the stop on: its loader handed out epoch 2 from batch
    # stop - 10 (the untrained ones) and all of epoch 3.
    fetched = [tuple(map(int, line.split()[1:])) for line in resumed.seen if line.startswith("FETCH")]
    assert (1, stop - 10) in fetched and (2, 9) in fetched


def test_events_up_to_the_last_checkpoint_survive_a_sigkill(tmp_path):
    """The quick, deterministic form of the TensorBoard loss above: SIGKILL a fresh run once its
    first checkpoint (step 3) is committed; TensorBoard must show the run up to that checkpoint
    (a resume logs only what comes after it) and its hparams session."""
    workdir = tmp_path / "run"
    ckpt_dir = os.path.join(workdir, "checkpoints", "term_1")
    child = Child("sigterm", workdir, child_env(CHILD_HOLD="0,6", CHILD_CKPT_EVERY="3"),
                  tmp_path / "child.err")
    assert child.wait_for(lambda line: line == "FETCH 0 6") is not None, child.stderr_tail()
    # The child now waits for batch 6 (it is never released) after training 4 steps; its save
    # of step 3 commits in the background.
    deadline = time.monotonic() + 120
    while committed_steps(ckpt_dir) != [3] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert committed_steps(ckpt_dir) == [3]
    child.kill()
    assert child.proc.wait() == -signal.SIGKILL
    log_dir = os.path.join(workdir, "logs", "term_1")
    shown = [s for s, _ in tb_scalars(log_dir, "train/loss")]
    session = hparams_session(log_dir)
    assert shown[:3] == [1, 2, 3] and "_hparams_/session_start_info" in session, (shown, sorted(session))


# ----------------------------------------------------------------------------------------------
# 3. SIGINT in-process: a clean stop, the caller's handler restored, a second one interrupts

def sigint_handler_for_test(signum, frame):  # pragma: no cover - only compared by identity
    raise AssertionError("the test's own SIGINT handler should not run")


def test_sigint_stops_cleanly_restores_the_handler_and_resumes(tmp_path, one_device_mesh):
    batches = make_batches()
    kwargs = dict(loss_fn=small_loss, num_epochs=3, log_every=1, mesh=one_device_mesh)
    previous = signal.signal(signal.SIGINT, sigint_handler_for_test)
    previous_term = signal.getsignal(signal.SIGTERM)
    try:
        state, history = fit(small_state(), Batches(batches, {(1, 5): sigint()}),
                             workdir=str(tmp_path / "run"), **kwargs)
        assert signal.getsignal(signal.SIGINT) is sigint_handler_for_test
        assert signal.getsignal(signal.SIGTERM) == previous_term
    finally:
        signal.signal(signal.SIGINT, previous)
    stop = int(state.step)
    assert 10 < stop <= 15, stop  # inside epoch 2, before batch 5 was trained
    assert history["stopped"] == [f"SIGINT at step {stop}"]
    assert history["epoch"] == [1] and history["step"] == [10]
    assert committed_steps(history.ckpt_dir)[-1] == stop
    assert np.array_equal(leaves(load_ckpt(small_state(), history.ckpt_dir)), leaves(state))

    state2, history2 = fit(small_state(), Batches(batches), workdir=str(tmp_path / "run"),
                           resume=True, **kwargs)
    assert history2.run == history.run
    assert int(state2.step) == 30 and history2["epoch"] == [1, 2, 3]
    assert history2["step"] == [10, 20, 30]
    full, full_history = fit(small_state(), Batches(batches), workdir=str(tmp_path / "full"), **kwargs)
    assert np.array_equal(leaves(state2), leaves(full))
    assert history2["train/loss"] == full_history["train/loss"]


def test_a_second_sigint_interrupts_at_once(tmp_path, one_device_mesh):
    previous = signal.signal(signal.SIGINT, sigint_handler_for_test)
    try:
        with pytest.raises(KeyboardInterrupt):
            fit(small_state(), Batches(make_batches(), {(1, 5): sigint(times=2)}), loss_fn=small_loss,
                num_epochs=3, ckpt_every=10, mesh=one_device_mesh, workdir=str(tmp_path))
        assert signal.getsignal(signal.SIGINT) is sigint_handler_for_test
    finally:
        signal.signal(signal.SIGINT, previous)
    # The run is left consistent: saves finished (no temporary directories), the epoch-end
    # checkpoint readable.
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert tmp_dirs(ckpt_dir) == []
    assert committed_steps(ckpt_dir) == [10]
    assert int(load_ckpt(small_state(), ckpt_dir).step) == 10


# ----------------------------------------------------------------------------------------------
# 4. NaN/Inf in the loss

def test_nan_raises_naming_the_step_and_keeps_the_last_finite_checkpoint(tmp_path, one_device_mesh):
    # Batch 4 of epoch 2 is global batch 14: its update is step 15 (steps count updates, like
    # checkpoint numbers: checkpoint n holds the state after n updates).
    with pytest.raises(FloatingPointError, match=r"\(NaN or Inf\) in loss\b.* at step 15\b"):
        fit(small_state(), Batches(make_batches(), {(1, 4): with_nan}), loss_fn=small_loss,
            num_epochs=3, ckpt_every=4, log_every=1, mesh=one_device_mesh, workdir=str(tmp_path))
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    steps = committed_steps(ckpt_dir)
    assert steps[-1] == 12, steps  # 4, 8, 10 (epoch end), 12; never 16
    assert tmp_dirs(ckpt_dir) == []
    restored = load_ckpt(small_state(), ckpt_dir)
    assert int(restored.step) == 12 and all_finite(restored)


def test_nan_in_the_last_batch_of_an_epoch_writes_no_epoch_end_checkpoint(tmp_path, one_device_mesh):
    with pytest.raises(FloatingPointError, match=r"in loss\b.* at step 20\b"):
        fit(small_state(), Batches(make_batches(), {(1, 9): with_nan}), small_eval_batches(),
            loss_fn=small_loss, eval_step=small_eval, num_epochs=3, mesh=one_device_mesh,
            workdir=str(tmp_path))
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert committed_steps(ckpt_dir) == [10]
    assert tmp_dirs(ckpt_dir) == []
    assert all_finite(load_ckpt(small_state(), ckpt_dir))
    # Nor was the non-finite state evaluated and logged as if it were an epoch's result.
    assert [s for s, _ in tb_scalars(os.path.join(tmp_path, "logs", "run_1"), "eval/accuracy")] == [10]


def poison_at(step):
    """A train_step whose loss stays finite while the update of `step` makes every parameter
    NaN: only the check of the parameters can catch it (#16: at log points and before saves)."""
    def train_step(state, batch):
        new = state.apply_gradients(grads=jax.tree.map(jnp.zeros_like, state.params))
        poison = jnp.where(new.step == step, jnp.nan, 1.0)
        return new.replace(params=jax.tree.map(lambda p: p * poison, new.params)), {"loss": 1.0}
    return train_step


@pytest.mark.parametrize("log_every, ckpt_every, found_at", [(4, 6, 6), (4, 100, 8)])
def test_non_finite_parameters_are_never_checkpointed(tmp_path, one_device_mesh, log_every,
                                                      ckpt_every, found_at):
    # Found before the save of step 6, or at the log point of step 8 (where the norms are taken)
    with pytest.raises(FloatingPointError, match=rf"non-finite parameters.* at step {found_at}\b"):
        fit(small_state(), make_batches(), train_step=poison_at(6), num_epochs=1,
            log_every=log_every, ckpt_every=ckpt_every, mesh=one_device_mesh,
            workdir=str(tmp_path))
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    steps = committed_steps(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    assert all(s < 6 for s in steps), steps
    for s in steps:
        assert all_finite(load_ckpt(small_state(), ckpt_dir, s))


def small_eval_batches():
    return make_batches(n=2, size=16, seed=1)


NAN_BATCHES = {(0, 3): with_nan, (1, 4): with_nan, (1, 9): with_nan}


def test_on_nonfinite_skip_drops_the_updates_and_counts_them(tmp_path, one_device_mesh):
    state, history = fit(small_state(), Batches(make_batches(), NAN_BATCHES), loss_fn=small_loss,
                         num_epochs=3, log_every=1, on_nonfinite="skip", mesh=one_device_mesh,
                         workdir=str(tmp_path))
    assert all_finite(state)
    assert history["train/skipped_steps"] == [1, 3, 3]  # running count at each epoch's end
    assert all(np.isfinite(history["train/loss"]))
    assert history["epoch"] == [1, 2, 3] and history["step"] == [10, 20, 30]
    restored = load_ckpt(small_state(), history.ckpt_dir)
    assert all_finite(restored)
    # TensorBoard's count agrees.
    skipped = tb_scalars(history.log_dir, "train/skipped_steps")
    assert skipped[-1] == (30, 3.0)


def test_on_nonfinite_skip_logs_no_fake_zero_loss(tmp_path, one_device_mesh):
    _, history = fit(small_state(), Batches(make_batches(), NAN_BATCHES), loss_fn=small_loss,
                     num_epochs=3, log_every=1, on_nonfinite="skip", mesh=one_device_mesh,
                     workdir=str(tmp_path))
    shown = dict(tb_scalars(history.log_dir, "train/loss"))
    # The skipped updates are steps 4, 15 and 20: no point there (or a NaN); every other step
    # has its real, positive cross-entropy.
    skipped = {4, 15, 20}
    assert set(range(1, 31)) - skipped <= set(shown), sorted(shown)
    assert all(shown[s] > 0 for s in set(range(1, 31)) - skipped), shown
    assert all(np.isnan(shown[s]) for s in skipped if s in shown), shown
    # A dropped update's norms are not those of the parameters kept: none is logged there.
    norms = dict(tb_scalars(history.log_dir, "train/param_norm"))
    assert not skipped & set(norms) and set(norms) == set(range(1, 31)) - skipped, sorted(norms)
    assert all(np.isfinite(v) for v in norms.values()), norms


def test_on_nonfinite_skip_then_resume_counts_steps_like_an_uninterrupted_run(tmp_path, one_device_mesh):
    kwargs = dict(loss_fn=small_loss, num_epochs=3, log_every=1, on_nonfinite="skip", mesh=one_device_mesh)
    full, full_history = fit(small_state(), Batches(make_batches(), NAN_BATCHES),
                             workdir=str(tmp_path / "full"), **kwargs)
    previous = signal.signal(signal.SIGINT, sigint_handler_for_test)
    try:
        actions = {**NAN_BATCHES, (1, 7): sigint()}
        fit(small_state(), Batches(make_batches(), actions), workdir=str(tmp_path / "run"), **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)
    resumed, history = fit(small_state(), Batches(make_batches(), NAN_BATCHES),
                           workdir=str(tmp_path / "run"), resume=True, **kwargs)
    assert np.array_equal(leaves(resumed), leaves(full))  # the same batches were trained
    assert history["step"] == full_history["step"] == [10, 20, 30]
    assert committed_steps(history.ckpt_dir)[-1] == 30


# ----------------------------------------------------------------------------------------------
# 5. Checkpoints are atomic

def test_a_half_written_checkpoint_is_ignored_and_cleaned_on_resume(tmp_path, one_device_mesh):
    kwargs = dict(loss_fn=small_loss, mesh=one_device_mesh, workdir=str(tmp_path))
    _, history = fit(small_state(), Batches(make_batches()), num_epochs=1, **kwargs)
    fake = os.path.join(history.ckpt_dir, f"999.{TMP_MARK}-1700000000")
    os.makedirs(os.path.join(fake, "state"))
    with open(os.path.join(fake, "state", "junk"), "wb") as f:
        f.write(os.urandom(100))
    with open(os.path.join(fake, "_CHECKPOINT_METADATA"), "w") as f:
        f.write("{not json")
    assert int(load_ckpt(small_state(), history.ckpt_dir).step) == 10  # ignored by readers too
    state, history2 = fit(small_state(), Batches(make_batches()), num_epochs=2, resume=True, **kwargs)
    assert history2.run == history.run
    assert history2["step"] == [10, 20] and int(state.step) == 20  # resumed from 10, not 999
    assert not os.path.exists(fake)
    assert committed_steps(history.ckpt_dir)[-1] == 20


class InjectedSaveError(OSError):
    pass


def test_a_failed_background_save_raises_and_the_previous_checkpoint_stays(tmp_path, one_device_mesh,
                                                                          monkeypatch):
    """The meta item's file is written in orbax's background commit; make it fail from the
    checkpoint of step 8 on (as a full disk would)."""
    original = ocp.JsonCheckpointHandler._save_fn

    async def failing_save_fn(self, x, directory):
        step = int(os.path.basename(os.path.dirname(str(directory))).split(".")[0])
        if step >= 8:
            raise InjectedSaveError(f"injected: no space left writing step {step}")
        return await original(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", failing_save_fn)
    # One clear error that names the step, the directory, the cause, the last good checkpoint
    # and what to do; the original error stays chained to it.
    failed = r"saving the checkpoint of step 8 to .*run_1 failed: injected.*last good checkpoint is step 4.*resume=True"
    with pytest.raises(OSError, match=failed) as raised:
        fit(small_state(), Batches(make_batches()), loss_fn=small_loss, num_epochs=3, ckpt_every=4,
            mesh=one_device_mesh, workdir=str(tmp_path))
    assert isinstance(raised.value.__cause__, InjectedSaveError)
    monkeypatch.undo()
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert committed_steps(ckpt_dir) == [4]
    restored = load_ckpt(small_state(), ckpt_dir)
    assert int(restored.step) == 4 and all_finite(restored)


def test_a_failed_save_call_raises_and_the_previous_checkpoint_stays(tmp_path, one_device_mesh,
                                                                    monkeypatch):
    original, calls = ocp.CheckpointManager.save, []

    def failing_save(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 2:
            raise InjectedSaveError(f"injected: cannot save step {step}")
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    # One clear error that names the step, the directory, the cause, the last good checkpoint
    # and what to do; the original error stays chained to it.
    failed = r"saving the checkpoint of step 8 to .*run_1 failed: injected.*last good checkpoint is step 4.*resume=True"
    with pytest.raises(OSError, match=failed) as raised:
        fit(small_state(), Batches(make_batches()), loss_fn=small_loss, num_epochs=3, ckpt_every=4,
            mesh=one_device_mesh, workdir=str(tmp_path))
    assert isinstance(raised.value.__cause__, InjectedSaveError)
    monkeypatch.undo()
    assert calls == [4, 8]
    ckpt_dir = os.path.join(tmp_path, "checkpoints", "run_1")
    assert committed_steps(ckpt_dir) == [4] and tmp_dirs(ckpt_dir) == []
    assert int(load_ckpt(small_state(), ckpt_dir).step) == 4


# ----------------------------------------------------------------------------------------------
# 6. Bad input: a clear error before any directory is made

class DigitsMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


def digits_state():
    model = DigitsMLP()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def digits_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def image_batch(n=16, shape=(8, 8, 1), dtype=np.float32):
    return np.zeros((n, *shape), dtype), np.zeros(n, np.int32)


def no_tx_state():
    model = DigitsMLP()
    params = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)["params"]
    return train_state.TrainState(step=0, apply_fn=model.apply, params=params, tx=None, opt_state=None)


x16, y16 = image_batch()
GOOD = [image_batch() for _ in range(3)]
BAD_INPUTS = {
    # case: (fit keyword overrides (state: a function making it), substrings the message must
    # contain: the argument's name and what was given)
    "empty train data": (dict(train_ds=[]), ["train_ds", "no batches"]),
    "train_ds not iterable": (dict(train_ds=5), ["train_ds", "int"]),
    "batches are 3-tuples": (dict(train_ds=[(x16, y16, y16)] * 3), ["train_ds", "(inputs, targets)", "length 3"]),
    "batches are bare arrays": (dict(train_ds=[x16, x16, x16]), ["train_ds", "(inputs, targets)", "ndarray"]),
    # (#24: lengths may differ, as in length buckets; the number of dimensions may not)
    "batch ranks differ": (dict(train_ds=[image_batch(), image_batch(shape=(8, 8))]),
                           ["batch 1", "train_ds", "(16, 8, 8)", "(16, 8, 8, 1)"]),
    "batch dtypes differ": (dict(train_ds=[image_batch(), image_batch(dtype=np.float64)]),
                            ["batch 1", "train_ds", "float64", "float32"]),
    "batch not divisible by 8 devices": (dict(train_ds=[image_batch(12)] * 2),
                                         ["(12)", "(8, on the batch_axes ('data',))", "divisible"]),
    "loss per example": (dict(loss_fn=lambda o, t: optax.softmax_cross_entropy_with_integer_labels(o, t)),
                         ["loss_fn", "scalar", "(16,)"]),
    "loss is an int": (dict(loss_fn=lambda o, t: jnp.sum(t)), ["loss_fn", "float", "int32"]),
    "eval_step per example": (dict(test_ds=GOOD, eval_step=lambda s, b: jnp.zeros(b[1].shape)),
                              ["eval_step", "scalar", "(16,)"]),
    "num_epochs=0": (dict(num_epochs=0), ["num_epochs", "0"]),
    "num_epochs=1.5": (dict(num_epochs=1.5), ["num_epochs", "1.5"]),
    "num_epochs='3'": (dict(num_epochs="3"), ["num_epochs", "'3'"]),
    "eval_freq=0": (dict(eval_freq=0), ["eval_freq", "0"]),
    "log_every=-1": (dict(log_every=-1), ["log_every", "-1"]),
    "ckpt_every=0": (dict(ckpt_every=0), ["ckpt_every", "0"]),
    "unknown monitor": (dict(test_ds=GOOD, eval_step=digits_eval_step, monitor="eval/nope"),
                        ["monitor", "'eval/nope'", "eval/accuracy"]),
    "unknown mode": (dict(mode="maximize"), ["mode", "'maximize'"]),
    "state without tx": (dict(state=no_tx_state), ["state", "tx=None"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_before_any_directory_is_made(case, tmp_path):
    overrides, substrings = BAD_INPUTS[case]
    args = dict(state=digits_state(), train_ds=GOOD, loss_fn=digits_loss, workdir=str(tmp_path),
                num_epochs=1)
    args.update(overrides)
    state, train_ds = args.pop("state"), args.pop("train_ds")
    state = state() if callable(state) else state
    with pytest.raises((TypeError, ValueError)) as info:
        fit(state, train_ds, **args)
    message = str(info.value)
    for s in substrings:
        assert s in message, (s, message)
    assert os.listdir(tmp_path) == []


def test_unwritable_workdir_fails_before_any_directory_is_made(tmp_path):
    (tmp_path / "file.txt").write_text("not a directory")
    workdir = str(tmp_path / "file.txt" / "run")
    with pytest.raises(OSError) as info:
        fit(digits_state(), GOOD, loss_fn=digits_loss, workdir=workdir)
    message = str(info.value)
    assert "workdir" in message and workdir in message and "not a directory" in message, message
    assert os.listdir(tmp_path) == ["file.txt"]


def test_lr_schedule_warmup_as_long_as_the_run_is_refused():
    with pytest.raises(ValueError) as info:
        lr_schedule(1e-3, steps_per_epoch=10, epochs=5, warmup_epochs=5)
    message = str(info.value)
    assert "warmup_epochs=5" in message and "epochs=5" in message, message


def test_resume_into_another_model_names_the_mismatched_params(tmp_path, one_device_mesh):
    kwargs = dict(loss_fn=small_loss, mesh=one_device_mesh, workdir=str(tmp_path), num_epochs=1)
    _, history = fit(small_state(hidden=16), Batches(make_batches()), **kwargs)
    with pytest.raises(ValueError) as info:
        fit(small_state(hidden=32), Batches(make_batches()), resume=True, **dict(kwargs, num_epochs=2))
    message = str(info.value)
    for s in ("Dense_0/kernel", "(8, 16)", "(8, 32)", "Dense_1/kernel", "(16, 4)", "(32, 4)", str(history.ckpt_dir)):
        assert s in message, (s, message)
    # The checkpoint is untouched and still resumes with the right model.
    assert committed_steps(history.ckpt_dir) == [10] and tmp_dirs(history.ckpt_dir) == []
    state, history2 = fit(small_state(hidden=16), Batches(make_batches()), resume=True,
                          **dict(kwargs, num_epochs=2))
    assert history2.run == history.run and int(state.step) == 20


# ----------------------------------------------------------------------------------------------
# 7. A long run stays flat: memory and compilations

# Measured for this run (60 epochs x 10 steps of a 256-wide MLP, an eval and a checkpoint each
# epoch, 1 device, RSS read after gc and malloc_trim): +8 to +13 MB from after epoch 5 to after
# epoch 59 on 2 busy CPU cores, decelerating (+17 MB by epoch 120). tracemalloc puts the Python
# part of it in orbax/tensorstore's per-save bookkeeping (~25 KB per checkpoint path), not in
# fit. The bound leaves >2x margin; the exact checks are the JAX arrays alive (the same count
# and bytes each epoch) and the compilations (none after the first epoch).
RSS_GROWTH_BOUND_MB = 30


@pytest.mark.slow
def test_a_long_run_stays_flat(tmp_path):
    child = Child("flat", tmp_path / "run", child_env(CHILD_EPOCHS="60"), tmp_path / "flat.err")
    assert child.finish(timeout=600) == 0, child.stderr_tail()
    result = child.result()
    records = {}
    for r in result["records"]:  # one per iter() of the loader, and one after fit returned
        records[r["epoch"]] = r
    assert sorted(records) == list(range(61))
    assert result["step"] == 600 and result["history"]["epoch"] == list(range(1, 61))
    assert len(result["history"]["eval/accuracy"]) == 60
    table = [(e, round(r["rss_mb"], 1), r["compiles"], r["live_arrays"]) for e, r in sorted(records.items())]
    # After epoch 5 and after epoch 59, at the same point of the loop (an epoch's first batch):
    start, end = records[5], records[59]
    # No compilation: the train step, eval step and saves reuse theirs.
    assert end["compiles"] == start["compiles"], table
    # No JAX array piles up (a kept metric, batch or state per step or per save would).
    assert (end["live_arrays"], end["live_bytes"]) == (start["live_arrays"], start["live_bytes"]), table
    growth = end["rss_mb"] - start["rss_mb"]
    assert growth < RSS_GROWTH_BOUND_MB, table
    # fit keeps nothing alive once it returned and its state was dropped.
    assert records[60]["live_arrays"] == 0, table
    # Disk stays flat too: the last and the best checkpoint, nothing else.
    assert len(committed_steps(result["ckpt_dir"])) <= 2 and tmp_dirs(result["ckpt_dir"]) == []
    print(f"\nRSS after epoch 5: {start['rss_mb']:.1f} MB, after 59: {end['rss_mb']:.1f} MB "
          f"(growth {growth:+.1f} MB); compiles {start['compiles']} -> {end['compiles']}; "
          f"live arrays {start['live_arrays']} -> {end['live_arrays']}")
