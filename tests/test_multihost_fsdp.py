"""batch_axes (#42) on 2 processes x 2 CPU devices, whose mesh's 'fsdp' axis spans the processes.

The child processes are tests/_multihost_child.py's FSDP scenarios (its docstring has them): an
nnx model with LoRA whose base weights are sharded ("fsdp", "tp"), only the adapters trained.
Meshes of ("data", "fsdp", "tp") put 'fsdp' index i on process i's devices, so a batch split over
("data", "fsdp") or ("fsdp",) puts one half of its rows on each process; the axis of size 2
inside a process ('tp', or 'data' in mesh B) holds the same rows (mesh A) or splits them again
(mesh B, batch_axes=("fsdp", "data")).

1. Lists (each process its share of every global batch) with batch_axes=("data", "fsdp"), and
   arrays (the same on every process, the global batch_size) with batch_axes=("fsdp",): both train
   to the adapters of one process with 4 devices on the same global batches (within 1e-5), the
   base kernel still split over the processes.
2. A batch that does not split over the named axes (a list's 3 rows a process over 2 batch shards
   a process; arrays' global batch of 6 over 4) raises the batching ValueError naming the
   batch_axes, the same on both processes, before any step; neither hangs (the child goes on to
   its next scenario).

Two groups run side by side: `pair` (2 processes) and `ref` (1 process, 4 devices). About
25 s on 2 cores.
"""
import numpy as np
import pytest

from test_multihost import Group, _assert_same_history, _ok

# name: (scenarios run in turn, processes, seconds before the group is killed: correct, they end
# in ~25 s, ~60 s on a loaded machine). The refusals come first: a process that hung there would
# leave the others unrun, and the deadline would end the group.
GROUPS = {
    "pair": (["fsdp_odd_list", "fsdp_odd_arrays", "fsdp_list", "fsdp_arrays"], 2, 150),
    "ref": (["fsdp_odd_arrays", "fsdp_list", "fsdp_arrays"], 1, 150),
}
NEEDS = {  # test -> the groups it reads, so a -k selection starts only those
    "test_fsdp_across_processes_trains_as_one_process": ["pair", "ref"],
    "test_a_batch_that_does_not_split_over_the_batch_axes_is_refused_on_every_process": [
        "pair", "ref"],
}
TOL = 1e-5  # adam(1e-2) on the adapters, 8 steps; measured max |diff| 2 processes vs 1: 0.0


@pytest.fixture(scope="module")
def groups(request, tmp_path_factory):
    names = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            names.update(NEEDS.get(getattr(item, "originalname", item.name), []))
    base = str(tmp_path_factory.mktemp("multihost_fsdp"))
    started = {}
    try:
        for name in sorted(names, key=list(GROUPS).index):
            scenarios, nproc, timeout = GROUPS[name]
            started[name] = Group(name, scenarios, nproc, timeout, base)
        yield started
    finally:
        for group in started.values():
            group.kill()


@pytest.mark.parametrize("scenario, steps", [("fsdp_list", 8), ("fsdp_arrays", 8)])
def test_fsdp_across_processes_trains_as_one_process(groups, scenario, steps):
    pair, ref = groups["pair"], groups["ref"]
    results = pair.results(scenario)
    (ref_result,) = ref.results(scenario)
    _ok(results, pair)
    _ok([ref_result], ref)
    assert [r["process_count"] for r in results] == [2, 2] and ref_result["process_count"] == 1
    assert [r["devices"] for r in results] == [4, 4] and ref_result["devices"] == 4
    # 'fsdp' spans the processes: fsdp index i is process i's two devices.
    assert results[0]["mesh_processes"] == [[[0, 0], [1, 1]]], results[0]["mesh_processes"]
    # The base stays split over the processes (fsdp) and within them (tp): no process holds it all.
    assert [r["kernel_spec"] for r in results] == [["fsdp", "tp"]] * 2
    assert [r["kernel_addressable"] for r in results] == [False, False]
    assert [r["step"] for r in results] == [steps, steps] and ref_result["step"] == steps
    # The batches: this process's rows, split over the batch_axes (one half on each process).
    axes = ["data", "fsdp"] if scenario == "fsdp_list" else "fsdp"
    for r in results:
        assert r["placed"] == [[[axes], [3, 8], [6, 8]]] + (
            [[[axes], [2, 8], [4, 8]]] if scenario == "fsdp_arrays" else []), r["placed"]
    # The adapters are replicated: both processes hold the very same ones, and the same history.
    np.testing.assert_array_equal(pair.params(scenario, 0), pair.params(scenario, 1))
    _assert_same_history(results[0]["history"], results[1]["history"], exact=True)
    # Against 1 process x 4 devices on the same global batches: the same up to float sum order.
    adapters, reference = pair.params(scenario, 0), ref.params(scenario, 0)
    assert adapters.shape == reference.shape == (2 * 16 * 4,)
    # lora_a then lora_b, which LoRA starts at zeros: it moved.
    assert np.abs(adapters[64:]).max() > 1e-3, "the adapters never trained"
    np.testing.assert_allclose(adapters, reference, rtol=0, atol=TOL)
    for k, v in results[0]["history"].items():
        np.testing.assert_allclose(v, ref_result["history"][k], rtol=TOL, atol=TOL, err_msg=k)
    assert results[0]["history"].keys() == ref_result["history"].keys()
    if scenario == "fsdp_list":
        assert "eval/loss" in results[0]["history"]


@pytest.mark.parametrize("scenario, shards, axes", [("fsdp_odd_list", 2, "('fsdp', 'data')"),
                                                    ("fsdp_odd_arrays", 4, "('fsdp', 'data')")])
def test_a_batch_that_does_not_split_over_the_batch_axes_is_refused_on_every_process(
        groups, scenario, shards, axes):
    pair = groups["pair"]
    results = pair.results(scenario)
    assert [r["process_count"] for r in results] == [2, 2]
    # Mesh B: 'fsdp' across the processes, 'data' within each.
    assert results[0]["mesh_processes"] == [[[0], [1]], [[0], [1]]], results[0]["mesh_processes"]
    messages = []
    for i, r in enumerate(results):
        assert r.get("error"), f"process {i} trained (no error): {r.get('history')}"
        assert r["error"]["type"] == "ValueError", r["error"]["traceback"]
        messages.append(r["error"]["message"])
        assert r["events"] == [], r["events"]  # before train_start: no step, no hook called
        lines = pair.lines[i]
        assert not any(line.startswith(("LOG", "END"))
                       for line in lines[:lines.index(f"DONE {scenario}")]), lines
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert "must be divisible by the number of devices its rows split over" in message, message
    assert f"({shards}, on the batch_axes {axes})" in message, message
    # Neither process hung: both went on to their next scenario, and finished it.
    nxt = GROUPS["pair"][0][GROUPS["pair"][0].index(scenario) + 1]
    pair.results(nxt)
    if scenario == "fsdp_odd_arrays":  # the same global numbers, and error, on 1 process
        (ref_result,) = groups["ref"].results(scenario)
        assert ref_result.get("error", {}).get("message") == message, ref_result
