"""#32: the speed shown: examples/s, tokens/s, TFLOP/s and MFU at log points and in
history.timing; XLA's memory estimate of the compiled step before step 1; no extra compile."""
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fit as fit_module
from conftest import MLP, fit_at, loss_fn, make_state
from fit import TrainState, Weighted, fit

COMPILES = []  # backend compiles, while a test counts them
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)

COMMON = dict(verbose=0, tensorboard=False, log_every=5)


class Logs:
    """A log hook keeping every log point's perf/ metrics."""

    def __init__(self):
        self.perf = []

    def __call__(self, event, run):
        if event == "log":
            self.perf.append({k: v for k, v in run.metrics.items() if k.startswith("perf/")})


def batches(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, n).astype(np.int32)) for n in sizes]


def calls(sizes, epochs, k):
    """The (steps, rows, shape) of each call fit makes: groups of k batches of one size starting at
    multiples of k (of the step), the others alone (fit's steps_per_jit)."""
    out, step = [], 0
    for _ in range(epochs):
        i = 0
        while i < len(sizes):
            group = sizes[i:i + k]
            if k > 1 and step % k == 0 and len(group) == k and len(set(group)) == 1:
                out.append((k, k * group[0], (k, group[0])))
                i, step = i + k, step + k
            else:
                out.append((1, sizes[i], (1, sizes[i])))
                i, step = i + 1, step + 1
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_examples_per_s_is_the_steady_calls_rows_over_the_steady_time(k, tmp_path,
                                                                       one_device_mesh):
    sizes = [32] * 8 + [16] * 5 + [8]  # two batch sizes (buckets) and a ragged last batch
    logs = Logs()
    _, history = fit(make_state(MLP()), batches(sizes), loss_fn=loss_fn, num_epochs=3,
                     steps_per_jit=k, mesh=one_device_mesh, workdir=str(tmp_path), hooks=[logs],
                     **COMMON)
    made, seen = calls(sizes, 3, k), set()
    steady_steps = steady_rows = 0
    for steps, rows, shape in made:
        if shape in seen:  # the first call of each shape compiles, timed apart
            steady_steps, steady_rows = steady_steps + steps, steady_rows + rows
        seen.add(shape)
    timing = history.timing
    assert timing["steps"] == sum(s for s, _, _ in made)
    assert timing["compile_count"] == len(seen)
    # Both rates share the steady time: their ratio is the steady calls' rows per step.
    assert timing["examples_per_s"] / timing["steady_steps_per_s"] == pytest.approx(
        steady_rows / steady_steps, rel=1e-9)
    assert all("perf/examples_per_s" in p for p in logs.perf[1:]), logs.perf


class Dense(nn.Module):
    """A pure dense MLP: FLOPs per example ~ 6 x parameters (forward 2, backward 4)."""

    @nn.compact
    def __call__(self, x, train):
        x = x.reshape(x.shape[0], -1)
        for width in (512, 512):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


@pytest.mark.parametrize("case", ["one step", "steps_per_jit=4", "steps_per_jit=4, unrolled",
                                  "grad_accum=4", "2 devices"])
def test_tflops_per_s_counts_every_step_per_device(case, tmp_path, monkeypatch):
    rows, devices = 256, 2 if case == "2 devices" else 1
    options = {"steps_per_jit=4": {"steps_per_jit": 4}, "grad_accum=4": {"grad_accum": 4},
               "steps_per_jit=4, unrolled": {"steps_per_jit": 4}}
    # (#49: k steps a call are a rolled scan, whose body XLA counts once, but where the step has
    # convolutions on a CPU: this Dense model's scan is rolled, unless `_unrolled` says otherwise)
    if case.endswith("unrolled"):
        monkeypatch.setattr(fit_module, "_unrolled", lambda lowered: True)
    state = make_state(Dense(), optax.sgd(0.01))
    params = sum(x.size for x in jax.tree.leaves(state.params))
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    _, history = fit(state, batches([rows] * 8), loss_fn=loss_fn, num_epochs=3, mesh=mesh,
                     workdir=str(tmp_path), **options.get(case, {}), **COMMON)
    timing = history.timing
    per_step = timing["tflops_per_s"] * 1e12 / timing["steady_steps_per_s"]
    print(case, "XLA's FLOPs per step / 6 x parameters x rows:", per_step / (6 * params * rows / devices))
    assert per_step == pytest.approx(6 * params * rows / devices, rel=0.15), (
        per_step / (6 * params * rows / devices))
    assert "mfu" not in timing  # a CPU has no known peak


