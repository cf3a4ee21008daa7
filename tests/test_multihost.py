"""Multi-host: fit on JAX's own distributed runtime, 2 processes x 2 CPU devices.

Each run is a group of child processes (tests/_multihost_child.py) joined by
`jax.distributed.initialize` over 127.0.0.1 with gloo collectives, each process with 2 simulated
CPU devices and its own half of every global batch, all in one shared workdir (a cluster's shared
filesystem). The reference is one process with 4 devices on the same global batches.

1. Two processes end with the parameters of one process on the same global data; eval metrics are
   exact and equal on every process.
2. Only process 0 opens a TensorBoard writer and shows the progress bar; all agree on the run.
3. The checkpoint the processes wrote together restores in one process (`load_ckpt`).
4. A run stopped mid-epoch resumes across both processes (orbax restores on every process).
5. SIGTERM to one process (a scheduler's preemption) stops both at one step, with a checkpoint.
6. A smaller last batch and a batch smaller than the device count stay exact; processes whose
   data disagree get a clear error at the start (not a hang or silent garbage); Ctrl-C on process
   0 stops all at one step; the logged batch size is the global one.

All groups start at once (the first test that needs them starts them) and run side by side; every
child has a deadline, after which its process group is killed, so nothing outlives the tests.
"""
import glob
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_multihost_child.py")

