"""One process of a multi-process run, for tests/test_multihost.py.

    python tests/_multihost_child.py SCENARIOS PROCESS_ID NUM_PROCESSES PORT WORKDIR OUTDIR

With NUM_PROCESSES > 1 the child joins JAX's distributed runtime over 127.0.0.1:PORT with gloo
CPU collectives (the parent sets XLA_FLAGS to 2 simulated devices per process); with 1 it is the
single-process reference (the parent gives it all 4 devices). Every process builds the same
*global* batches and feeds fit its own share: process i of n takes rows [i*b/n, (i+1)*b/n) of
each global batch of b rows, so 2 processes x 2 devices see exactly what 1 process x 4 devices
sees.

SCENARIOS is a comma-separated list, run one after the other in this process (one import and
one `jax.distributed.initialize` for all of them), each with its own workdir `WORKDIR/<name>`
(shared by the processes, as on a cluster's shared filesystem):
- `even`:    8 global train batches of 16, 3 eval batches of 16; 2 epochs, an eval each epoch.
- `resume`:  the same data with steps_per_jit=2; a first fit stops at max_steps=5 (mid-epoch),
             a second one (resume=True) restores it and finishes.
- `ragged`:  as `even`, plus a smaller last global batch of 6 (3 rows per process) in train
             and eval.
- `small`:   global batches of 4 on 4 devices: 2 rows per process, 1 per device.
- `fewer`:   process 1 has one train batch fewer than process 0 (must fail clearly, not hang).
- `shape`:   process 1's local batches have 4 rows where process 0's have 8 (must fail clearly).
- `preempt`: a long run (500 epochs, steps_per_jit=2), to be stopped by a signal the parent
             sends; `preempt_local` the same, with JAX's preemption service off (for the group).
- `hookstop`: a long run that a hook on process 1 alone stops, at its log point of step 4.
- `locked`:  a resume of run `mh_1`, whose lock another writer holds (process 0 takes it first,
             as "host test, pid 4242"): every process must raise the refusal process 0 got.
- `python_metric`: `even`'s data for 3 epochs, monitored by `eval_metrics={"shifted": fn}`, fn
             computed in Python on this process's own eval rows: their accuracy + 0.01 *
             process_index (so the processes' own values differ); every process must record
             and rank by process 0's. The child adds `computed` (the values its fn returned)
             and `bests` (`run.best` after each eval) to its JSON.

Per scenario the child writes `OUTDIR/<name>_<pid>.json` (run names and dirs, this process's
pid, how many SummaryWriters it opened, the final step, the history, or the exception's type
and message) and `OUTDIR/<name>_<pid>.npy` (final params and batch_stats as one float64
vector). On stdout it prints `LOG <step>` at each log point, `END <step>` at train_end and
`DONE <name>` after each scenario. After an exception it stops: the processes may no longer
agree on what comes next.
"""
import fcntl
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's fit.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

FEATURES, CLASSES, GLOBAL_BATCH = 16, 4, 16


class Net(nn.Module):
    """Dense -> BatchNorm -> Dropout -> Dense: batch statistics and dropout both have to be
    global (over the whole global batch, keyed the same everywhere) for the runs to agree."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x)


def make_state():
    from fit import TrainState
    model = Net()
    var = model.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32), train=False)
    return TrainState.create(apply_fn=model.apply, params=var["params"],
                             batch_stats=var["batch_stats"], tx=optax.sgd(0.1))


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


def eval_step(state, batch):
    x, y = batch
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, x, train=False)
    return {"accuracy": (logits.argmax(-1) == y).mean(),
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()}


def global_batches(sizes, seed):
    """Global batches of the given sizes: four Gaussian blobs, learnable but not at once."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    out = []
    for n in sizes:
        y = rng.integers(0, CLASSES, n).astype(np.int32)
        x = (centers[y] + 1.5 * rng.normal(size=(n, FEATURES))).astype(np.float32)
        out.append((x, y))
    return out


