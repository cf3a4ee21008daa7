"""Child processes for tests/test_robust.py: runs that get killed, signalled or watched.

    python tests/_child.py MODE WORKDIR OUT_JSON

MODE is `kill` (the SIGKILL/resume run; `ema`, `accum`, `accum_outputs`: the same with fit.ema,
grad_accum=4, grad_accum=4 with grad_accum_mode="outputs"),
`sigterm` (a run the parent sends SIGTERM) or `flat`
(a long run that records its memory and compilations each epoch). Every launch of a mode runs
the same command with `resume=True`, so a relaunch after a kill picks the run up. The parent
gives the child `XLA_FLAGS=` (empty): one CPU device, which starts faster than eight.

The child talks to the parent on stdout, one line per event, flushed at once:
`READY` (imports done, about to call fit), `LOG <step>` / `EVAL <step>` / `EPOCH <step>` (from a
hook), `FETCH <epoch> <batch>` (sigterm mode: the data loader is handing out that batch). At the
end it writes OUT_JSON (history, final step) and, in kill mode, `final.npy` next to it.

sigterm mode reads CHILD_HOLD="epoch,batch" (hold that batch until WORKDIR/release exists) and
CHILD_CKPT_EVERY; flat mode reads CHILD_EPOCHS.
"""
import ctypes
import gc
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's fit.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fit as fit_module  # noqa: E402
from fit import TrainState, fit  # noqa: E402


def say(*parts):
    print(*parts, flush=True)


class MLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(4)(x)


def make_data(n_train, n_test, features=32, seed=0):
    """Four classes, each a Gaussian blob: learnable, so losses move."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(4, features)).astype(np.float32)
    y = rng.integers(0, 4, n_train + n_test).astype(np.int32)
    x = (centers[y] + rng.normal(size=(len(y), features))).astype(np.float32)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def make_state(hidden, features=32):
    model = MLP(hidden)
    params = model.init(jax.random.key(0), np.zeros((1, features), np.float32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def eval_step(state, batch):
    x, y = batch
    return (state.apply_fn({"params": state.params}, x, train=False).argmax(-1) == y).mean()


def progress_hook(event, run):
    """Tells the parent how far the run is; the kill test aims its kills with these lines."""
    if event in ("log", "eval", "epoch_end"):
        say({"log": "LOG", "eval": "EVAL", "epoch_end": "EPOCH"}[event], run.step)


def all_leaves(state):
    """Params, optimizer state and step as one float64 vector (exact for float32 and int32)."""
    leaves = jax.tree.leaves(jax.device_get((state.params, state.opt_state, state.step, state.rng)))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def history_json(history):
    return {k: v for k, v in history.items()}


def kill_mode(workdir, out, ema=False, **accum):
    # 20 batches of 32 per epoch, 4 epochs; a checkpoint every 3 steps and at each epoch end, an
    # eval each epoch, train logs every 2 steps. Array data: fit shuffles per (seed, epoch).
    # `ema`: the optimizer wrapped in fit.ema, evaluated beside the raw weights; `accum`: the
    # grad_accum options.
    x, y, xt, yt = make_data(640, 128)
    state = make_state(hidden=512)
    if ema:
        state = state.replace(tx=fit_module.ema(state.tx, decay=0.9))
        state = state.replace(opt_state=state.tx.init(state.params))
    say("READY")
    state, history = fit(state, (x, y), (xt, yt), loss_fn=loss_fn, eval_step=eval_step,
                         batch_size=32, num_epochs=4, ckpt_every=3, log_every=2, resume=True,
                         workdir=workdir, log_name="kill", hparams={"hidden": 512},
                         hooks=[progress_hook], **accum)
    np.save(os.path.join(os.path.dirname(out), "final.npy"), all_leaves(state))
    with open(out, "w") as f:
        json.dump({"history": history_json(history), "log_dir": history.log_dir,
                   "ckpt_dir": history.ckpt_dir, "step": int(state.step)}, f)


class Loader:
    """A re-iterable loader of 10 fixed batches that says which batch it hands out. At `hold`,
    an (epoch, batch) pair, it waits until the file `release` exists (at most 60 s), so the
    parent can act while fit is known to wait for that batch."""

    def __init__(self, batches, hold=None, release=None):
        self.batches, self.hold, self.release, self.epoch = batches, hold, release, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            say("FETCH", self.epoch, i)
            if (self.epoch, i) == self.hold:
                deadline = time.monotonic() + 60
                while not os.path.exists(self.release) and time.monotonic() < deadline:
                    time.sleep(0.02)
            yield batch


def sigterm_mode(workdir, out):
    x, y, _, _ = make_data(160, 0)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 160, 16)]
    state = make_state(hidden=64)
    say("READY")
    hold = tuple(map(int, os.environ["CHILD_HOLD"].split(","))) if os.environ.get("CHILD_HOLD") else None
    ckpt_every = int(os.environ["CHILD_CKPT_EVERY"]) if os.environ.get("CHILD_CKPT_EVERY") else None
    loader = Loader(batches, hold, os.path.join(workdir, "release"))
    state, history = fit(state, loader, None, loss_fn=loss_fn, num_epochs=3, log_every=1,
                         ckpt_every=ckpt_every, resume=True, workdir=workdir, log_name="term")
    with open(out, "w") as f:
        json.dump({"history": history_json(history), "step": int(state.step),
                   "ckpt_dir": history.ckpt_dir}, f)


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def usage(epoch, compiles):
    """This process's footprint now: resident memory after giving freed heap back to the OS
    (glibc keeps freed blocks of its per-thread arenas, so raw RSS swings by tens of MB with
    orbax's and XLA's threads), the JAX arrays alive, and the compilations so far."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    live = jax.live_arrays()
    return {"epoch": epoch, "rss_mb": rss_mb(), "compiles": len(compiles), "live_arrays": len(live),
            "live_bytes": sum(a.nbytes for a in live),
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


class RecordingLoader:
    """Re-iterable batches that record `usage` at the start of each epoch."""

    def __init__(self, batches, compiles):
        self.batches, self.compiles, self.epoch, self.records = batches, compiles, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        self.records.append(usage(self.epoch, self.compiles))
        return iter(self.batches)


def flat_mode(workdir, out):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    epochs = int(os.environ.get("CHILD_EPOCHS", "60"))
    x, y, xt, yt = make_data(160, 64)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 160, 16)]
    test = [(xt[i:i + 32], yt[i:i + 32]) for i in range(0, 64, 32)]
    loader = RecordingLoader(batches, compiles)
    state = make_state(hidden=256)
    say("READY")
    state, history = fit(state, loader, test, loss_fn=loss_fn, eval_step=eval_step,
                         num_epochs=epochs, log_every=5, ckpt_every=10, workdir=workdir,
                         log_name="flat")  # (a save every epoch, as a long run makes many)
    step = int(state.step)
    del state
    loader.records.append(usage(epochs, compiles))  # after fit returned, its state dropped
    with open(out, "w") as f:
        json.dump({"records": loader.records, "history": history_json(history),
                   "step": step, "ckpt_dir": history.ckpt_dir}, f)


if __name__ == "__main__":
    mode, workdir, out = sys.argv[1:4]
    {"kill": kill_mode, "ema": lambda w, o: kill_mode(w, o, ema=True),
     "accum": lambda w, o: kill_mode(w, o, grad_accum=4), "sigterm": sigterm_mode,
     "accum_outputs": lambda w, o: kill_mode(w, o, grad_accum=4, grad_accum_mode="outputs"),
     "flat": flat_mode}[mode](workdir, out)
