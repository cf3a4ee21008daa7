"""One process of a run whose workdir is in a bucket, for tests/test_store.py.

    python tests/_store_child.py MODE WORKDIR OUTDIR [PROCESS_ID NUM_PROCESSES PORT]

The parent starts the storage server and passes its address in the environment (the variables
google-cloud-storage, gcsfs and tensorstore read: STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL,
GOOGLE_AUTH_TOKEN_FOR_TESTING), and STORE_LEASE_S, which this child puts in `fit._LEASE_S` so a
killed run's lock runs out in seconds, not a minute.

MODE:
- `run`: a small MLP on 256 fixed examples, batch 16 (16 steps an epoch), 3 epochs, a checkpoint
  every 4 steps, train logs every 2 steps, resume=True (so a relaunch after a kill goes on). It
  prints `LOG <step>` at each log point, flushed, for the parent to aim its kill. At the end it
  writes OUTDIR/final.npy (params, optimizer state, step, rng as one float64 vector) and
  OUTDIR/out.json (history, log_dir, ckpt_dir).
- `multi`: the same run on NUM_PROCESSES processes joined by jax.distributed over
  127.0.0.1:PORT with gloo (2 CPU devices each, set by the parent); every process passes the same
  arrays (fit takes each one's share); OUTDIR/final<PROCESS_ID>.npy and out<PROCESS_ID>.json.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's fit.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fit as fit_module  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


def make_state():
    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.float32), train=False)["params"]
    return fit_module.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def make_data(n=256):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def all_leaves(state):
    leaves = jax.tree.leaves(jax.device_get((state.params, state.opt_state, state.step, state.rng)))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def progress(event, run):
    if event == "log":
        print("LOG", run.step, flush=True)


def main():
    mode, workdir, outdir = sys.argv[1:4]
    suffix = ""
    if mode == "multi":
        pid, nproc, port = map(int, sys.argv[4:7])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
        suffix = str(pid)
    fit_module._LEASE_S = float(os.environ.get("STORE_LEASE_S", fit_module._LEASE_S))
    state, history = fit_module.fit(
        make_state(), make_data(), None, loss_fn=loss_fn, batch_size=16, num_epochs=3,
        ckpt_every=4, log_every=2, resume=True, workdir=workdir, log_name="store", verbose=0,
        hooks=[progress])
    np.save(os.path.join(outdir, f"final{suffix}.npy"), all_leaves(state))
    with open(os.path.join(outdir, f"out{suffix}.json"), "w") as f:
        json.dump({"history": dict(history), "log_dir": history.log_dir,
                   "ckpt_dir": history.ckpt_dir, "run": history.run}, f)


if __name__ == "__main__":
    main()