# name: (scenarios run in turn by the group, processes, seconds before the group is killed).
# The groups that can hang (`fewer`, `shape`, `sigint`) get 120 s: correct, they end in ~20 s
# (a clear error at the start; a stop a few steps after the signal), ~40 s on a loaded machine.
GROUPS = {
    "pair": (["even", "resume", "ragged", "small"], 2, 480),
    "ref": (["even", "ragged", "small"], 1, 480),
    "fewer": (["fewer"], 2, 120),
    "shape": (["shape"], 2, 120),
    "preempt": (["preempt"], 2, 300),
    "sigint": (["preempt"], 2, 120),
    "local": (["preempt_local"], 2, 120),  # JAX's preemption service off
    "hookstop": (["hookstop"], 2, 120),
    "locked": (["locked"], 2, 120),
}
TRIGGERS = {  # group: (process, step, signal): sent once that process logs that step
    "preempt": (1, 3, signal.SIGTERM),  # a scheduler preempts one host
    "sigint": (0, 3, signal.SIGINT),  # Ctrl-C in the terminal of process 0, the one with the bar
    "local": (1, 3, signal.SIGINT),  # Ctrl-C to process 1, with no preemption notifier to tell
}
NEEDS = {  # test -> the groups it reads, so a -k selection starts only those
    "test_two_processes_match_one_process": ["pair", "ref"],
    "test_only_process_0_logs_and_all_agree_on_the_run": ["pair"],
    "test_checkpoint_restores_in_one_process": ["pair"],
    "test_resume_across_processes": ["pair", "ref"],
    "test_sigterm_to_one_process_stops_all_at_one_step": ["preempt"],
    "test_sigint_to_process_0_stops_all_at_one_step": ["sigint"],
    "test_sigint_to_process_1_without_the_preemption_service_stops_all_at_one_step": ["local"],
    "test_a_hook_that_stops_on_process_1_alone_stops_all_at_one_step": ["hookstop"],
    "test_ragged_last_batch_is_global": ["pair", "ref"],
    "test_batch_smaller_than_device_count": ["pair", "ref"],
    "test_fewer_batches_on_one_process_fails_clearly": ["fewer"],
    "test_different_batch_shapes_fail_clearly": ["shape"],
    "test_hparams_log_the_global_batch_size": ["pair"],
    "test_a_refused_resume_is_the_same_error_on_every_process": ["locked"],
}
ATOL = RTOL = 1e-5  # sgd; measured max |diff| 2 processes vs 1: 5e-7 on params of size ~5


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """Child processes that form one distributed run (or the 1-process reference). stdout is read
    line by line on threads; stderr goes to files; outputs are JSON/npy files per scenario. A
    watchdog kills every process group still running at the deadline, whether or not a test is
    waiting on it. `trigger=(i, step, sig)` sends `sig` to process i once it logs `step`."""

    def __init__(self, name, scenarios, nproc, timeout, base, trigger=None):
        self.name, self.nproc, self.trigger = name, nproc, trigger
        self.dir = os.path.join(base, name)
        self.out = os.path.join(self.dir, "out")
        os.makedirs(self.out)
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // nproc}")
        port = _free_port()
        self.procs, self.lines, self.timed_out, self.signalled = [], [], False, None
        for i in range(nproc):
            with open(self.stderr_path(i), "wb") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, CHILD, ",".join(scenarios), str(i), str(nproc), str(port),
                     os.path.join(self.dir, "work"), self.out],
                    stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                    start_new_session=True))  # its own process group, killed whole on timeout
            self.lines.append([])
        for i in range(nproc):
            threading.Thread(target=self._read, args=(i,), daemon=True).start()
        self.deadline = time.monotonic() + timeout
        self.watchdog = threading.Thread(target=self._watch, daemon=True)
        self.watchdog.start()

    def _read(self, i):
        for line in self.procs[i].stdout:
            line = line.rstrip("\n")
            self.lines[i].append(line)
            if (self.trigger and self.trigger[0] == i and self.signalled is None
                    and line.startswith("LOG") and int(line.split()[1]) >= self.trigger[1]):
                self.signalled = int(line.split()[1])
                self.procs[i].send_signal(self.trigger[2])

    def _watch(self):
        while time.monotonic() < self.deadline:
            if all(p.poll() is not None for p in self.procs):
                return
            time.sleep(0.1)
        self.timed_out = any(p.poll() is None for p in self.procs)
        self.kill()

    def stderr_path(self, i):
        return os.path.join(self.dir, f"stderr_{i}")

    def stderr(self, i, n=None):
        with open(self.stderr_path(i), "rb") as f:
            text = f.read().decode(errors="replace").replace("\r", "\n")
        return text if n is None else text[-n:]

    def wait_until(self, done):
        """Waits until, for every process i, `done(i)` holds or it has exited (or was killed at
        the deadline)."""
        while not all(p.poll() is not None or done(i) for i, p in enumerate(self.procs)):
            time.sleep(0.1)

    def results(self, scenario):
        """Every process's JSON for `scenario`, once each has finished it (or exited)."""
        self.wait_until(lambda i: f"DONE {scenario}" in self.lines[i])
        out = []
        for i in range(self.nproc):
            path = os.path.join(self.out, f"{scenario}_{i}.json")
            if not os.path.exists(path):
                pytest.fail(f"{self.name}: process {i} wrote no result for {scenario!r} "
                            f"({'killed at the deadline' if self.timed_out else 'exit status ' + str(self.procs[i].poll())}); "
                            f"stderr tail:\n{self.stderr(i, 3000)}")
            with open(path) as f:
                out.append(json.load(f))
        return out

    def params(self, scenario, i):
        return np.load(os.path.join(self.out, f"{scenario}_{i}.npy"))

    def finish(self):
        """Exit statuses, once every process has exited or been killed at the deadline."""
        self.watchdog.join()
        return [p.wait() for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


@pytest.fixture(scope="module")
def groups(request, tmp_path_factory):
    """Starts, all at once, the groups that the selected tests of this module read."""
    names = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            names.update(NEEDS.get(getattr(item, "originalname", item.name), []))
    base = str(tmp_path_factory.mktemp("multihost"))
    started = {}
    try:
        for name in sorted(names, key=list(GROUPS).index):
            scenarios, nproc, timeout = GROUPS[name]
            started[name] = Group(name, scenarios, nproc, timeout, base, TRIGGERS.get(name))
        yield started
    finally:
        for group in started.values():
            group.kill()


def _child_module():
    spec = importlib.util.spec_from_file_location("_multihost_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ok(results, group):
    for i, r in enumerate(results):
        assert "error" not in r, (f"{group.name}: process {i} failed:\n{r['error']['traceback']}")


def _assert_same_history(a, b, exact):
    assert a.keys() == b.keys()
    for k in a:
        if exact or k in ("epoch", "step", "eval/epoch", "eval/step"):
            assert a[k] == b[k], k
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=RTOL, atol=ATOL, err_msg=k)


def _assert_matches_reference(groups, scenario, ref_scenario=None):
    pair, ref = groups["pair"], groups["ref"]
    results = pair.results(scenario)
    (ref_result,) = ref.results(ref_scenario or scenario)
    _ok(results, pair)
    _ok([ref_result], ref)
    assert [r["process_count"] for r in results] == [2, 2]
    assert [r["devices"] for r in results] == [4, 4] and ref_result["devices"] == 4
    # The state is replicated: both processes hold the very same values, and the same history
    # (train metrics are means over the global batch, eval metrics over the whole eval set).
    np.testing.assert_array_equal(pair.params(scenario, 0), pair.params(scenario, 1))
    _assert_same_history(results[0]["history"], results[1]["history"], exact=True)
    # Against 1 process x 4 devices: the same up to the order of float sums in the collectives.
    np.testing.assert_allclose(pair.params(scenario, 0), ref.params(ref_scenario or scenario, 0),
                               rtol=RTOL, atol=ATOL)
    assert results[0]["step"] == ref_result["step"]
    if scenario == ref_scenario or ref_scenario is None:
        _assert_same_history(results[0]["history"], ref_result["history"], exact=False)
    return results, ref_result


def test_two_processes_match_one_process(groups):
    results, ref = _assert_matches_reference(groups, "even")
    assert results[0]["step"] == 16
    # Eval is exact: an accuracy over the 48 eval examples is a whole number of them, the same
    # number as in one process.
    for a, b in zip(results[0]["history"]["eval/accuracy"], ref["history"]["eval/accuracy"]):
        assert a * 48 == pytest.approx(round(a * 48), abs=1e-6) and round(a * 48) == round(b * 48)


def test_only_process_0_logs_and_all_agree_on_the_run(groups):
    pair = groups["pair"]
    results = pair.results("even")
    _ok(results, pair)
    # One run name for all (fit broadcasts process 0's), and no second run directory made.
    assert [r["run"] for r in results] == ["mh_1", "mh_1"]
    work = os.path.join(pair.dir, "work", "even")
    assert sorted(os.listdir(os.path.join(work, "logs"))) == ["mh_1"]
    assert sorted(os.listdir(os.path.join(work, "checkpoints"))) == ["mh_1"]
    # TensorBoard: process 0 opened the one writer, process 1 none; one event file.
    assert [r["writers_opened"] for r in results] == [1, 0]
    events = glob.glob(os.path.join(results[0]["log_dir"], "events.out.tfevents.*"))
    assert len(events) == 1, events
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    tags = {v.tag for e in EventFileLoader(events[0]).Load() for v in e.summary.value}
    assert {"train/loss", "eval/accuracy", "best/eval/accuracy"} <= tags
    # The bar and fit's messages: on process 0 only.
    assert any(line.startswith("fit: starting run 'mh_1'") for line in pair.lines[0])
    assert not any(line.startswith("fit:") or line.startswith("step ") for line in pair.lines[1]), pair.lines[1]
    assert "epoch 1/2" in pair.stderr(0)
    assert "epoch 1/2" not in pair.stderr(1) and "step/s" not in pair.stderr(1)


def test_checkpoint_restores_in_one_process(groups):
    """The checkpoint both processes wrote (each its part) restores here: 1 process, 8 devices."""
    from fit import load_ckpt
    pair = groups["pair"]
    results = pair.results("even")
    _ok(results, pair)
    child = _child_module()
    steps = sorted(int(d) for d in os.listdir(results[0]["ckpt_dir"]) if d.isdigit())
    assert steps[-1] == 16
    state = load_ckpt(child.make_state(), results[0]["ckpt_dir"])
    assert int(state.step) == 16
    np.testing.assert_array_equal(child.flat(state), pair.params("even", 0))


def test_resume_across_processes(groups):
    """Stopped at step 5 (mid-epoch, steps_per_jit=2), resumed by both processes: the result of
    the uninterrupted single-process run. Every process restores (orbax) and agrees on the run."""
    results, _ = _assert_matches_reference(groups, "resume", "even")
    assert [(r["first_run"], r["run"]) for r in results] == [("mh_1", "mh_1")] * 2
    assert results[0]["history"]["step"] == [5, 8, 16]  # the stop, then epochs 1 and 2
    assert results[0]["history"]["eval/step"] == [5, 8, 16]


def _assert_stopped_together(group, scenario="preempt"):
    """Every process stopped at one step, saved it together and exited alike; returns the
    exit statuses and the step."""
    codes = group.finish()
    assert group.trigger is None or group.signalled is not None, (
        "no signal sent: the trigger step was never logged", codes,
        group.stderr(group.trigger[0], 3000))
    assert not group.timed_out, (f"the processes were still running at the deadline, well after "
                                 f"the stop, and were killed; stderr tails:\n"
                                 f"{group.stderr(0, 1500)}\n{group.stderr(1, 1500)}")
    ends = [[int(line.split()[1]) for line in lines if line.startswith("END")] for lines in group.lines]
    assert len(ends[0]) == 1 and ends[0] == ends[1], (codes, ends)
    assert codes[0] == codes[1], codes
    step = ends[0][0]
    assert step >= (group.signalled or 0)
    ckpt_dir = os.path.join(group.dir, "work", scenario, "checkpoints", "mh_1")
    assert max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) == step
    return codes, step


