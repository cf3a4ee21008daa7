"""Child processes for tests/test_sweeps.py: several fit processes sharing one workdir.

    python tests/_sweep_child.py MODE WORKDIR LOG_NAME RESUME OUT_JSON

RESUME is `fresh` (resume=False) or `latest` (resume=True). MODE:

- `race`: imports, builds everything, writes `<WORKDIR>/ready/<pid>`, then polls every 1 ms for
  `<WORKDIR>/go` (the parent makes it once every child is ready), so that all children call fit
  within a few milliseconds of each other. `time.time()` just before fit goes to OUT_JSON.
- `hold`: at its first `log` event, a hook writes `<WORKDIR>/held` and waits (at most 120 s) for
  `<WORKDIR>/release`: the run is held inside training, its claim on the run taken.
- `kill`: once a checkpoint of the run is committed (a step directory in its ckpt_dir), a hook
  prints `CKPT <ckpt_dir>` and sleeps, for the parent to SIGKILL it there.

Every mode writes OUT_JSON (the run's name, directories, final step, pid, start time) when fit
returns. The parent gives the child `XLA_FLAGS=` (empty): one CPU device, which starts faster.
The model, data and options are `make_state`, `make_data` and `OPTIONS`, which the test also
uses in-process to resume or contend for the same runs.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's fit.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fit import TrainState, fit  # noqa: E402

BATCH, N_TRAIN = 16, 64  # 4 steps per epoch
OPTIONS = dict(batch_size=BATCH, log_every=1, verbose=0)


class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))


def make_state():
    model = Tiny()
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.float32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def make_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N_TRAIN, 8)).astype(np.float32),
            rng.integers(0, 4, N_TRAIN).astype(np.int32))


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    return os.path.exists(path)


def hold_hook(workdir):
    def hook(event, run):
        if event == "log" and not os.path.exists(os.path.join(workdir, "held")):
            with open(os.path.join(workdir, "held"), "w") as f:
                f.write(f"{run.step}")
            wait_for(os.path.join(workdir, "release"), 120)
    return hook


def kill_hook(event, run):
    if event == "log" and os.path.isdir(run.ckpt_dir) and any(
            d.isdigit() for d in os.listdir(run.ckpt_dir)):
        print("CKPT", run.ckpt_dir, flush=True)
        time.sleep(120)  # the parent kills it here


def main(mode, workdir, log_name, resume, out):
    state, data = make_state(), make_data()
    options = dict(OPTIONS, workdir=workdir, log_name=log_name, resume=resume == "latest",
                   num_epochs=int(os.environ.get("CHILD_EPOCHS", "1")))
    if mode == "hold":
        options["hooks"] = [hold_hook(workdir)]
    elif mode == "kill":
        options.update(hooks=[kill_hook], ckpt_every=2)
    elif mode == "race":
        os.makedirs(os.path.join(workdir, "ready"), exist_ok=True)
        open(os.path.join(workdir, "ready", str(os.getpid())), "w").close()
        if not wait_for(os.path.join(workdir, "go"), 300):
            sys.exit("no go file")
    start = time.time()
    state, history = fit(state, data, loss_fn=loss_fn, **options)
    with open(out, "w") as f:
        json.dump({"run": history.run, "log_dir": history.log_dir, "ckpt_dir": history.ckpt_dir,
                   "step": int(state.step), "pid": os.getpid(), "start": start}, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
