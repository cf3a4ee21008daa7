"""What a user sees in TensorBoard: a real `tensorboard` server, started on a run's logs and asked
through its HTTP API (the same JSON its web pages load) for the runs, the scalar tags and
values, and the HParams dashboard's session, whose hparams and final metrics must belong to the
run itself (not to a separate sub-run, tensorboardX's `add_hparams` default)."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, eval_step, loss_fn, make_state

from fit import fit

HPARAMS = {"lr": 1e-3, "layers": [1, 2]}
STATUSES = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorboard_command(logdir, port):
    """The tensorboard next to this Python (the venv's), else its module."""
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    cmd = [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "tensorboard.main"]
    return cmd + ["--logdir", logdir, "--host", "127.0.0.1", "--port", str(port)]


class Server:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path):
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path, body):
        request = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def session_groups(self, metric_tags):
        return self.post("/data/plugin/hparams/session_groups", {
            "experimentName": "", "allowedStatuses": STATUSES, "startIndex": 0, "sliceSize": 100,
            "colParams": [{"metric": {"group": "", "tag": t}} for t in metric_tags]})["sessionGroups"]


def wait_for(what, fn, process, log_path, timeout=60):
    """Polls `fn` until it returns something true; fails with the server's log otherwise."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            value = fn()
            if value:
                return value
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = e
        time.sleep(1)
    with open(log_path) as f:
        log = f.read()[-3000:]
    pytest.fail(f"tensorboard did not show {what} within {timeout} s (exit code "
                f"{process.poll()}, last error {last!r}); its log:\n{log}")


@pytest.mark.slow
def test_tensorboard_server_shows_scalars_and_hparams_of_the_run(digits, tmp_path):
    x, y, xt, yt = digits
    _, history = fit(make_state(MLP(), optax.adam(1e-2)), (x, y), (xt, yt), loss_fn=loss_fn,
                     eval_step=eval_step, batch_size=32, num_epochs=2, log_every=10,
                     workdir=str(tmp_path), log_name="tb", hparams=HPARAMS)
    run = history.run
    assert run == "tb_1" and history.log_dir == str(tmp_path / "logs" / run)

    port, log_path = free_port(), tmp_path / "tensorboard.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(tensorboard_command(str(tmp_path / "logs"), port),
                                   stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        server = Server(port)
        # 1. The run, alone: no hparams sub-run beside it.
        runs = wait_for(f"the run {run}", lambda: server.get("/data/runs"), process, log_path)
        assert runs == [run], runs

        # 2. Its scalar tags, and eval/accuracy's values at the eval steps.
        tags = wait_for("the scalar tags", lambda: server.get("/data/plugin/scalars/tags").get(run),
                        process, log_path)
        for tag in ("train/loss", "train/accuracy", "train/grad_norm", "eval/accuracy",
                    "best/eval/accuracy", "perf/steps_per_s"):
            assert tag in tags, sorted(tags)
        points = server.get(f"/data/plugin/scalars/scalars?run={run}&tag=eval/accuracy")
        assert [p[1] for p in points] == history["eval/step"] == [45, 90]
        np.testing.assert_allclose([p[2] for p in points], history["eval/accuracy"], atol=1e-6)

        # 3. The HParams dashboard: the hparams fit used, and the metrics it lists.
        experiment = server.post("/data/plugin/hparams/experiment", {"experimentName": ""})
        names = {h["name"] for h in experiment["hparamInfos"]}
        assert {"lr", "layers", "num_epochs", "batch_size", "seed", "devices",
                "steps_per_epoch", "monitor"} <= names, sorted(names)
        metric_tags = [m["name"]["tag"] for m in experiment["metricInfos"]]
        assert {"train/loss", "eval/accuracy", "best/eval/accuracy"} <= set(metric_tags), metric_tags

        # 4. One session group, named after the run itself, with the final metric values.
        groups = wait_for("the hparams session's metrics",
                          lambda: [g for g in server.session_groups(metric_tags) if g["metricValues"]],
                          process, log_path)
        assert [g["name"] for g in groups] == [run], [g["name"] for g in groups]
        group = groups[0]
        assert [s["name"] for s in group["sessions"]] == [run]
        hp = group["hparams"]
        assert hp["lr"] == pytest.approx(1e-3) and hp["layers"] == "[1, 2]", hp
        assert (hp["num_epochs"], hp["batch_size"], hp["seed"]) == (2, 32, 0), hp
        assert (hp["devices"], hp["steps_per_epoch"]) == (jax.device_count(), 45), hp
        assert hp["monitor"] == "eval/accuracy", hp
        values = {m["name"]["tag"]: m for m in group["metricValues"]}
        final = values["eval/accuracy"]
        assert final["trainingStep"] == 90
        assert abs(final["value"] - history["eval/accuracy"][-1]) < 1e-6, (final, history["eval/accuracy"])
        assert values["best/eval/accuracy"]["value"] == pytest.approx(max(history["eval/accuracy"]), abs=1e-6)
        assert values["train/loss"]["trainingStep"] == 90
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