def test_mfu_is_over_the_given_peak_and_known_chips_have_theirs(tmp_path, one_device_mesh):
    _, history = fit(make_state(MLP()), batches([32] * 6), loss_fn=loss_fn, num_epochs=2,
                     peak_tflops=0.5, mesh=one_device_mesh, workdir=str(tmp_path), **COMMON)
    assert history.timing["mfu"] == pytest.approx(history.timing["tflops_per_s"] / 0.5)
    peak = fit_module._peak_tflops
    assert peak("NVIDIA H100 80GB HBM3") == 989.0 and peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA A100-SXM4-80GB") == 312.0 and peak("NVIDIA L40S") == 362.0
    assert peak("TPU v5 lite") == 197.0 and peak("TPU v5") == 459.0 and peak("TPU v4") == 275.0
    assert peak("cpu") is None
    with pytest.raises(ValueError, match="peak_tflops must be a positive number"):
        fit(make_state(MLP()), batches([32]), loss_fn=loss_fn, peak_tflops=0,
            workdir=str(tmp_path))


def masked_loss(logits, targets):
    labels, mask = targets
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return Weighted((losses * mask).sum(), mask.sum())


@pytest.mark.parametrize("devices", [1, 2])
def test_tokens_per_s_is_the_weighted_losss_weights_per_step_times_steps_per_s(tmp_path, devices):
    """On 2 devices with `axis_name` (the step per device): all devices' tokens, not their mean."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    options = {"axis_name": "data"} if devices > 1 else {}
    rng = np.random.default_rng(1)
    real = [int(t) for t in rng.integers(4, 32, 12)]  # the real (unmasked) rows of each batch
    data = [(x, (y, (np.arange(32) < t).astype(np.float32)))
            for (x, y), t in zip(batches([32] * 12), real)]
    logs = Logs()
    _, history = fit(make_state(MLP()), data, loss_fn=masked_loss, num_epochs=2, mesh=mesh,
                     workdir=str(tmp_path), hooks=[logs], **options, **COMMON)
    timing = history.timing
    assert timing["tokens_per_s"] == pytest.approx(
        np.mean(real) * timing["steady_steps_per_s"], rel=1e-6)
    assert all("perf/tokens_per_s" in p for p in logs.perf[1:]), logs.perf
    # A plain mean loss has no tokens to count.
    _, plain = fit(make_state(MLP()), batches([32] * 4), loss_fn=loss_fn, num_epochs=2,
                   mesh=mesh, workdir=str(tmp_path / "plain"), **COMMON)
    assert "tokens_per_s" not in plain.timing and "examples_per_s" in plain.timing


def test_the_memory_estimate_comes_before_step_1_and_memory_gb_is_absent_on_cpu(
        tmp_path, one_device_mesh, capfd):
    seen = []

    def hook(event, run):
        seen.append((event, dict(run.metrics or {})))
    _, history = fit(make_state(MLP()), batches([32] * 12), loss_fn=loss_fn, num_epochs=1,
                     mesh=one_device_mesh, workdir=str(tmp_path), hooks=[hook],
                     **{**COMMON, "verbose": 2})
    out = capfd.readouterr().out
    start, estimate = out.index("fit: starting run"), out.index("fit: the compiled train step")
    assert start < estimate < out.index("epoch 1/1"), out
    timing = history.timing
    for part in ("argument", "output", "temp"):
        assert timing[f"step_{part}_bytes"] >= 0
    assert timing["step_argument_bytes"] > sum(
        x.nbytes for x in jax.tree.leaves(make_state(MLP()).params))  # params, their moments, ...
    assert "memory_gb" not in timing
    assert not any("perf/memory_gb" in m for _, m in seen)


def test_a_run_compiles_no_more_than_before(tmp_path, monkeypatch):
    """Compiling ahead to read XLA's estimates reuses the executable: the backend compiles of a run
    are those of the file before #32 (jax's caches cleared before each)."""
    before = fit_at("14010dd", tmp_path, monkeypatch)
    counts = []
    for module in (before, fit_module):
        jax.clear_caches()
        module._STEPS.clear()
        del COMPILES[:]
        state = module.TrainState.create(apply_fn=MLP().apply, tx=optax.adam(1e-3), params=jax.tree.map(
            np.asarray, make_state(MLP()).params))
        module.fit(state, batches([32] * 8 + [16] * 3), batches([32] * 2 + [8]), loss_fn=loss_fn,
                   num_epochs=2, steps_per_jit=2, workdir=str(tmp_path / module.__name__),
                   **COMMON)
        counts.append(len(COMPILES))
    print("compiles before, after:", counts)
    assert counts[1] <= counts[0], counts
    assert counts[0] > 3  # (the listener sees them)
