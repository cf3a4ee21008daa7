"""The loop never waits on the device per step, and batches reach the device ahead of the step
that uses them. Speed itself is measured by benchmarks/bench.py, never by timed tests."""
import numpy as np
import pytest
from jax._src import array as jax_array

import fit as fit_module
from conftest import MLP, loss_fn, make_state
from fit import fit


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every read of a device array's value on the host. jax.transfer_guard does not
    fire for device-to-host reads on CPU, so the read paths themselves are wrapped: `_value`
    (device_get, float, int, bool), `__array__` (np.asarray) and `item`."""
    reads = []
    cls = jax_array.ArrayImpl
    value, to_numpy, item = cls._value, cls.__array__, cls.item

    def counted(fn):
        def wrapper(self, *args, **kwargs):
            reads.append(self.shape)
            return fn(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(cls, "_value", property(counted(value.fget)))
    monkeypatch.setattr(cls, "__array__", counted(to_numpy))
    monkeypatch.setattr(cls, "item", counted(item))
    # (#49) np.asarray reads a jax.Array through the buffer protocol, not __array__: counted too
    asarray = np.asarray
    monkeypatch.setattr(np, "asarray", lambda a, *args, **kwargs: (
        isinstance(a, cls) and reads.append(a.shape), asarray(a, *args, **kwargs))[1])
    return reads


def _data(n_batches, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(n_batches)]


def _reads_during_fit(host_reads, tmp_path, name, steps_per_epoch, log_every, mesh):
    train, test = _data(steps_per_epoch), _data(3, seed=1)
    state = make_state(MLP())
    before = len(host_reads)
    fit(state, train, test, loss_fn=loss_fn, num_epochs=2, log_every=log_every,
        workdir=str(tmp_path), log_name=name, mesh=mesh)
    return len(host_reads) - before


def test_host_reads_do_not_grow_with_steps(host_reads, tmp_path, one_device_mesh):
    # Same number of log points (4), evals (2) and saves (2); twice the steps.
    short = _reads_during_fit(host_reads, tmp_path, "short", 100, 50, one_device_mesh)
    long = _reads_during_fit(host_reads, tmp_path, "long", 200, 100, one_device_mesh)
    assert short > 0, "the counter saw no reads at all: it is not wrapping the read paths"
    assert long == short, f"{long} host reads for 400 steps vs {short} for 200: a per-step read"
    # The counter can see a per-step read: logging every step reads every step.
    every = _reads_during_fit(host_reads, tmp_path, "every", 100, 1, one_device_mesh)
    assert every > short + 150, (every, short)


def test_batches_are_placed_before_their_step(monkeypatch, tmp_path):
    # On the 8 simulated devices: there put really places each batch (on a single CPU device it
    # hands numpy to jit, whose own C++ path is faster than device_put).
    events = []
    real_putter, real_train = fit_module._putter, fit_module._Dispatch.__call__

    def putter(*args, **kwargs):
        real_put = real_putter(*args, **kwargs)

        def put(*args, **kwargs):
            events.append("put")
            return real_put(*args, **kwargs)
        return put

    def train(self, *args, **kwargs):
        events.append("step")
        return real_train(self, *args, **kwargs)

    monkeypatch.setattr(fit_module, "_putter", putter)
    monkeypatch.setattr(fit_module._Dispatch, "__call__", train)
    placed = []
    real_device_put = fit_module.jax.device_put

    def device_put(x, *args, **kwargs):
        placed.append(1)
        return real_device_put(x, *args, **kwargs)

    monkeypatch.setattr(fit_module.jax, "device_put", device_put)
    fit(make_state(MLP()), _data(10), loss_fn=loss_fn, workdir=str(tmp_path))
    assert len(placed) >= 10, "the batches were not placed on the devices by put"
    steps = [i for i, e in enumerate(events) if e == "step"]
    assert len(steps) == 10
    for n, i in enumerate(steps):
        # when step n is dispatched, batches n+1 and n+2 are already on their way to the device
        assert events[:i].count("put") >= min(n + 3, 10), (n, events)


def test_norms_are_computed_at_log_steps_and_saves_only(monkeypatch, tmp_path, one_device_mesh):
    # #16: grad_norm and param_norm cost a pass over every parameter; they are computed inside
    # the compiled step at log steps only (and the parameters' norm before each save). Counted at
    # run time: a debug callback in the norm runs only when its branch of the step runs.
    import collections
    import jax
    import optax
    runs = []
    norm = optax.tree.norm

    def counted(tree, *args, **kwargs):
        jax.debug.callback(lambda: runs.append(1))
        return norm(tree, *args, **kwargs)

    monkeypatch.setattr(optax.tree, "norm", counted)
    monkeypatch.setattr(fit_module, "_STEPS", collections.OrderedDict())  # trace afresh
    logged = []
    hook = lambda event, run: event == "log" and logged.append(dict(run.metrics))
    fit(make_state(MLP()), _data(20), loss_fn=loss_fn, log_every=5, hooks=[hook],
        mesh=one_device_mesh, workdir=str(tmp_path))
    jax.effects_barrier()
    # 4 log steps x (grad_norm + param_norm) and the check before the one save at the end (the
    # check compiles beside the first step, #41, and does not run there)
    assert len(runs) == 4 * 2 + 1, len(runs)
    assert all("train/grad_norm" in m and "train/param_norm" in m for m in logged), logged
    # the values of the log step itself, not the 0 of a step whose branch did not run
    assert all(m["train/grad_norm"] > 0 and m["train/param_norm"] > 0 for m in logged), logged
