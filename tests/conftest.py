"""Shared test fixtures. Every test process sees 8 simulated CPU devices (set before jax is
imported); tests that need one device pass `mesh=one_device_mesh`."""
import importlib.util
import logging
import os
import re
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from fit import TrainState  # noqa: E402


class CNN(nn.Module):
    """A small CNN with BatchNorm and Dropout, sized for 8x8 digits."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2)).reshape(x.shape[0], -1)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


class MLP(nn.Module):
    """No BatchNorm, no Dropout: batch_stats stays empty."""

    @nn.compact
    def __call__(self, x, train):
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def nnx_mlp(seed=0):
    """A small nnx MLP for 8x8 digits (64 -> 16 -> 10), no BatchNorm, no Dropout."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 16, rngs=rngs), nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x.reshape(x.shape[0], -1))))
    return Net(nnx.Rngs(seed))


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits as (x_train, y_train, x_test, y_test); 1440 / 357."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images[..., None] / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    return x[:1440], y[:1440], x[1440:], y[1440:]


def make_state(model=None, tx=None, seed=0):
    model = model or CNN()
    var = model.init(jax.random.key(seed), np.zeros((1, 8, 8, 1), np.float32), train=False)
    return TrainState.create(apply_fn=model.apply, params=var["params"],
                             batch_stats=var.get("batch_stats", {}),
                             tx=tx or optax.adam(1e-3))


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


def eval_step(state, batch):
    x, y = batch
    variables = {"params": state.params}
    if state.batch_stats:
        variables["batch_stats"] = state.batch_stats
    logits = state.apply_fn(variables, x, train=False)
    return (logits.argmax(-1) == y).mean()


def flat(tree):
    """All leaves of a tree as one float64 numpy vector, for comparisons."""
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(jax.device_get(tree))])


@pytest.fixture
def one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


@pytest.fixture
def eight_device_mesh():
    assert len(jax.devices()) == 8, "conftest sets 8 simulated devices before jax is imported"
    return Mesh(np.array(jax.devices()), ("data",))


class CompileLog(logging.Handler):
    """The 'Compiling jit(<name>)' lines of jax.log_compiles."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def shapes(self, name="_train_and_accumulate"):
        return [m for m in self.messages if re.match(rf"Compiling jit\({name}\)", m)]

    def count(self, name="_train_and_accumulate"):
        return len(self.shapes(name))


@pytest.fixture
def compile_log():
    handler = CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield handler
    finally:
        logger.removeHandler(handler)


def nnx_arrays(model, optimizer):
    """Every array an nnx run's result depends on (keys as raw data), by path."""
    from flax import nnx
    out = {}
    for name, node in (("model", model), ("opt", optimizer)):
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.as_pure(nnx.state(node))):
            x = jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            out[name + jax.tree_util.keystr(path)] = np.asarray(jax.device_get(x))
    return out


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (
            k, np.max(np.abs(a[k] - b[k])))


def fit_at(commit, tmp_path, monkeypatch):
    """fit.py as of `commit` (from this checkout's git history), imported as `fit_<commit>`: to
    write checkpoints with an older file and resume them with this one. Skips without history."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        source = subprocess.run(["git", "-C", root, "show", f"{commit}:fit.py"], check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"fit.py at {commit} is not in this checkout's git history")
    path = tmp_path / f"fit_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"fit_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look it up)
    spec.loader.exec_module(module)
    return module
