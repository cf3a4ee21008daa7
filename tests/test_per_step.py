"""#28: an ordinary step does no host work that a hand-written loop need not do, device data stays
on the device, and no step holds a conditional where the device is a GPU. Speed itself is
measured by benchmarks/bench.py, never by timed tests."""
import collections
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import array as jax_array
from jax.sharding import Mesh

import fit as fit_module
from conftest import CNN, MLP, eval_step, fit_at, loss_fn, make_state
from fit import fit

HERE = os.path.dirname(os.path.abspath(__file__))
BEFORE = "b603621"  # the fit.py that #28 measured and changed


def _per_step_counts(fit_py, tmp_path):
    out = tmp_path / f"counts-{os.path.basename(fit_py)}.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, os.path.join(HERE, "_per_step_child.py"), str(fit_py),
                    str(out)], check=True, env=env, timeout=300)
    return json.loads(out.read_text())


def test_an_ordinary_step_calls_no_checks_shardings_or_process_queries(tmp_path, monkeypatch):
    # 2 simulated devices, a list of numpy batches: between the 5th and the 15th step's dispatch
    # (no log point, eval or save there), fit's per-batch work is the step, the put and the check.
    counts = _per_step_counts(os.path.join(os.path.dirname(HERE), "fit.py"), tmp_path)
    assert counts == {"_kinds": 0, "dtype.__str__": 0, "NamedSharding": 0, "process_count": 0,
                      "read": 0, "_Plan.due": 0}, counts
    # The counters see these calls: the fit.py before #28 made each of them at every step.
    old = fit_at(BEFORE, tmp_path, monkeypatch)
    counts = _per_step_counts(old.__file__, tmp_path)
    assert all(n >= 10 for n in counts.values()), counts


