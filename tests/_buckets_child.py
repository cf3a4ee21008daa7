"""One process of a two-process run for tests/test_buckets.py, where process 1 feeds a batch of
another length than process 0's at one step.

    python tests/_buckets_child.py PROCESS_ID PORT WORKDIR OUTDIR

Joins JAX's distributed runtime over 127.0.0.1:PORT with gloo CPU collectives (one CPU device
a process, from the parent's XLA_FLAGS). Both processes feed token batches of lengths 8, 16, 8, 16, ... (4 rows each, its share
of a global batch of 8), except that process 1's third batch has length 16 where process 0's has
8. The first log point is step 3, right after that batch. Writes
`OUTDIR/result_<pid>.json`: the exception's type and message (or none) and the last step logged.
"""
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's fit.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


class Bag(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.Dense(4)(nn.Embed(32, 16)(x).mean(1))


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(pid, port, workdir, outdir):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from fit import TrainState, fit
    lengths = [8, 16] * 4
    if pid == 1:
        lengths[2] = 16  # step 3: process 0 feeds length 8, process 1 length 16
    rng = np.random.default_rng(pid)
    train = []
    for n in lengths:
        x = rng.integers(1, 32, (4, n)).astype(np.int32)
        train.append((x, (x[:, 0] % 4).astype(np.int32)))
    model = Bag()
    params = model.init(jax.random.key(0), np.zeros((1, 8), np.int32), train=False)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    result = {"error": None, "last_log": None}

    def note(event, run):
        if event == "log":
            result["last_log"] = run.step

    try:
        fit(state, train, loss_fn=loss_fn, num_epochs=2, log_every=3, hooks=[note], verbose=0,
            tensorboard=False, workdir=workdir, log_name="buckets")
    except BaseException as e:
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "traceback": traceback.format_exc()}
        raise
    finally:
        with open(os.path.join(outdir, f"result_{pid}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
