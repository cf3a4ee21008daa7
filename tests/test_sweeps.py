"""Several fit processes sharing one workdir, as a sweep launches them.

1. Four fresh runs started at once with one log_name get four runs: distinct names, one
   TensorBoard directory each with one events file, all exit cleanly and promptly.
2. Two resumes of one run at once: the second is refused with an error that names the run and
   the holder's pid and says what to do; the first finishes normally.
3. A writer killed with SIGKILL leaves no claim that blocks the run: a resume takes it over.
4. resume=True with no earlier run, two processes at once: both start fresh, distinct runs.

Children (tests/_sweep_child.py) run on one CPU device (`XLA_FLAGS=` empty). Racing children
wait at a file barrier (each writes `ready/<pid>`, then polls every 1 ms for `go`), so their fit
calls start within milliseconds of each other; each records `time.time()` just before fit.
"""
import fcntl
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import _sweep_child as child
from fit import fit

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_sweep_child.py")


def child_env(**extra):
    return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)


def launch(tmp_path, mode, workdir, log_name, resume, tag, **env):
    out, err = tmp_path / f"{tag}.json", tmp_path / f"{tag}.err"
    with open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, CHILD, mode, str(workdir), log_name, resume,
                                 str(out)], stdout=subprocess.PIPE, stderr=e, text=True,
                                env=child_env(**env))
    proc.out, proc.err = out, err
    return proc


def stderr_tail(proc, n=3000):
    return proc.err.read_bytes()[-n:].decode(errors="replace")


def wait_file(path, timeout, procs=()):
    """Waits for `path`; fails early, with the children's stderr, if one of them died."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            assert p.poll() is None, f"child exited {p.returncode} early:\n{stderr_tail(p)}"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.01)


def race(tmp_path, n, log_name, resume, timeout=120):
    """`n` children at a file barrier, released at once; returns their results and the spread
    of their start times (s). Every child must exit 0 within `timeout` s of the release."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    procs = [launch(tmp_path, "race", workdir, log_name, resume, f"c{i}") for i in range(n)]
    try:
        deadline = time.monotonic() + 300  # (imports of n processes on a loaded machine)
        ready = lambda: len(os.listdir(workdir / "ready")) if (workdir / "ready").is_dir() else 0
        while ready() < n:
            for p in procs:
                assert p.poll() is None, f"child exited {p.returncode} early:\n{stderr_tail(p)}"
            assert time.monotonic() < deadline, "children never all got ready"
            time.sleep(0.01)
        (workdir / "go").touch()
        released = time.monotonic()
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(released + timeout - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"child {i} still running {timeout} s after the release (a hang at "
                            f"exit?); its stderr:\n{stderr_tail(p)}")
        took = time.monotonic() - released
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"child {i} exited {p.returncode}:\n{stderr_tail(p)}"
              for i, p in enumerate(procs) if p.returncode]
    assert not failed, "\n".join(failed)
    results = [json.loads(p.out.read_text()) for p in procs]
    starts = [r["start"] for r in results]
    spread = max(starts) - min(starts)
    print(f"{n} racing fit calls started within {spread * 1e3:.1f} ms; all done {took:.1f} s "
          f"after the release")
    return workdir, results, spread


def events_files(log_dir):
    return glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))


def lock_free(path):
    """True if no open file description holds an flock on `path` (this process's included)."""
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def in_process(workdir, log_name, mesh, **options):
    """fit in this process on one device, on the children's model, data and batching."""
    return fit(child.make_state(), child.make_data(), loss_fn=child.loss_fn, mesh=mesh,
               workdir=str(workdir), log_name=log_name, **dict(child.OPTIONS, **options))


# ----------------------------------------------------------------------------------------------
# 1. Four fresh runs at once

@pytest.mark.slow  # four children on two cores: 25-55 s, most of it their imports
def test_four_fresh_runs_at_once_get_four_runs(tmp_path):
    # Measured on the 2-core test machine: the four fit calls started 4-11 ms apart (the printed
    # spread); fit.py at 3afe40f, which listed the runs and took the next n, gave two of them one
    # name in 2 of 3 such races (an orbax save error, then a child hung at exit past 120 s).
    workdir, results, spread = race(tmp_path, 4, "sweep", "fresh", timeout=120)
    names = sorted(r["run"] for r in results)
    assert names == ["sweep_1", "sweep_2", "sweep_3", "sweep_4"], names
    assert sorted(os.listdir(workdir / "logs")) == names
    assert sorted(os.listdir(workdir / "checkpoints")) == names
    for r in results:
        assert r["log_dir"] == str(workdir / "logs" / r["run"])
        assert len(events_files(r["log_dir"])) == 1, os.listdir(r["log_dir"])
        assert r["step"] == 4  # one epoch of 4 steps, its own, from step 0
        assert [d for d in os.listdir(r["ckpt_dir"]) if d.isdigit()] == ["4"]
        # each run's lock names the process that wrote it, and is free now that it exited
        lock = os.path.join(r["ckpt_dir"], "fit.lock")
        assert open(lock).read().endswith(f"pid {r['pid']}")
        assert lock_free(lock)
    assert spread < 1.0, f"the children did not start together ({spread:.3f} s apart)"