def share(batches, pid, nproc):
    """Process `pid`'s rows of each global batch."""
    return [tuple(a[len(a) * pid // nproc:len(a) * (pid + 1) // nproc] for a in b) for b in batches]


def data(scenario, pid, nproc):
    train_sizes, test_sizes = [GLOBAL_BATCH] * 8, [GLOBAL_BATCH] * 3
    if scenario == "ragged":
        train_sizes, test_sizes = train_sizes + [6], test_sizes + [6]
    if scenario == "small":
        train_sizes, test_sizes = [4] * 8, [4] * 3
    train = share(global_batches(train_sizes, 1), pid, nproc)
    test = share(global_batches(test_sizes, 2), pid, nproc)
    if scenario == "fewer" and pid == 1:
        train = train[:-1]
    if scenario == "shape" and pid == 1:
        train = [tuple(a[:4] for a in b) for b in train]
    return train, test


def progress(event, run):
    """Tells the parent how far the run is (stdout, one line per event, flushed at once)."""
    if event in ("log", "train_end"):
        print("LOG" if event == "log" else "END", run.step, flush=True)


def stop_on_process_1(event, run):
    if event == "log" and run.step >= 4 and jax.process_index() == 1:
        run.stop = True


def flat(state):
    leaves = jax.tree.leaves(jax.device_get((state.params, state.batch_stats)))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def run_scenario(scenario, pid, nproc, workdir, outdir, writers):
    from fit import fit
    result = {"pid": os.getpid(), "process_index": jax.process_index(),
              "process_count": jax.process_count(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count()}
    opened = len(writers)
    try:
        train, test = data(scenario, pid, nproc)
        kw = dict(loss_fn=loss_fn, eval_step=eval_step, num_epochs=2, log_every=3, hooks=[progress],
                  workdir=os.path.join(workdir, scenario), log_name="mh", hparams={"scenario": scenario})
        if scenario.startswith("preempt"):
            kw.update(num_epochs=500, log_every=2, steps_per_jit=2)  # (step jumps by 2)
        if scenario == "hookstop":
            kw.update(num_epochs=500, log_every=1, hooks=[progress, stop_on_process_1])
        if scenario == "locked" and pid == 0:  # (held until this process exits)
            run_dir = os.path.join(workdir, scenario, "checkpoints", "mh_1")
            os.makedirs(run_dir, exist_ok=True)
            result["holder"] = open(os.path.join(run_dir, "fit.lock"), "a+")
            fcntl.flock(result["holder"], fcntl.LOCK_EX | fcntl.LOCK_NB)
            result["holder"].write("host test, pid 4242")
            result["holder"].flush()
        if scenario == "locked":
            kw["resume"] = "mh_1"
        if scenario == "python_metric":
            computed = result["computed"] = []  # (this process's own values)
            bests = result["bests"] = []

            def shifted(state, batches):  # (the replicated params read on this host)
                params, stats = jax.device_get((state.params, state.batch_stats))
                hits = [np.asarray(Net().apply({"params": params, "batch_stats": stats}, x,
                                               train=False)).argmax(-1) == y for x, y in batches]
                computed.append(float(np.concatenate(hits).mean()) + 0.01 * jax.process_index())
                return computed[-1]

            def best_after_eval(event, run):
                if event == "eval":
                    bests.append(run.best)
            kw.update(num_epochs=3, eval_metrics={"shifted": shifted}, monitor="eval/shifted",
                      mode="max", hooks=[progress, best_after_eval])
        if scenario == "resume":
            kw.update(steps_per_jit=2)
            _, first = fit(make_state(), train, test, max_steps=5, **kw)
            result["first_run"] = first.run
            kw["resume"] = True
        state, history = fit(make_state(), train, test, **kw)
        result.update(run=history.run, log_dir=history.log_dir, ckpt_dir=history.ckpt_dir,
                      step=int(jax.device_get(state.step)),
                      history={k: v for k, v in history.items()})
        np.save(os.path.join(outdir, f"{scenario}_{pid}.npy"), flat(state))
    except BaseException as e:
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "traceback": traceback.format_exc()}
        raise
    finally:
        result["writers_opened"] = len(writers) - opened
        result.pop("holder", None)
        with open(os.path.join(outdir, f"{scenario}_{pid}.json"), "w") as f:
            json.dump(result, f)
        print("DONE", scenario, flush=True)


def main(scenarios, pid, nproc, port, workdir, outdir):
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if any(s.endswith("_local") for s in scenarios):
            jax.config.update("jax_enable_preemption_service", False)
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                                   initialization_timeout=120)
    import fit

    writers = []  # every SummaryWriter this process opens: only process 0 may open one

    class CountingWriter(fit.SummaryWriter):
        def __init__(self, *args, **kwargs):
            writers.append(args[0] if args else kwargs.get("logdir"))
            super().__init__(*args, **kwargs)

    fit.SummaryWriter = CountingWriter
    for scenario in scenarios:
        run_scenario(scenario, pid, nproc, workdir, outdir, writers)


if __name__ == "__main__":
    scenarios, pid, nproc, port, workdir, outdir = sys.argv[1:7]
    main(scenarios.split(","), int(pid), int(nproc), int(port), workdir, outdir)
