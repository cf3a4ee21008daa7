"""Multi-process data (#40): 2 processes x 2 CPU devices, against 1 process x 4 devices.

The child processes are tests/_multihost_child.py's data scenarios (its docstring has them):
99 examples whose targets are their own indices, so the loss reports which examples each global
batch holds (the child's `FINGERPRINT`: mean index, mean squared index, mean index of the first
half, the fraction of examples whose partner 2j <-> 2j+1 is in the batch too, the fraction there
once).

1. Arrays: every process passes the same arrays (x, y) with the global batch_size, and fit cuts
   the global batches from one shuffle of all the examples, by (seed, epoch), as one process
   would; a run killed on 2 processes mid-epoch resumes on 1 process as if never stopped.
2. The pre-#40 way (each process its own rows, a per-process batch_size) is refused on every
   process.
3. A grain loader sharded by process resumes on 2 processes, each process from its own position
   in its own loader; on 1 process that checkpoint is refused, naming both process counts.
4. Hooks' states are saved by name: after a resume on 2 processes, EarlyStopping's count on
   process 1 is the uninterrupted run's.

Four groups run side by side. `pair` and `pair2` end with a run killed (os._exit) once a
mid-epoch checkpoint has committed; a thread then copies each killed run into `one` (1 process,
4 devices) and `resume2` (2 processes), whose resume scenarios wait for it (a READY file).
About 35 s on 2 idle cores.
"""
import glob
import json
import os
import shutil
import threading

import numpy as np
import pytest

from test_multihost import ATOL, RTOL, Group, _assert_same_history, _ok

# name: (scenarios run in turn, processes, seconds before the group is killed)
GROUPS = {
    "pair": (["arrays", "grain", "arrays_cut"], 2, 300),
    "pair2": (["old_way", "grain_cut"], 2, 300),
    "one": (["arrays", "grain_one", "arrays_resume"], 1, 420),
    "resume2": (["grain_resume", "arrays_resume"], 2, 420),
}
KILLED = {"pair": "arrays_cut", "pair2": "grain_cut"}  # group: its killed run, copied on
WAITING = ("one", "resume2")  # groups that resume the killed runs (so need both groups above)
NEEDS = {  # test -> the groups it reads, so a -k selection starts only those (and what they need)
    "test_arrays_killed_on_two_processes_resume_on_one_as_if_never_stopped": ["pair", "one"],
    "test_array_batches_are_cut_from_one_shuffle_of_all_examples": ["pair", "one"],
    "test_each_process_passing_its_own_rows_is_refused_on_every_process": ["pair2"],
    "test_grain_loader_sharded_by_process_resumes_each_from_its_own_position": [
        "pair", "pair2", "resume2"],
    "test_grain_checkpoint_of_two_processes_is_refused_on_one": ["pair2", "one"],
    "test_early_stopping_count_on_process_1_survives_a_resume": ["pair", "resume2"],
}
ROWS, BATCH, SEED = 99, 16, 0  # the arrays: 6 global batches of 16 and one of 3 an epoch


@pytest.fixture(scope="module")
def groups(request, tmp_path_factory):
    """Starts the groups the selected tests read, and a thread per killed run that copies it,
    once its group has ended, into each started waiting group's workdir, then writes READY."""
    names = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            names.update(NEEDS.get(getattr(item, "originalname", item.name), []))
    if names & set(WAITING):
        names.update(KILLED)
    base = str(tmp_path_factory.mktemp("multihost_data"))
    started = {}
    try:
        for name in sorted(names, key=list(GROUPS).index):
            scenarios, nproc, timeout = GROUPS[name]
            started[name] = Group(name, scenarios, nproc, timeout, base)
        for name, run in KILLED.items():
            if name in started:
                threading.Thread(target=_copy_when_killed, daemon=True, args=(
                    started[name], run, [started[w] for w in WAITING if w in started])).start()
        yield started
    finally:
        for group in started.values():
            group.kill()


