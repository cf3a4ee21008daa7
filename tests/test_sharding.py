"""Sharded states: a ("data", "model") mesh, and checkpoints moved between device counts."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import MLP, flat, loss_fn, make_state
from fit import fit, load_ckpt


def _data():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(8)]


def model_parallel(state):
    """Tensor-parallel layout: every 2-D kernel's output features over "model"; the rest
    (biases, step, rng) replicated. (With flax.linen partitioning annotations, pass
    `nn.get_partition_spec(state)` instead.)"""
    return jax.tree.map(lambda x: P(None, "model") if np.ndim(x) == 2 and x.shape[1] % 2 == 0 else P(),
                        state)


def test_a_data_model_mesh_trains_like_the_replicated_run(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    state = make_state(MLP(), tx=optax.sgd(0.1))
    sharded, h1 = fit(state, _data(), _data()[:2], loss_fn=loss_fn, num_epochs=2, mesh=mesh,
                      state_sharding=model_parallel, workdir=str(tmp_path), log_name="sharded")
    replicated, h2 = fit(state, _data(), _data()[:2], loss_fn=loss_fn, num_epochs=2,
                         workdir=str(tmp_path), log_name="replicated")
    kernel = sharded.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P(None, "model")
    assert len({str(s.index) for s in kernel.addressable_shards}) == 2  # really split in two halves
    np.testing.assert_allclose(flat(sharded.params), flat(replicated.params), atol=1e-5)
    assert h1["eval/loss"] == pytest.approx(h2["eval/loss"], rel=1e-5)


@pytest.mark.parametrize("devices", [1, 4])
def test_save_on_8_devices_restore_and_continue_on_fewer(tmp_path, devices):
    eight = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    state = make_state(MLP(), tx=optax.adam(1e-3))
    trained, h8 = fit(state, _data(), loss_fn=loss_fn, num_epochs=1, mesh=eight,
                      state_sharding=model_parallel, workdir=str(tmp_path), log_name="move")
    fewer = Mesh(np.array(jax.devices()[:devices]), ("data",))
    target = jax.device_put(state, NamedSharding(fewer, P()))
    restored = load_ckpt(target, h8.ckpt_dir)
    np.testing.assert_array_equal(flat(restored.params), flat(trained.params))
    assert restored.params["Dense_0"]["kernel"].sharding.mesh.size == devices
    # ... and training goes on there, from the checkpoint, with the other layout
    continued, h = fit(state, _data(), loss_fn=loss_fn, num_epochs=2, mesh=fewer, resume=True,
                       workdir=str(tmp_path), log_name="move")
    assert h.run == h8.run and h["step"] == [8, 16] and int(continued.step) == 16
    assert continued.params["Dense_0"]["kernel"].sharding.mesh.size == devices


def test_several_processes_need_a_length_for_a_generator(tmp_path, monkeypatch):
    """Every process must run the same steps; a generator's length is unknown before the run."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"several processes, a train_ds without len\(\).*steps_per_epoch= or max_steps="):
        fit(make_state(MLP()), (b for b in _data()), loss_fn=loss_fn, workdir=str(tmp_path))
    assert not list(tmp_path.iterdir())
