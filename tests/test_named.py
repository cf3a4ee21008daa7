"""#31 (in part): a run's stable name and id for hooks (trackers such as wandb), and the batching
error naming the option to pass."""
import jax
import pytest

import fit as fit_module
from conftest import MLP, loss_fn, make_state
from fit import fit


def test_run_id_is_stable_across_resumes_and_unique_across_workdirs(digits, tmp_path,
                                                                     one_device_mesh):
    x, y, _, _ = digits
    seen = []
    hook = lambda event, run: event == "train_start" and seen.append((run.name, run.id))
    common = dict(loss_fn=loss_fn, batch_size=32, mesh=one_device_mesh, verbose=0,
                  tensorboard=False, hooks=[hook], log_name="mnist")
    for workdir in ("a", "b"):
        fit(make_state(MLP()), (x[:128], y[:128]), max_steps=2, workdir=str(tmp_path / workdir),
            **common)
    fit(make_state(MLP()), (x[:128], y[:128]), max_steps=4, resume=True,
        workdir=str(tmp_path / "a"), **common)
    (name_a, id_a), (name_b, id_b), (name_resumed, id_resumed) = seen
    assert name_a == name_b == name_resumed == "mnist_1"
    assert id_resumed == id_a != id_b and id_a.startswith("mnist_1-")


@pytest.mark.parametrize("processes", [1, 2])
def test_the_batching_error_names_the_batch_size_to_pass(monkeypatch, processes):
    # (#40: arrays' batch_size is the global batch on any number of processes)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    progress = fit_module._Progress(seed=0, batching=(64, 4))
    with pytest.raises(ValueError) as e:
        progress.check("run_1", 0, (32, 8))
    assert "batch_size=64)" in str(e.value), str(e.value)