def _copy_when_killed(group, run, targets):
    group.finish()
    source = os.path.join(group.dir, "work", run)
    for target in targets:
        dest = os.path.join(target.dir, "work", run)
        if os.path.isdir(source):
            shutil.copytree(source, dest)
        os.makedirs(dest, exist_ok=True)  # (nothing to copy: the resume starts afresh and fails)
        open(os.path.join(dest, "READY"), "w").close()


def _killed(groups, name, step, saved):
    """Asserts that `name`'s killed run ended by its hook after step `saved`'s checkpoint
    committed, and that this is the latest checkpoint of the run; returns that step's meta."""
    group = groups[name]
    codes = group.finish()
    assert not group.timed_out, (name, codes, group.stderr(0, 3000))
    assert f"KILL {step}" in group.lines[0], (name, codes, group.lines[0][-5:],
                                              group.stderr(0, 3000))
    (ckpt_dir,) = glob.glob(os.path.join(group.dir, "work", KILLED[name], "checkpoints", "*"))
    steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    assert steps[-1] == saved, steps
    with open(os.path.join(ckpt_dir, str(saved), "meta", "metadata")) as f:
        return json.load(f)


def _documented_batches(epochs):
    """fit's global batches of the arrays, by its documented rule: each epoch, all rows in the
    order `np.random.default_rng([seed, epoch]).permutation`, cut into batches of batch_size,
    each batch's rows sorted (process p of P takes rows [p*r/P, (p+1)*r/P) of a batch of r rows,
    or all r rows if r % P != 0)."""
    out = []
    for epoch in range(epochs):
        order = np.random.default_rng([SEED, epoch]).permutation(ROWS)
        out += [np.sort(order[i:i + BATCH]) for i in range(0, ROWS, BATCH)]
    return out


