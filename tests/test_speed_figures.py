"""#41, items 4 and 5: the check before saves compiles beside the first step (off its path), and
every perf figure of a log point covers the same steps, the first log point's too."""
import threading

import jax
import numpy as np
import optax
import pytest

import fit as fit_module
from conftest import CNN, make_state, loss_fn
from fit import fit

COMPILES = []  # (thread name) of each backend compile, while a test counts them
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: COMPILES.append(threading.current_thread().name)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def _data(steps, rows=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * rows, 8, 8, 1)).astype(np.float32)
    return x, (np.arange(steps * rows) % 10).astype(np.int32)


def test_every_log_point_counts_the_rows_and_flops_of_its_own_steps(tmp_path, one_device_mesh):
    # The case: a CNN, 64 rows a step. Before #41 the first log point's rows and FLOPs
    # counted one call more than its steady steps (examples/s over steps/s came to 65.29, not 64):
    # they are summed as calls are dispatched, one call past the log point.
    logged = []
    hook = lambda event, run: event == "log" and logged.append(dict(run.metrics))
    state = make_state(CNN(), optax.sgd(0.01))
    fit(state, _data(24), loss_fn=loss_fn, batch_size=64, log_every=6, mesh=one_device_mesh,
        workdir=str(tmp_path), verbose=0, tensorboard=False, hooks=[hook])
    # The step's FLOPs, from XLA's cost analysis of the compiled step, independently of fit's clock.
    opts = fit_module.Options(loss_fn=loss_fn, batch_size=64)
    placed = fit_module._place_state(state, 0, fit_module.NamedSharding(one_device_mesh,
                                                                          fit_module.P()))
    train = fit_module._Data(_data(1), "train_ds", opts, train=True)
    config = fit_module._StepConfig.of(opts, fit_module._linen_forward, None, one_device_mesh,
                                       linen=True)
    steps = fit_module._build_steps(placed, train, None, config, one_device_mesh)
    cost = steps.train.lower(placed, steps.acc0, _data(1)).compile().cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert [m for m in logged if "perf/steps_per_s" in m], logged
    for m in logged:  # every log point with a rate, the first one included
        if "perf/steps_per_s" not in m:
            continue
        rate = m["perf/steps_per_s"]
        assert m["perf/examples_per_s"] / rate == pytest.approx(64, rel=1e-6), m
        assert m["perf/tflops_per_s"] * 1e12 / rate == pytest.approx(flops, rel=1e-6), m


def test_the_first_call_compiles_the_step_and_the_check_beside_it(tmp_path, one_device_mesh):
    # The check of the state before saves (`_param_norm`) compiles in a thread of its own while
    # the first step compiles on the main thread (on another core): off the first step's path.
    # It is compiled once, there: the first save finds it ready (no compile at the save).
    jax.clear_caches()
    fit_module._STEPS.clear()
    saves = []

    def at_save(event, run):
        if event == "save":
            saves.append(len(COMPILES))
    del COMPILES[:]
    fit(make_state(CNN()), _data(4), loss_fn=loss_fn, batch_size=64, mesh=one_device_mesh,
        workdir=str(tmp_path), verbose=0, tensorboard=False, hooks=[at_save])
    apart = [name for name in COMPILES if name != threading.main_thread().name]
    assert len(apart) == 1, COMPILES  # the check's, beside the step
    assert saves and COMPILES[saves[0]:] == [], COMPILES  # nothing compiled at the save