# ----------------------------------------------------------------------------------------------
# 2. Two resumes of one run at once

@pytest.mark.slow  # a child and three in-process runs: ~25 s on a loaded machine
def test_second_resume_of_a_held_run_is_refused(tmp_path, one_device_mesh):
    workdir = tmp_path / "work"
    _, history = in_process(workdir, "pair", one_device_mesh, num_epochs=1)
    assert history.run == "pair_1"
    lock = os.path.join(history.ckpt_dir, "fit.lock")
    assert lock_free(lock), "fit returned but still holds its run's lock"

    holder = launch(tmp_path, "hold", workdir, "pair", "latest", "a", CHILD_EPOCHS="2")
    try:
        wait_file(workdir / "held", 120, [holder])  # A resumed pair_1 and is inside training
        assert open(lock).read() == f"host {os.uname().nodename}, pid {holder.pid}"
        with pytest.raises(RuntimeError) as refused:
            in_process(workdir, "pair", one_device_mesh, num_epochs=2, resume=True)
        message = str(refused.value)
        assert message.startswith(f"fit: run pair_1 is being written by host "
                                  f"{os.uname().nodename}, pid {holder.pid}"), message
        assert "log_name" in message and 'resume="<run name>"' in message, message
        assert sorted(os.listdir(workdir / "checkpoints")) == ["pair_1"]  # no run made
        assert not lock_free(lock)  # the refused call left the holder's lock alone
        (workdir / "release").touch()
        assert holder.wait(timeout=120) == 0, stderr_tail(holder)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    result = json.loads(holder.out.read_text())
    assert result["run"] == "pair_1" and result["step"] == 8  # went on from step 4 to 8
    assert max(int(d) for d in os.listdir(history.ckpt_dir) if d.isdigit()) == 8
    # Free again: a resume now finds the run finished, and releases it on that path too.
    _, again = in_process(workdir, "pair", one_device_mesh, num_epochs=2, resume=True)
    assert again.run == "pair_1" and again["step"][-1] == 8
    assert open(lock).read().endswith(f"pid {os.getpid()}") and lock_free(lock)


# ----------------------------------------------------------------------------------------------
# 3. A SIGKILLed writer's claim does not block a resume

def test_resume_after_sigkill_takes_the_run_over(tmp_path, one_device_mesh):
    workdir = tmp_path / "work"
    killed = launch(tmp_path, "kill", workdir, "killed", "fresh", "k", CHILD_EPOCHS="3")
    try:
        line = ""
        while not line.startswith("CKPT"):
            line = killed.stdout.readline()
            assert line, f"child ended before a checkpoint:\n{stderr_tail(killed)}"
        ckpt_dir = line.split(maxsplit=1)[1].strip()
        lock = os.path.join(ckpt_dir, "fit.lock")
        # The killed writer's claim is there and held: its lock names it.
        assert open(lock).read().endswith(f"pid {killed.pid}") and not lock_free(lock)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=60) == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    saved = max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    starts = []
    state, history = in_process(
        workdir, "killed", one_device_mesh, num_epochs=3, ckpt_every=2, resume=True,
        hooks=[lambda event, run: starts.append(run.step) if event == "train_start" else None])
    assert history.run == "killed_1" and history.ckpt_dir == ckpt_dir
    assert starts == [saved] and saved >= 2  # went on from the killed run's checkpoint
    assert int(state.step) == 3 * 4
    assert sorted(os.listdir(workdir / "checkpoints")) == ["killed_1"]
    assert open(lock).read().endswith(f"pid {os.getpid()}") and lock_free(lock)


# ----------------------------------------------------------------------------------------------
# 4. resume=True with no earlier run, two processes at once

@pytest.mark.slow  # two children: ~25 s on a loaded machine
def test_two_resumes_with_no_earlier_run_start_two_fresh_runs(tmp_path):
    workdir, results, spread = race(tmp_path, 2, "fresh", "latest", timeout=120)
    names = sorted(r["run"] for r in results)
    assert names == ["fresh_1", "fresh_2"], names
    for r in results:
        assert r["step"] == 4
        assert len(events_files(r["log_dir"])) == 1, os.listdir(r["log_dir"])
    assert spread < 1.0, f"the children did not start together ({spread:.3f} s apart)"
