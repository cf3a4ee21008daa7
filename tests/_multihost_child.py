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

FSDP scenarios (#42; `run_fsdp_scenario`): an nnx model whose base weights are annotated
`nnx.with_partitioning(init, ("fsdp", "tp"))` (the embedding's `("tp", "fsdp")`), with a LoRA
adapter, trained by `nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)` on a masked
token loss (`token_loss`, a `fit.Weighted`: the global batch's sum over its count); the model
and the optimizer are built under `jax.set_mesh(mesh)`. Two meshes of ("data", "fsdp", "tp")
over the 4 devices (`fsdp_mesh`), each with 'fsdp' across the processes (on 2 processes,
`mesh.devices[:, i, :]` are process i's; on 1 process the same shapes over its 4 devices):
mesh A (1, 2, 2), 'tp' within each process; mesh B (2, 2, 1), 'data' within each process.
- `fsdp_list`: mesh A, batch_axes=("data", "fsdp"): a list of 4 global batches of 6 token rows
             (3 per process: 6 splits over the 2 batch shards, not over the 4 devices), an eval
             list of 2; 2 epochs, log_every=2.
- `fsdp_arrays`: mesh A, batch_axes=("fsdp",): the same arrays (tokens, targets) of 22 rows
             on every process, the global batch_size=6 (3 batches of 6, then one of 4).
- `fsdp_odd_list`: mesh B, batch_axes=("fsdp", "data"): a list of local batches of 3 rows, which
             do not split over this process's 2 batch shards; must be refused alike on every
             process, before any step (recorded; the child goes on).
- `fsdp_odd_arrays`: mesh B, batch_axes=("fsdp", "data"), arrays with batch_size=6 (divisible by
             the 2 processes, not by the 4 batch shards): refused alike, recorded, the child goes
             on.
Their JSON adds `mesh_processes` (`mesh.devices` as process indices), `kernel_spec` and
`kernel_addressable` (the base kernel's PartitionSpec after the run, and whether this process
holds all of it), `events` (the hook events seen: none for a refused run) and `placed` (each
distinct [PartitionSpec, this process's shape, the global shape] of the arrays fit made with
`jax.make_array_from_process_local_data`: its batches, on several processes); their npy holds
the final LoRA adapters (replicated: this process's copy).

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


# -- FSDP scenarios (#42): batch_axes over a mesh whose 'fsdp' axis spans the processes --------

FSDP_SCENARIOS = {"fsdp_list", "fsdp_arrays", "fsdp_odd_list", "fsdp_odd_arrays"}
FSDP_REFUSED = {"fsdp_odd_list", "fsdp_odd_arrays"}  # refused alike at the start: go on after
VOCAB, WIDTH, SEQ = 32, 16, 8


def fsdp_mesh(kind):
    """Mesh A (1, 2, 2) or B (2, 2, 1) of ("data", "fsdp", "tp"): 'fsdp' index i holds process
    i's devices (on 2 processes), the other axis of size 2 runs over a process's own devices."""
    from jax.sharding import Mesh
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    by_process = devices.reshape(2, 2)  # [fsdp, the process's own devices]
    grid = by_process.reshape(1, 2, 2) if kind == "A" else by_process.T.reshape(2, 2, 1)
    return Mesh(grid, ("data", "fsdp", "tp"))


def fsdp_model(mesh):
    from flax import nnx

    class Tagger(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.emb = nnx.Embed(VOCAB, WIDTH, rngs=rngs, embedding_init=nnx.with_partitioning(
                nnx.initializers.normal(), ("tp", "fsdp")))
            self.q = nnx.Linear(WIDTH, WIDTH, rngs=rngs,
                                kernel_init=nnx.with_partitioning(init, ("fsdp", "tp")))
            self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, ("fsdp", "tp")))
            self.lq = nnx.LoRA(WIDTH, 4, WIDTH, rngs=rngs)

        def __call__(self, tokens):
            h = self.emb(tokens)
            h = h + nnx.relu(self.q(h) + self.lq(h))
            return self.out(h)

    with jax.set_mesh(mesh):
        model = Tagger(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    return model, optimizer


def token_loss(logits, targets):
    """Cross-entropy summed over the counted tokens (targets >= 0), over their count."""
    from fit import Weighted
    mask = (targets >= 0).astype(logits.dtype)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets * (targets >= 0))
    return Weighted((ce * mask).sum(), mask.sum())


def token_rows(n, seed):
    """n rows of SEQ tokens; the targets the next token (a fixed shift), ~20% of them -1 (not
    counted)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    y = np.where(rng.random((n, SEQ)) > 0.2, (x + 1) % VOCAB, -1).astype(np.int32)
    return x, y


def token_batches(count, size, seed, pid, nproc):
    """`count` global batches of `size` rows; this process's share of each."""
    x, y = token_rows(count * size, seed)
    lo, hi = size * pid // nproc, size * (pid + 1) // nproc
    return [(x[i + lo:i + hi], y[i + lo:i + hi]) for i in range(0, count * size, size)]


def run_fsdp_scenario(scenario, pid, nproc, workdir, outdir, writers):
    """One of FSDP_SCENARIOS (see the module docstring); the same JSON and npy as run_scenario."""
    from flax import nnx
    from fit import fit
    result = {"pid": os.getpid(), "process_index": jax.process_index(),
              "process_count": jax.process_count(), "devices": jax.device_count()}
    events = result["events"] = []
    try:
        mesh = fsdp_mesh("A" if scenario in ("fsdp_list", "fsdp_arrays") else "B")
        result["mesh_processes"] = [[[d.process_index for d in row] for row in plane]
                                    for plane in mesh.devices]
        model, optimizer = fsdp_model(mesh)
        kw = dict(optimizer=optimizer, loss_fn=token_loss, mesh=mesh, num_epochs=2, log_every=2,
                  hooks=[progress, lambda event, run: events.append(event)],
                  workdir=os.path.join(workdir, scenario), log_name="mh", verbose=0)
        test = None
        if scenario == "fsdp_list":
            kw["batch_axes"] = ("data", "fsdp")
            train = token_batches(4, 6, 5, pid, nproc)
            test = token_batches(2, 6, 6, pid, nproc)
        elif scenario == "fsdp_arrays":
            kw.update(batch_axes=("fsdp",), batch_size=6)
            train = token_rows(22, 7)
        elif scenario == "fsdp_odd_list":
            kw["batch_axes"] = ("fsdp", "data")
            train = token_batches(4, 3 * nproc, 5, pid, nproc)  # (3 rows on each process)
        else:
            kw.update(batch_axes=("fsdp", "data"), batch_size=6)
            train = token_rows(22, 7)
        make = jax.make_array_from_process_local_data
        placed = result["placed"] = []

        def recording(sharding, data, *args, **kwargs):  # (fit's put on several processes)
            out = make(sharding, data, *args, **kwargs)
            seen = [[list(a) if isinstance(a, tuple) else a for a in sharding.spec],
                    list(np.shape(data)), list(out.shape)]
            if seen not in placed:
                placed.append(seen)
            return out

        jax.make_array_from_process_local_data = recording
        try:
            _, history = fit(model, train, test, **kw)
        finally:
            jax.make_array_from_process_local_data = make
        kernel = model.q.kernel.value
        result.update(run=history.run, step=history["step"][-1],
                      kernel_spec=[list(a) if isinstance(a, tuple) else a
                                   for a in kernel.sharding.spec],
                      kernel_addressable=kernel.is_fully_addressable,
                      history={k: v for k, v in history.items()})
        adapters = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))
        np.save(os.path.join(outdir, f"{scenario}_{pid}.npy"), np.concatenate(
            [np.ravel(np.asarray(a.addressable_data(0), np.float64)) for a in adapters]))
    except BaseException as e:
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "traceback": traceback.format_exc()}
        if scenario not in FSDP_REFUSED:
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
        run = (run_data_scenario if scenario in DATA_SCENARIOS else run_fsdp_scenario
               if scenario in FSDP_SCENARIOS else run_scenario)
        run(scenario, pid, nproc, workdir, outdir, writers)


if __name__ == "__main__":
    scenarios, pid, nproc, port, workdir, outdir = sys.argv[1:7]
    main(scenarios.split(","), int(pid), int(nproc), int(port), workdir, outdir)