class Loader:
    """A re-iterable loader (not a list, so its batches are checked as they come)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _batches(n, size=16, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 8, 8, 1)).astype(dtype),
             rng.integers(0, 10, size).astype(np.int32)) for _ in range(n)]


def test_a_float64_batch_after_float32_ones_gets_the_clear_error(tmp_path, one_device_mesh):
    batches = _batches(6)
    batches[4] = (batches[4][0].astype(np.float64), batches[4][1])
    with pytest.raises(ValueError, match=r"batch 4 of train_ds has shapes/dtypes .*float64.*"
                                         r"unlike the first batch's .*float32"):
        fit(make_state(MLP()), Loader(batches), loss_fn=loss_fn, mesh=one_device_mesh,
            workdir=str(tmp_path), verbose=0)


def _events(module, workdir, data, test, resume=False, asks=False, **options):
    events = []

    def hook(event, run):
        if event in ("log", "eval", "epoch_end", "save", "train_end"):
            events.append((event, run.step))
        if asks and event == "train_start":  # a save after the first step
            run.save = True
        if asks and event == "save" and run.step > 10:  # a stop asked by a save's hook
            run.stop = True
    state = module.TrainState.create(apply_fn=MLP().apply, params=make_state(MLP()).params,
                                     tx=optax.adam(1e-3))
    module.fit(state, data, test, loss_fn=loss_fn, eval_step=eval_step, hooks=[hook],
               workdir=str(workdir), resume=resume, verbose=0, tensorboard=False, **options)
    return events


@pytest.mark.filterwarnings("ignore:fit. steps_per_jit=4 stacks")  # (the ragged last batch)
@pytest.mark.parametrize("options", [
    dict(batch_size=32, num_epochs=3, log_every=3, eval_every=7, ckpt_every=5, steps_per_jit=4),
    dict(batch_size=24, num_epochs=2, log_every=4, eval_freq=2, max_steps=17, steps_per_jit=3),
    dict(batch_size=48, num_epochs=4, log_every=5, ckpt_every=4, max_steps=19),
    dict(batch_size=32, num_epochs=3, log_every=7, ckpt_every=6, asks=True),
], ids=["steps_per_jit", "max_steps_with_groups", "max_steps", "hooks_ask"])
def test_logs_evals_and_saves_fall_on_the_steps_they_fell_on_before(
        options, digits, tmp_path, monkeypatch, one_device_mesh):
    # The loop now skips its bookkeeping until the next step at which something is due: every
    # event must still come at the step it came at before #28, also when a run is resumed and
    # when hooks ask for a save (at train_start) or a stop (at a save).
    old = fit_at(BEFORE, tmp_path, monkeypatch)
    x, y, xt, yt = digits
    data, test = (x[:400], y[:400]), (xt[:64], yt[:64])
    for name, module in (("old", old), ("new", fit_module)):
        first = _events(module, tmp_path / name, data, test, mesh=one_device_mesh, **options)
        more = dict(options, num_epochs=options["num_epochs"] + 1)  # resumed and extended
        if "max_steps" in options:
            more["max_steps"] = options["max_steps"] + 6
        again = _events(module, tmp_path / name, data, test, resume=True, mesh=one_device_mesh,
                        **more)
        if name == "old":
            expected = (first, again)
        else:
            assert (first, again) == expected
    assert {"log", "eval", "save"} <= {e for e, _ in expected[0]}
    assert options.get("asks") or {"log", "eval", "save"} <= {e for e, _ in expected[1]}


def _host_reads(monkeypatch, shapes):
    """Reads of a device array whose shape is one of `shapes` (the data's) to the host."""
    reads, cls = [], jax_array.ArrayImpl
    value, to_numpy = cls._value, cls.__array__

    def counted(fn):
        def wrapper(self, *args, **kwargs):
            if tuple(self.shape) in shapes:
                reads.append(self.shape)
            return fn(self, *args, **kwargs)
        return wrapper
    monkeypatch.setattr(cls, "_value", property(counted(value.fget)))
    monkeypatch.setattr(cls, "__array__", counted(to_numpy))
    # (#49) np.asarray reads through the buffer protocol, not __array__: fit's own calls counted
    # (orbax's, of the state's leaves at a save, may share a shape with the data's)
    asarray = np.asarray
    monkeypatch.setattr(np, "asarray", lambda a, *args, **kwargs: (
        isinstance(a, cls) and tuple(a.shape) in shapes and sys._getframe(1).f_globals.get(
            "__name__") == fit_module.__name__ and reads.append(a.shape),
        asarray(a, *args, **kwargs))[1])
    return reads


@pytest.mark.filterwarnings("ignore:fit. steps_per_jit=3 stacks")  # (13 batches an epoch)
def test_device_data_stays_on_the_device_and_trains_as_numpy_does(digits, tmp_path, monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    x, y, xt, yt = digits
    x, y, xt, yt = x[:300], y[:300], xt[:100], yt[:100]  # (300 / 24: a smaller last batch)
    batches = [(x[i:i + 24], y[i:i + 24]) for i in range(0, 300, 24)]
    common = dict(loss_fn=loss_fn, eval_step=eval_step, num_epochs=2, mesh=mesh, verbose=0,
                  log_every=5)
    on_host = {
        "arrays": fit(make_state(CNN()), (x, y), (xt, yt), batch_size=24,
                      workdir=str(tmp_path / "a"), **common),
        "loader": fit(make_state(CNN()), Loader(batches), Loader(batches[:3]),
                      workdir=str(tmp_path / "b"), **common),
        "stacked": fit(make_state(CNN()), Loader(batches), steps_per_jit=3,
                       workdir=str(tmp_path / "e"), **common)}
    shapes = {a.shape for a in (x, y, xt, yt)} | {a.shape for b in batches for a in b} | {
        (i, *a.shape[1:]) for a in (x, y) for i in (24, 12, 4)} | {  # (4: the eval's last)
        (3, *a.shape) for b in batches for a in b}  # (steps_per_jit=3's stacks)
    reads = _host_reads(monkeypatch, shapes)
    device = lambda tree: jax.tree.map(jnp.asarray, tree)  # (on jax's default device)
    on_device = {
        "arrays": fit(make_state(CNN()), device((x, y)), device((xt, yt)), batch_size=24,
                      workdir=str(tmp_path / "c"), **common),
        "loader": fit(make_state(CNN()), Loader(device(batches)), Loader(device(batches[:3])),
                      workdir=str(tmp_path / "d"), **common),
        "stacked": fit(make_state(CNN()), Loader(device(batches)), steps_per_jit=3,
                       workdir=str(tmp_path / "f"), **common)}
    assert reads == [], f"device data was read back to the host: {reads[:5]}"
    for form in on_host:
        (a, history_a), (b, history_b) = on_host[form], on_device[form]
        for u, v in zip(jax.tree.leaves(jax.device_get((a.params, a.batch_stats, a.opt_state))),
                        jax.tree.leaves(jax.device_get((b.params, b.batch_stats, b.opt_state)))):
            assert np.array_equal(u, v), form
        assert history_a.get("eval/accuracy") == history_b.get("eval/accuracy"), form


def _config_and_steps(platform, monkeypatch, mesh, digits):
    monkeypatch.setattr(fit_module, "_platform", lambda mesh: platform)
    monkeypatch.setattr(fit_module, "_STEPS", collections.OrderedDict())  # build afresh
    x, y, _, _ = digits
    opts = fit_module.Options(loss_fn=loss_fn, batch_size=32)
    state = fit_module._place_state(make_state(MLP()), 0, fit_module.NamedSharding(
        mesh, fit_module.P()))
    train = fit_module._Data((x[:64], y[:64]), "train_ds", opts, train=True)
    config = fit_module._StepConfig.of(opts, fit_module._linen_forward, None, mesh, linen=True)
    steps = fit_module._build_steps(state, train, None, config, mesh)
    batch = (x[:32], y[:32])
    hlo = steps.train.lower(state, steps.acc0, batch).compile().as_text()
    return config, " conditional(" in hlo  # (the op; names in its metadata say the word too)


def test_on_a_gpu_the_step_holds_no_conditional(monkeypatch, one_device_mesh, digits):
    # #28's rule (XLA's GPU runtime may read a conditional's predicate back and block the host
    # until the device is done): the GPU setting compiles no conditional into the step.
    config, conditional = _config_and_steps("gpu", monkeypatch, one_device_mesh, digits)
    assert config.norms_every_step
    assert not conditional
    # The CPU's compiled step (the same function, traced with the CPU's setting) is told apart.
    config, conditional = _config_and_steps("cpu", monkeypatch, one_device_mesh, digits)
    assert config.norms_every_step == ("cpu" in fit_module._NO_COND)
    assert conditional != config.norms_every_step


def test_fit_takes_the_setting_from_the_mesh_and_logs_the_same_norms(
        digits, tmp_path, monkeypatch, one_device_mesh):
    x, y, _, _ = digits
    logged = {}
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(fit_module, "_platform", lambda mesh: platform)
        monkeypatch.setattr(fit_module, "_STEPS", collections.OrderedDict())
        rows = logged[platform] = []
        hook = lambda event, run: "train/grad_norm" in run.metrics and rows.append(
            (run.step, run.metrics["train/grad_norm"], run.metrics["train/param_norm"]))
        fit(make_state(MLP()), (x[:320], y[:320]), loss_fn=loss_fn, batch_size=32, log_every=4,
            num_epochs=2, hooks=[hook], mesh=one_device_mesh, workdir=str(tmp_path / platform),
            verbose=0, tensorboard=False)
        (config, *_), = fit_module._STEPS
        assert config.norms_every_step == (platform in fit_module._NO_COND)
    assert [r[0] for r in logged["gpu"]] == [r[0] for r in logged["cpu"]] == list(range(4, 21, 4))
    np.testing.assert_allclose(np.array(logged["gpu"]), np.array(logged["cpu"]), rtol=1e-6)


def test_orbax_is_asked_about_saves_only_while_one_is_in_flight(
        digits, tmp_path, monkeypatch, one_device_mesh):
    # The wall-time schedule is decided at log points; asking orbax whether a save is still in
    # progress costs ~50 us, so it is asked only between a save and its commit. One save (the
    # last, after the loop; one epoch, whose best train/loss is saved with it): none during
    # training.
    asks = []
    real = fit_module.ocp.CheckpointManager.is_saving_in_progress
    monkeypatch.setattr(fit_module.ocp.CheckpointManager, "is_saving_in_progress",
                        lambda self: asks.append(1) or real(self))
    x, y, _, _ = digits
    before_save = []  # the asks made before the one save (orbax asks itself while it commits)
    hook = lambda event, run: event == "save" and before_save.append(len(asks))
    _, history = fit(make_state(MLP()), (x[:640], y[:640]), loss_fn=loss_fn, batch_size=32,
                     log_every=2, num_epochs=1, hooks=[hook], mesh=one_device_mesh,
                     workdir=str(tmp_path), verbose=0)
    assert history.timing["save_count"] == 1 and before_save == [0], (before_save, len(asks))


def test_the_bar_ends_at_the_last_step_though_log_points_are_drawn_at_most_every_0_1_s(
        digits, tmp_path, capsys, one_device_mesh):
    x, y, _, _ = digits
    fit(make_state(MLP()), (x[:640], y[:640]), loss_fn=loss_fn, batch_size=32, log_every=1,
        num_epochs=2, mesh=one_device_mesh, workdir=str(tmp_path), verbose=1)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "100%" in last and "40/40" in last and "epoch 2/2" in last, last


def test_on_one_device_numpy_batches_go_to_the_step_as_they_are(monkeypatch, one_device_mesh):
    # On an H100 a tiny-MLP batch took ~180 us of host time handed to jit as numpy, ~375 us put
    # with device_put first (the step then waits for the put's arrays): on any one device, fit
    # leaves the placing to jit, as on a CPU (benchmarks/README.md, "#28 on a GPU").
    batch = (np.zeros((4, 3), np.float32), np.zeros(4, np.int32))
    for platform in ("cpu", "gpu", "tpu"):
        monkeypatch.setattr(fit_module, "_platform", lambda mesh: platform)
        put = fit_module._putter(one_device_mesh, "data")
        assert put(batch) is batch and put(batch, True) is batch, platform
        # (#49) so does a jax.Array on that device already; one elsewhere is placed, all the batch
        there = (jax.device_put(jnp.zeros((4, 3)), one_device_mesh.devices.flat[0]), batch[1])
        assert put(there) is there, platform
        placed = put((jax.device_put(jnp.zeros((4, 3)), jax.devices()[1]), batch[1]))
        assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(placed)), platform
        assert {d for a in placed for d in a.devices()} == {one_device_mesh.devices.flat[0]}