def test_sigterm_to_one_process_stops_all_at_one_step(groups):
    """JAX's preemption notifier owns SIGTERM after jax.distributed.initialize (fit installs no
    handler there): a SIGTERM to process 1 alone stops both processes at one step, which both
    save together; both exit 143."""
    group = groups["preempt"]
    codes, step = _assert_stopped_together(group)
    assert codes == [143, 143], (codes, group.stderr(0, 2000), group.stderr(1, 2000))
    assert any(f"stopped by preemption at step {step}" in line for line in group.lines[0])


# ------------------------------------------------------------------------------------------------
# Ragged and small batches, data that disagrees between processes, Ctrl-C, the logged batch size.

def test_ragged_last_batch_is_global(groups):
    _assert_matches_reference(groups, "ragged")


def test_batch_smaller_than_device_count(groups):
    _assert_matches_reference(groups, "small")


def _assert_clear_error(group, scenario, values):
    codes = group.finish()
    assert not group.timed_out, (f"{scenario}: the processes had not exited by the deadline "
                                 f"(hung, or still training); stderr tails:\n{group.stderr(0, 1500)}\n"
                                 f"{group.stderr(1, 1500)}")
    for i, code in enumerate(codes):
        # A clean Python exception: exit status 1, not an abort (-6) from gloo or the
        # coordination service, nor success with silently wrong results.
        assert code == 1, f"{scenario}: process {i} exit status {code}:\n{group.stderr(i, 3000)}"
        with open(os.path.join(group.out, f"{scenario}_{i}.json")) as f:
            error = json.load(f).get("error")
        assert error, f"{scenario}: process {i} raised nothing"
        message = error["message"]
        assert re.search(r"process\D{0,3}1\b", message), message  # names the process ...
        for value in values:  # ... and the values that disagree
            assert re.search(rf"\b{value}\b", message), (value, message)
        # At the start: no step was trained (the first log point is step 3).
        assert not any(line.startswith("LOG") for line in group.lines[i]), group.lines[i]