def _fingerprint(ids):
    """The child's `FINGERPRINT` of a batch of example indices, as its loss computes it."""
    f = ids.astype(np.float64)
    together = np.isin(ids ^ 1, ids).mean()
    return [f.mean(), (f * f).mean(), f[:max(len(ids) // 2, 1)].mean(), together, 1.0]


def _steps(result):
    """{step: FINGERPRINT} recorded at every step of a run."""
    return {row[0]: row[1:] for row in result["steps"]}


def _same_steps(a, b, steps, exact=False):
    for step in steps:
        if exact:
            assert a[step] == b[step], (step, a[step], b[step])
        else:
            np.testing.assert_allclose(a[step], b[step], rtol=1e-6, err_msg=f"step {step}")


# ----------------------------------------------------------------------------------------------
# 1. Arrays: the same arrays on every process, one shuffle, the same batches on any process count

def test_array_batches_are_cut_from_one_shuffle_of_all_examples(groups):
    """Every process passes all 99 examples with the global batch_size=16; at every step of 3
    epochs the global batch holds exactly the examples of fit's documented rule (one permutation
    of all rows by (seed, epoch), cut into batches, rows sorted; the first half is process 0's
    share), each once, on 2 processes and on 1. So examples 2j and 2j+1 are not stuck together:
    before #40 each process shuffled its own rows (`x[p::2]`) with the same permutation, and the
    two halves of every global batch were always partners. 2 and 1 processes then train the same
    model (float reduction order aside)."""
    pair, one = groups["pair"], groups["one"]
    results, (ref,) = pair.results("arrays"), one.results("arrays")
    _ok(results, pair)
    _ok([ref], one)
    assert [r["process_count"] for r in results] == [2, 2] and ref["devices"] == 4
    expected = _documented_batches(3)
    for who, result in (("process 0", results[0]), ("process 1", results[1]), ("1 process", ref)):
        steps = _steps(result)
        assert sorted(steps) == list(range(1, 22)), (who, sorted(steps))
        for step, ids in enumerate(expected, 1):
            np.testing.assert_allclose(steps[step], _fingerprint(ids), rtol=1e-6,
                                       err_msg=f"{who}, step {step}: batch {ids.tolist()}")
    # Partners share a batch about as often as chance has it (15/98 of the time), not always.
    together = [row[4] for row in results[0]["steps"][:14]]  # (2 epochs)
    assert np.mean(together) < 0.4, together
    always = [j for j in range(ROWS // 2)
              if all((2 * j in ids) == (2 * j + 1 in ids) for ids in expected[:14])]
    assert len(always) < 10, always
    # The same training as 1 process x 4 devices.
    np.testing.assert_array_equal(pair.params("arrays", 0), pair.params("arrays", 1))
    np.testing.assert_allclose(pair.params("arrays", 0), one.params("arrays", 0),
                               rtol=RTOL, atol=ATOL)
    _assert_same_history(results[0]["history"], ref["history"], exact=False)


def test_arrays_killed_on_two_processes_resume_on_one_as_if_never_stopped(groups):
    """2 processes x 2 devices train the arrays and die (os._exit, as a crash) mid-epoch 3, just
    after step 16's checkpoint committed; 1 process x 4 devices resumes that run: the step
    counts, history, the batches of every step after the resume and the final params are those
    of an uninterrupted 1 x 4 run (within float reduction order). The checkpoint holds each
    process's position (arrays: batches done only, so any process count resumes them)."""
    meta = _killed(groups, "pair", step=17, saved=16)
    assert meta["epoch"] == 2 and meta["positions"] == [[2, None], [2, None]], meta["positions"]
    one = groups["one"]
    (ref,), (resumed,) = one.results("arrays"), one.results("arrays_resume")
    _ok([ref, resumed], one)
    assert resumed["process_count"] == 1 and resumed["devices"] == 4
    assert resumed["step"] == ref["step"] == 21
    assert resumed["history"]["step"] == ref["history"]["step"] == [7, 14, 21]
    _assert_same_history(resumed["history"], ref["history"], exact=False)
    done, mine = _steps(ref), _steps(resumed)
    assert sorted(mine) == list(range(17, 22)), sorted(mine)  # (none trained twice)
    _same_steps(mine, done, range(17, 22))
    np.testing.assert_allclose(one.params("arrays_resume", 0), one.params("arrays", 0),
                               rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# 2. The old way, each process its own rows and batch size: refused

def test_each_process_passing_its_own_rows_is_refused_on_every_process(groups):
    """Each process passes its own rows (`x[:96][p::2]`, 48 each) with batch_size=8, as fit
    wanted before #40: the arrays differ (fit compares a hash of each process's), so every
    process raises the same ValueError before training, naming the fix."""
    group = groups["pair2"]
    results = group.results("old_way")
    assert [r["process_count"] for r in results] == [2, 2]
    messages = []
    for i, r in enumerate(results):
        assert r.get("error"), f"process {i} trained on its own rows (no error): {r['steps']}"
        assert r["error"]["type"] == "ValueError", r["error"]["traceback"]
        messages.append(r["error"]["message"])
        assert not r["steps"], r["steps"]
        lines = group.lines[i]
        assert not any(line.startswith("LOG") for line in lines[:lines.index("DONE old_way")])
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert "the processes' data disagree" in message, message
    assert ("Every process must pass the same arrays (x, y) with the global batch_size"
            in message), message
    assert "process 0: train_ds: arrays of 48 rows" in message, message
    assert "process 1: train_ds: arrays of 48 rows" in message, message


# ----------------------------------------------------------------------------------------------
# 3. A grain loader sharded by process: each process resumes from its own position

def test_grain_loader_sharded_by_process_resumes_each_from_its_own_position(groups):
    """grain's DataLoader with `ShardByJaxProcess` (each process reads its own half of 96
    examples, 8 a batch, reshuffled each epoch) on 2 processes, killed after step 8's checkpoint
    (mid-epoch 2, the loaders read ahead), resumed on 2 processes: the checkpoint holds each
    process's own loader state, and the resumed run trains, step for step, the batches of an
    uninterrupted 2-process run and ends with its params. Each process went back to its place
    with grain's `set_state`: it read only the 4 batches left (and the one fit reads up front),
    not the 2 trained before the checkpoint again."""
    meta = _killed(groups, "pair2", step=9, saved=8)
    positions = meta["positions"]
    assert [p[0] for p in positions] == [2, 2], positions
    assert all(p[1] for p in positions) and positions[0][1] != positions[1][1], positions
    pair, again = groups["pair"], groups["resume2"]
    ref, resumed = pair.results("grain"), again.results("grain_resume")
    _ok(ref, pair)
    _ok(resumed, again)
    assert [r["step"] for r in resumed] == [r["step"] for r in ref] == [12, 12]
    assert resumed[0]["history"]["step"] == ref[0]["history"]["step"] == [6, 12]
    _assert_same_history(resumed[0]["history"], ref[0]["history"], exact=False)
    done = _steps(ref[0])
    assert _steps(ref[1]) == done  # (the global batch's metrics: the same on both)
    for r in resumed:
        assert sorted(_steps(r)) == list(range(9, 13)), sorted(_steps(r))
        _same_steps(_steps(r), done, range(9, 13), exact=True)
        assert r["reads"] <= (12 - 8 + 1) * 8, r["reads"]
    for i in range(2):
        np.testing.assert_allclose(again.params("grain_resume", i), pair.params("grain", 0),
                                   rtol=1e-6, atol=1e-6)


def test_grain_checkpoint_of_two_processes_is_refused_on_one(groups):
    """The killed 2-process grain run (each process at its own place in its own loader) resumed
    by 1 process, with the same global batch (16) and batches per epoch: a ValueError naming
    both process counts, before any step."""
    _killed(groups, "pair2", step=9, saved=8)
    one = groups["one"]
    (result,) = one.results("grain_one")
    assert result.get("error"), f"1 process resumed a 2-process grain run: {result['steps']}"
    assert result["error"]["type"] == "ValueError", result["error"]["traceback"]
    message = result["error"]["message"]
    assert ("was saved by 2 process(es), each at its own place in its data loader (get_state); "
            "resume it on 2 process(es), this call has 1") in message, message
    assert not result["steps"], result["steps"]


# ----------------------------------------------------------------------------------------------
# 4. Hooks' states by name: EarlyStopping on process 1 after a resume

def test_early_stopping_count_on_process_1_survives_a_resume(groups):
    """`EarlyStopping(patience=100, min_delta=10)` on train/accuracy counts every epoch after the
    first (its best, epoch 1's accuracy, is never beaten by 10). The array run killed mid-epoch 3
    (count 1 at its checkpoint) and resumed on 2 processes ends with the uninterrupted 2-process
    run's best and count on both processes, and its params. Before #40 hooks' states were saved
    by position among all hooks, and process 1 (no TensorBoard hook) looked its state up at another
    position: its EarlyStopping started again from nothing."""
    _killed(groups, "pair", step=17, saved=16)
    pair, again = groups["pair"], groups["resume2"]
    ref, resumed = pair.results("arrays"), again.results("arrays_resume")
    _ok(ref, pair)
    _ok(resumed, again)
    assert [r["step"] for r in resumed] == [21, 21]
    assert [r["es"]["bad"] for r in ref] == [2, 2], [r["es"] for r in ref]
    for i in range(2):
        assert resumed[i]["es"]["bad"] == ref[i]["es"]["bad"], (i, resumed[i]["es"], ref[i]["es"])
        assert resumed[i]["es"]["best"] == pytest.approx(ref[i]["es"]["best"], abs=1e-6), i
        np.testing.assert_allclose(again.params("arrays_resume", i), pair.params("arrays", 0),
                                   rtol=1e-6, atol=1e-6)
