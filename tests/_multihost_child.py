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

Data scenarios (#40; `run_data_scenario`): in the array ones every process passes the SAME
arrays (x, y), 99 examples whose targets are their indices (the class is index % 4), with the
global batch_size=16 (6 batches of 16 and a last one of 3, which 2 processes cannot split), to
an MLP without BatchNorm; the loss reports which examples each global batch holds
(`indexed_loss`), and a hook records them at every step (`steps` in the JSON: step, then
`FINGERPRINT`'s metrics). The array runs also carry `EarlyStopping(patience=100, min_delta=10)`
on `train/accuracy` (so every epoch after the first adds 1 to its count, and it never stops);
`es` in the JSON is its `get_state()` at the end.
- `arrays`:  3 epochs of 7 steps, log_every=1, ckpt_every=8.
- `arrays_cut`: the same, ended by os._exit (as a crash) at the log point after step 16's
             checkpoint has committed (mid-epoch 3); prints `KILL <step>` first.
- `arrays_resume`: resume=True in `WORKDIR/arrays_cut`, once the parent has put a killed
             `arrays_cut` run there and written `WORKDIR/arrays_cut/READY` (the child waits); on
             any process count.
- `old_way`: the pre-#40 way, each process its own rows `x[:96][pid::nproc]` with a per-process
             batch_size=8: must be refused by every process. Its error is recorded and the child
             goes on (every process raises it at the same place, before any work).
- `grain`:   grain's DataLoader over the first 96 examples, sharded by process
             (`ShardByJaxProcess`), reshuffled each epoch, 6 batches of 8 rows per process
             (global batches of 16); 2 epochs, log_every=1, ckpt_every=4. The JSON's `reads`:
             the examples this process read.
- `grain_cut`: the same, ended by os._exit after step 8's checkpoint committed (mid-epoch 2).
- `grain_resume`: resume=True in `WORKDIR/grain_cut` (waits for its READY, as above).
- `grain_one`: the same resume in one process (batches of 16: the same global batching), which
             must be refused (the loaders' positions are per process); recorded, the child goes
             on.

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
import time
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


# -- Data scenarios (#40): the same arrays on every process; a grain loader sharded by process --

ROWS = 99  # 6 global batches of 16, then one of 3 (which 2 processes cannot split: each takes all)
FINGERPRINT = ("idmean", "idsq", "head", "together", "unique")
DATA_SCENARIOS = {"arrays", "arrays_cut", "arrays_resume", "old_way", "grain", "grain_cut",
                  "grain_resume", "grain_one"}
REFUSED = {"old_way", "grain_one"}  # refused alike on every process at the start: go on after
RESUMES = {"arrays_resume": "arrays_cut", "grain_resume": "grain_cut", "grain_one": "grain_cut"}


def indexed_arrays():
    """x: `global_batches`' kind of blobs; y: each example's index (its class: index % CLASSES)."""
    rng = np.random.default_rng(3)
    centers = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    y = np.arange(ROWS, dtype=np.int32)
    x = (centers[y % CLASSES] + 1.5 * rng.normal(size=(ROWS, FEATURES))).astype(np.float32)
    return x, y


class MLP(nn.Module):
    """No BatchNorm (a bias feeding one has no true gradient: layouts would differ by noise)."""

    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(32)(x)))


def mlp_state():
    from fit import TrainState
    var = MLP().init(jax.random.key(0), np.zeros((1, FEATURES), np.float32), train=False)
    return TrainState.create(apply_fn=MLP().apply, params=var["params"], tx=optax.sgd(0.1))


def indexed_loss(logits, ids):
    """Cross-entropy on the classes, and which examples the (global) batch holds, by their
    indices: mean `idmean`, mean square `idsq`, `head` the mean of the first half's (process 0's
    share on 2 processes), `together` the fraction whose partner (2j <-> 2j+1) is there too,
    `unique` the fraction there once."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, ids % CLASSES).mean()
    f = ids.astype(np.float32)
    same = ids[:, None] == ids[None, :]
    return loss, {"accuracy": (logits.argmax(-1) == ids % CLASSES).mean(), "idmean": f.mean(),
                  "idsq": (f * f).mean(), "head": f[:max(len(ids) // 2, 1)].mean(),
                  "together": (ids[:, None] == (ids ^ 1)[None, :]).any(1).mean(),
                  "unique": (same.sum(1) == 1).mean()}


def recorder(steps):
    """A hook that appends [step, *FINGERPRINT] at every log point (log_every=1: every step)."""
    def record(event, run):
        if event == "log":
            steps.append([run.step] + [run.metrics[f"train/{k}"] for k in FINGERPRINT])
    return record


def exit_after_commit(saved):
    """A hook that ends the process as a crash would (os._exit: no cleanup, no checkpoint) at the
    first log point after step `saved`, once that step's checkpoint has committed: orbax saves in
    the background and renames its temporary folder to `<ckpt_dir>/<saved>` when all processes
    have written. Each process waits for that on the shared filesystem and prints `KILL <step>`;
    process 0 goes first (its exit may take the others down: it runs JAX's coordination
    service), the others once it has written `<workdir>/KILLED`."""
    def hook(event, run):
        if event == "log" and run.step > saved:
            path, deadline = os.path.join(run.ckpt_dir, str(saved)), time.monotonic() + 60
            first = os.path.join(os.path.dirname(os.path.dirname(run.ckpt_dir)), "KILLED")
            while not os.path.isdir(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            while jax.process_index() and not os.path.exists(first) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            print("KILL", run.step, flush=True)
            if jax.process_index() == 0:
                open(first, "w").close()
            os._exit(0 if os.path.isdir(path) else 3)
    return hook


class Rows:
    """A grain random-access source of examples as dicts; a stable repr (grain's set_state
    compares the source's repr with the one it saved); `reads` counts the examples read."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, 0

    def __len__(self):
        return len(self.x)

    def __repr__(self):
        return f"Rows({len(self.x)})"

    def __getitem__(self, i):
        self.reads += 1
        return {"x": self.x[i], "y": self.y[i]}


class ShardedLoader:
    """grain's DataLoader over this process's shard of the source (`ShardByJaxProcess`),
    reshuffled each epoch (fit's `set_epoch` picks the sampler's seed); `iter()` returns grain's
    iterator, whose `get_state()` fit saves as this process's position."""

    def __init__(self, source, batch):
        self.source, self.batch, self.epoch = source, batch, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.source) // jax.process_count() // self.batch

    def __iter__(self):
        import grain.python as grain
        sampler = grain.IndexSampler(num_records=len(self.source), shuffle=True, seed=self.epoch,
                                     num_epochs=1,
                                     shard_options=grain.ShardByJaxProcess(drop_remainder=True))
        return iter(grain.DataLoader(
            data_source=self.source, sampler=sampler, worker_count=0,
            operations=[grain.Batch(self.batch, drop_remainder=True)],
            read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def run_data_scenario(scenario, pid, nproc, workdir, outdir, writers):
    """One of DATA_SCENARIOS (see the module docstring); the same JSON and npy as run_scenario,
    plus `steps` (the FINGERPRINT of every step), for arrays `es` (EarlyStopping's state), for
    grain `reads` (the examples this process read)."""
    from fit import EarlyStopping, fit
    result = {"pid": os.getpid(), "process_index": jax.process_index(),
              "process_count": jax.process_count(), "devices": jax.device_count()}
    steps = result["steps"] = []
    here = os.path.join(workdir, RESUMES.get(scenario, scenario))
    try:
        while scenario in RESUMES and not os.path.exists(os.path.join(here, "READY")):
            time.sleep(0.2)  # (the parent copies the killed run here, then writes READY)
        x, y = indexed_arrays()
        kw = dict(loss_fn=indexed_loss, num_epochs=2, log_every=1, workdir=here, log_name="mh",
                  hooks=[progress, recorder(steps)], resume=scenario in RESUMES)
        if scenario.startswith("grain"):
            kw.update(ckpt_every=4, batch_keys=("x", "y"))
            source = Rows(x[:96], y[:96])
            train = ShardedLoader(source, 96 // 6 // jax.process_count())
        else:
            es = EarlyStopping(patience=100, min_delta=10.0, restore_best=False)
            kw.update(num_epochs=3, ckpt_every=8, batch_size=16, monitor="train/accuracy",
                      mode="max", hooks=kw["hooks"] + [es])
            train = (x, y)
        if scenario == "old_way":  # each process its own rows and batch: refused since #40
            train, kw["batch_size"] = (x[:96][pid::nproc], y[:96][pid::nproc]), 16 // nproc
        if scenario.endswith("_cut"):
            kw["hooks"] = kw["hooks"] + [exit_after_commit(8 if scenario == "grain_cut" else 16)]
        state, history = fit(mlp_state(), train, **kw)
        if scenario.startswith("grain"):
            result["reads"] = source.reads  # (this process's examples, read by fit or ahead)
        else:
            result["es"] = es.get_state()
        result.update(run=history.run, ckpt_dir=history.ckpt_dir,
                      step=int(jax.device_get(state.step)),
                      history={k: v for k, v in history.items()})
        np.save(os.path.join(outdir, f"{scenario}_{pid}.npy"), flat(state))
    except BaseException as e:
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "traceback": traceback.format_exc()}
        if scenario not in REFUSED:
            raise
    finally:
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
        run = run_data_scenario if scenario in DATA_SCENARIOS else run_scenario
        run(scenario, pid, nproc, workdir, outdir, writers)


if __name__ == "__main__":
    scenarios, pid, nproc, port, workdir, outdir = sys.argv[1:7]
    main(scenarios.split(","), int(pid), int(nproc), int(port), workdir, outdir)