def test_fewer_batches_on_one_process_fails_clearly(groups):
    _assert_clear_error(groups["fewer"], "fewer", [8, 7])


def test_different_batch_shapes_fail_clearly(groups):
    _assert_clear_error(groups["shape"], "shape", [8, 4])


def test_a_refused_resume_is_the_same_error_on_every_process(groups):
    # #24: process 0 claims the run for the job and finds its lock held; the refusal reaches
    # process 1 too (a broadcast), so both raise it instead of one training alone into a hang.
    group = groups["locked"]
    codes = group.finish()
    errors = []
    for i, code in enumerate(codes):
        assert code == 1, f"locked: process {i} exit status {code}:\n{group.stderr(i, 3000)}"
        with open(os.path.join(group.out, f"locked_{i}.json")) as f:
            errors.append(json.load(f).get("error"))
    assert errors[0] and errors[1], errors
    assert [e["type"] for e in errors] == ["RuntimeError"] * 2, errors
    assert errors[0]["message"] == errors[1]["message"], errors
    assert "run mh_1 is being written by host test, pid 4242" in errors[1]["message"]
    assert not any(line.startswith("LOG") for line in group.lines[1]), group.lines[1]


def test_sigint_to_process_0_stops_all_at_one_step(groups):
    _assert_stopped_together(groups["sigint"])


def test_sigint_to_process_1_without_the_preemption_service_stops_all_at_one_step(groups):
    """Without JAX's preemption notifier, a Ctrl-C reaches process 1 alone: it asks every process
    to stop at the next log point, where they agree; the stop stays resumable on all."""
    group = groups["local"]
    codes, step = _assert_stopped_together(group, "preempt_local")
    assert codes == [0, 0], (codes, group.stderr(0, 2000), group.stderr(1, 2000))
    for result in group.results("preempt_local"):
        assert result["history"]["stopped"] == [f"SIGINT at step {step}"], result["history"]


def test_a_hook_that_stops_on_process_1_alone_stops_all_at_one_step(groups):
    """A hook that stops on one process (its own data, its own clock) stops every process at the
    same step, and that stop is final on all (process 0 writes the checkpoint's record)."""
    group = groups["hookstop"]
    codes, step = _assert_stopped_together(group, "hookstop")
    assert codes == [0, 0], (codes, group.stderr(0, 2000), group.stderr(1, 2000))
    assert step >= 4
    stopped = [r["history"]["stopped"] for r in group.results("hookstop")]
    assert stopped == [[f"a hook on another process at step {step}"],
                       [f"stop_on_process_1 at step {step}"]], stopped


def test_hparams_log_the_global_batch_size(groups):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2
    results = groups["pair"].results("even")
    _ok(results, groups["pair"])
    (events,) = glob.glob(os.path.join(results[0]["log_dir"], "events.out.tfevents.*"))
    hparams = {}
    for event in EventFileLoader(events).Load():
        for v in event.summary.value:
            if v.metadata.plugin_data.plugin_name == "hparams":
                data = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    hparams = dict(data.session_start_info.hparams)
    assert hparams["devices"].number_value == 4
    assert hparams["batch_size"].number_value == 16
