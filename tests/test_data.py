"""Every kind of data fit.py takes, each trained end to end. The docstrings double as a how-to:
what to pass, and the least user code that turns a data library's output into batches.

fit reads data in three ways (see `_Data` in fit.py):
- arrays `(x, y)` with `batch_size=`: fit batches and reshuffles them every epoch;
- a re-iterable (a list, a loader): iterated once per epoch, `set_epoch(epoch)` called first when
  it has one, and an iterator with `get_state`/`set_state` (grain) saved in each checkpoint, so
  `resume=True` continues mid-epoch exactly where the run stopped;
- a one-shot iterator (a generator): one stream, cut into epochs by `steps_per_epoch`.
Dict batches need `batch_keys=(inputs_key, targets_key)`.

Optional libraries (tensorflow, grain, torch) skip their tests when missing."""
import os
import signal

import jax
import numpy as np
import optax
import pytest
from conftest import CNN, MLP, eval_step, flat, loss_fn, make_state

from fit import TrainState, fit

BATCH = 32


def checked(history, steps, epochs=1):
    """The run took `steps` steps in `epochs` epochs, and its losses are finite."""
    assert history["epoch"] == list(range(1, epochs + 1)), history["epoch"]
    assert history["step"][-1] == steps, history["step"]
    assert np.all(np.isfinite(history["train/loss"])), history["train/loss"]
    return history


def learned(history):
    """Eval accuracy on the held-out digits well above chance (0.1), and a falling loss."""
    assert history["eval/accuracy"][-1] > 0.5, history["eval/accuracy"]
    if len(history["train/loss"]) > 1:
        assert history["train/loss"][-1] < history["train/loss"][0], history["train/loss"]


def mlp_state(shape=(8, 8, 1)):
    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, *shape), np.float32), train=False)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def run(tmp_path, train_ds, test_ds=None, state=None, **kw):
    """Trains conftest's MLP (Adam, lr 1e-2) with conftest's loss_fn and eval_step."""
    return fit(state or mlp_state(), train_ds, test_ds, loss_fn=loss_fn,
               eval_step=eval_step if test_ds is not None else None,
               workdir=str(tmp_path), **kw)


# ----------------------------------------------------------------------------------------------
# 1. In-memory data

def test_numpy_arrays_with_batch_size(digits, tmp_path, one_device_mesh):
    """Arrays: `fit(state, (x, y), (x_test, y_test), batch_size=32, ...)`. An epoch is
    ceil(n / batch_size) steps (1440 / 32 = 45)."""
    x, y, xt, yt = digits
    _, h = run(tmp_path, (x, y), (xt, yt), batch_size=BATCH, num_epochs=2, mesh=one_device_mesh)
    learned(checked(h, 90, epochs=2))


def test_list_of_batches(digits, tmp_path, one_device_mesh):
    """A list of `(inputs, targets)` batches is re-iterable: the same batches every epoch. The
    last batch may be smaller (1440 = 44 * 32 + 32 here; 357 test examples leave 5)."""
    x, y, xt, yt = digits
    train = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    test = [(xt[i:i + BATCH], yt[i:i + BATCH]) for i in range(0, len(xt), BATCH)]
    _, h = run(tmp_path, train, test, num_epochs=2, mesh=one_device_mesh)
    learned(checked(h, 2 * len(train), epochs=2))


# ----------------------------------------------------------------------------------------------
# 2. Generators: one-shot streams

def test_generator_is_one_epoch(digits, tmp_path, one_device_mesh):
    """A generator can be read once, so without `steps_per_epoch` it is exactly one epoch."""
    x, y, xt, yt = digits
    stream = ((x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH))
    _, h = run(tmp_path, stream, (xt, yt), batch_size=BATCH, num_epochs=1, mesh=one_device_mesh)
    learned(checked(h, 45))


def test_infinite_generator_with_steps_per_epoch(digits, tmp_path, one_device_mesh):
    """An endless generator (sampling with replacement, augmenting on the fly, ...) is cut
    into epochs of `steps_per_epoch` batches: here 3 epochs of 20 steps."""
    x, y, xt, yt = digits

    def forever(seed=0):
        rng = np.random.default_rng(seed)
        while True:
            idx = rng.integers(0, len(x), BATCH)
            yield x[idx], y[idx]

    _, h = run(tmp_path, forever(), (xt, yt), batch_size=BATCH, steps_per_epoch=20,
               num_epochs=3, mesh=one_device_mesh)
    checked(h, 60, epochs=3)
    assert h["step"] == [20, 40, 60]
    learned(h)


# ----------------------------------------------------------------------------------------------
# 3. tensorflow_datasets

class SourceBatches:
    """Dict batches `{"image", "label"}` from any random-access source (`len(source)`,
    `source[i]` -> one example dict), e.g. `tfds.data_source("mnist", split="train")`, which
    needs no TensorFlow. Reshuffled every epoch from `(seed, epoch)`: fit calls `set_epoch`.

    (`source.__getitems__(indices)` reads a batch in one call on a real data source; under
    `tfds.testing.mock_data` it fails with "missing 1 required positional argument:
    'record_keys'" (tfds 4.9.10), so this reads one example at a time.)"""

    def __init__(self, source, batch_size, seed=0):
        self.source, self.batch_size, self.seed, self.epoch = source, batch_size, seed, 0
        self.epochs_seen = []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.epochs_seen.append(epoch)

    def __len__(self):
        return len(self.source) // self.batch_size  # drop the remainder: one batch shape

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.source))
        for b in range(len(self)):
            examples = [self.source[int(i)] for i in order[b * self.batch_size:(b + 1) * self.batch_size]]
            yield {"image": np.stack([e["image"] for e in examples]).astype(np.float32) / 255.0,
                   "label": np.array([e["label"] for e in examples], np.int32)}


def test_tfds_data_source(tmp_path, one_device_mesh):
    """`tfds.data_source("mnist", split=...)` (random examples with MNIST's features under
    `tfds.testing.mock_data`, so no download) wrapped in `SourceBatches`, with
    `batch_keys=("image", "label")`. fit takes `len()` as the epoch length."""
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=96):
        train = SourceBatches(tfds.data_source("mnist", split="train"), BATCH)
        test = SourceBatches(tfds.data_source("mnist", split="test"), BATCH)
        _, h = run(tmp_path, train, test, state=mlp_state((28, 28, 1)), num_epochs=2,
                   batch_keys=("image", "label"), mesh=one_device_mesh)
    checked(h, 6, epochs=2)
    assert train.epochs_seen == [0, 1], "fit calls set_epoch before every epoch"
    assert len(h["eval/accuracy"]) == 2  # random labels: nothing to learn, only to run


def test_tfds_as_numpy(tmp_path, one_device_mesh):
    """`tfds.as_numpy(tfds.load(..., batch_size=32))` yields dict batches of numpy arrays.
    Both `tfds.load` and `tfds.as_numpy` import TensorFlow (even for plain numpy input), so this
    skips without it; `tfds.data_source` above does not need it."""
    tfds = pytest.importorskip("tensorflow_datasets")
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        pytest.skip("tfds.as_numpy and tfds.load need TensorFlow (ModuleNotFoundError: No module "
                    "named 'tensorflow' in tensorflow-datasets 4.9.10); use tfds.data_source")
    with tfds.testing.mock_data(num_examples=96):
        def batches(split):
            ds = tfds.load("mnist", split=split, batch_size=BATCH, shuffle_files=False)
            return tfds.as_numpy(ds.map(lambda e: {"image": tensorflow.cast(e["image"], "float32") / 255.0,
                                                   "label": tensorflow.cast(e["label"], "int32")}))
        _, h = run(tmp_path, batches("train"), batches("test"), state=mlp_state((28, 28, 1)), num_epochs=2,
                   batch_keys=("image", "label"), mesh=one_device_mesh)
    checked(h, 6, epochs=2)


# ----------------------------------------------------------------------------------------------
# 4. grain: a loader whose iterator saves its position in fit's checkpoints

class Digits:
    """A grain random-access source (`__len__`, `__getitem__`) of the digits as example dicts.
    It needs a stable `__repr__`: grain stores the source's repr in the iterator state and
    `set_state` refuses another ("DataSource in checkpoint does not match datasource in
    dataloader"), which the default `<... object at 0x...>` never matches after a restart.
    `reads` counts examples read; `interrupt_at` sends SIGINT (Ctrl-C) once, as that many
    examples have been read in total."""

    def __init__(self, x, y, interrupt_at=None):
        self.x, self.y, self.reads, self.interrupt_at = x, y, 0, interrupt_at

    def __len__(self):
        return len(self.x)

    def __repr__(self):  # grain checks it on set_state: the default repr holds an address
        return f"Digits({len(self.x)})"

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        return {"image": self.x[i], "label": self.y[i]}


class GrainLoader:
    """grain's `DataLoader` reshuffled every epoch: fit calls `set_epoch(epoch)`, which picks
    the sampler's seed `(seed, epoch)`. `iter()` returns grain's own iterator, with
    `get_state`/`set_state`, which fit saves with every checkpoint.

    (A bare `DataLoader` works too, but gives every epoch the same order: each `iter()` starts
    the sampler's epoch 0 again. A sampler with `num_epochs=None` plus fit's `steps_per_epoch`
    would instead read one endless stream.)"""

    def __init__(self, source, batch_size, seed=0, shuffle=True):
        import grain.python as grain
        self.grain, self.source, self.batch_size, self.seed, self.shuffle = grain, source, batch_size, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.source) // self.batch_size

    def __iter__(self):
        grain = self.grain
        sampler = grain.IndexSampler(num_records=len(self.source), shuffle=self.shuffle,
                                     seed=self.seed * 1000 + self.epoch, num_epochs=1,
                                     shard_options=grain.NoSharding())
        # Data in memory: no reader threads (grain's advice), which also keeps reads in step
        # with training, so the tests can count them.
        loader = grain.DataLoader(data_source=self.source, sampler=sampler, worker_count=0,
                                  operations=[grain.Batch(self.batch_size, drop_remainder=True)],
                                  read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        return iter(loader)


def test_grain_dataloader_runs_and_learns(digits, tmp_path, one_device_mesh):
    """grain's DataLoader (IndexSampler(shuffle=True, seed), Batch) yields dict batches:
    `batch_keys=("image", "label")`. 1440 // 32 = 45 steps per epoch."""
    pytest.importorskip("grain")
    x, y, xt, yt = digits
    _, h = run(tmp_path, GrainLoader(Digits(x, y), BATCH), (xt, yt), batch_size=BATCH,
               num_epochs=2, batch_keys=("image", "label"), mesh=one_device_mesh)
    learned(checked(h, 90, epochs=2))


def test_grain_iterator_state_round_trips_through_a_checkpoint():
    """What fit relies on: grain's iterator gives its position with `get_state()` and goes back
    to it with `set_state()`. (Its state is `bytes` holding JSON, not a dict.)"""
    pytest.importorskip("grain")
    x = np.arange(40, dtype=np.float32)[:, None]
    it = iter(GrainLoader(Digits(x, np.arange(40)), 4))
    next(it), next(it)
    state = it.get_state()
    assert isinstance(state, bytes), type(state)
    expected = next(it)["label"]
    again = iter(GrainLoader(Digits(x, np.arange(40)), 4))
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["label"], expected)


def test_grain_resumes_exactly_inside_the_first_epoch(digits, tmp_path, one_device_mesh):
    """Epoch 1 goes on from the iterator fit read the first batch from, and its positions (grain's
    `get_state()` before each batch) go into the checkpoints like any other epoch's: a run cut by
    `max_steps` at step 20 of 45 and resumed ends bit for bit where an uninterrupted run does,
    reading only the batches it had not trained on (plus the one fit reads up front)."""
    pytest.importorskip("grain")
    x, y, xt, yt = digits
    common = dict(num_epochs=2, batch_keys=("image", "label"), mesh=one_device_mesh, log_every=5)
    ref, _ = run(tmp_path / "ref", GrainLoader(Digits(x, y), BATCH), **common)
    _, h1 = run(tmp_path / "cut", GrainLoader(Digits(x, y), BATCH), max_steps=20, **common)
    assert h1["step"] == [20]
    source = Digits(x, y)
    resumed, h2 = run(tmp_path / "cut", GrainLoader(source, BATCH), resume=True, **common)
    assert h2["step"] == [20, 45, 90], h2["step"]  # (the cut run logged its partial epoch)
    assert np.array_equal(flat(resumed.params), flat(ref.params))
    assert np.array_equal(flat(resumed.opt_state), flat(ref.opt_state))
    assert source.reads <= (90 - 20 + 1) * BATCH, source.reads


@pytest.mark.slow  # three CNN runs
def test_grain_dataloader_resumes_mid_epoch_exactly(digits, tmp_path, one_device_mesh):
    """Ctrl-C mid-epoch, then `resume=True`: the same parameters, bit for bit, as a run never
    stopped, and the resumed run does not re-read the batches trained before the stop (grain's
    iterator state, saved in the checkpoint, is restored with `set_state`)."""
    pytest.importorskip("grain")
    x, y, xt, yt = digits
    common = dict(loss_fn=loss_fn, eval_step=eval_step, num_epochs=2, batch_keys=("image", "label"),
                  mesh=one_device_mesh, log_every=5)
    ref, _ = fit(make_state(CNN()), GrainLoader(Digits(x, y), BATCH), [(xt, yt)],
                 workdir=str(tmp_path / "ref"), **common)
    # SIGINT as epoch 2's 11th batch is read.
    ctrl_c = Digits(x, y, interrupt_at=(45 + 11) * BATCH)
    _, h1 = fit(make_state(CNN()), GrainLoader(ctrl_c, BATCH), [(xt, yt)],
                workdir=str(tmp_path / "cut"), **common)
    stop_step = int(h1["stopped"][0].split()[-1])
    assert h1["stopped"] == [f"SIGINT at step {stop_step}"] and 45 < stop_step < 90, h1["stopped"]
    source = Digits(x, y)
    resumed, h2 = fit(make_state(CNN()), GrainLoader(source, BATCH), [(xt, yt)], resume=True,
                      workdir=str(tmp_path / "cut"), **common)
    assert h2["step"] == [45, 90]
    assert np.array_equal(flat(resumed.params), flat(ref.params))
    assert np.array_equal(flat(resumed.batch_stats), flat(ref.batch_stats))
    assert np.array_equal(flat(resumed.opt_state), flat(ref.opt_state))
    # Only the rest of epoch 2 was read (plus the batch fit reads up front), not the batches
    # trained on before the stop.
    assert source.reads <= (90 - stop_step + 1) * BATCH, (source.reads, stop_step)


@pytest.mark.slow  # three CNN runs
def test_grain_map_dataset_resumes_mid_epoch_exactly(digits, tmp_path, one_device_mesh):
    """grain's MapDataset API: `MapDataset.source(src).shuffle(seed).batch(32)` is
    re-iterable with `len()`, and its iterator's state is a dict, which fit saves as JSON.
    A run cut by `max_steps` mid-epoch, resumed with `resume=True`, ends with the same
    parameters, bit for bit, as an uninterrupted run, without re-reading the trained batches."""
    grain = pytest.importorskip("grain.python")
    x, y, xt, yt = digits

    class Epochs:
        """Reshuffled every epoch: fit calls set_epoch."""

        def __init__(self, source):
            self.source, self.epoch = source, 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return len(self.source) // BATCH

        def __iter__(self):
            ds = grain.MapDataset.source(self.source).shuffle(seed=self.epoch).batch(BATCH, drop_remainder=True)
            # No read-ahead threads, so the test can count the examples read.
            return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    common = dict(loss_fn=loss_fn, eval_step=eval_step, num_epochs=2, batch_keys=("image", "label"),
                  mesh=one_device_mesh, log_every=5)
    ref, _ = fit(make_state(CNN()), Epochs(Digits(x, y)), [(xt, yt)], workdir=str(tmp_path / "ref"), **common)
    cut = str(tmp_path / "cut")
    _, h1 = fit(make_state(CNN()), Epochs(Digits(x, y)), [(xt, yt)], workdir=cut,
                max_steps=57, **common)
    assert h1["step"] == [45, 57]  # epoch 1, then the partial epoch 2 that max_steps ended
    source = Digits(x, y)
    resumed, h2 = fit(make_state(CNN()), Epochs(source), [(xt, yt)], workdir=cut, resume=True, **common)
    assert h2["step"][-1] == 90
    assert np.array_equal(flat(resumed.params), flat(ref.params))
    assert np.array_equal(flat(resumed.batch_stats), flat(ref.batch_stats))
    # The batches after step 57, plus the first batch fit reads up front to learn the shapes.
    assert source.reads <= (90 - 57 + 1) * BATCH, ("the resumed run re-read batches it had "
                                                   f"trained on: {source.reads} examples read")


# ----------------------------------------------------------------------------------------------
# 5. torch-style loaders

class FakeTensor:
    """Not a numpy array, but converts with `__array__`, like a torch tensor."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


class FakeTorchLoader:
    """A torch-style loader: re-iterable, `len()`, `(inputs, targets)` tensor batches,
    reshuffled on every `iter()` like `DataLoader(shuffle=True)`."""

    def __init__(self, x, y, batch_size, seed=0):
        self.x, self.y, self.batch_size, self.rng = x, y, batch_size, np.random.default_rng(seed)

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __iter__(self):
        order = self.rng.permutation(len(self.x))
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield FakeTensor(self.x[idx]), FakeTensor(self.y[idx])


def test_torch_style_loader_without_torch(digits, tmp_path, one_device_mesh):
    """Anything whose batches convert with `np.asarray` (objects with `__array__`) works; fit
    converts each batch on the host."""
    x, y, xt, yt = digits
    _, h = run(tmp_path, FakeTorchLoader(x, y, BATCH), FakeTorchLoader(xt, yt, 64),
               num_epochs=2, mesh=one_device_mesh)
    learned(checked(h, 90, epochs=2))


def test_a_loader_is_opened_once_per_epoch(digits, tmp_path, one_device_mesh):
    """fit learns the shapes from the first batch, read up front from the iterator that epoch 1
    then goes on with: a torch or grain loader with workers starts them at every `iter()`,
    which can take seconds. Two epochs with an eval after each: two `iter()` of each loader,
    and epoch 1 still trains on all 45 batches, the one read up front included."""
    class Counted(FakeTorchLoader):
        def __iter__(self):
            self.opened = getattr(self, "opened", 0) + 1
            return super().__iter__()

    x, y, xt, yt = digits
    train, test = Counted(x, y, BATCH), Counted(xt, yt, 64)
    _, h = run(tmp_path, train, test, num_epochs=2, mesh=one_device_mesh)
    checked(h, 90, epochs=2)
    assert h["step"] == [45, 90], h["step"]
    assert (train.opened, test.opened) == (2, 2), (train.opened, test.opened)


def test_real_torch_dataloader(digits, tmp_path, one_device_mesh):
    """`torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)` passed
    as it is: torch tensors convert with `np.asarray`. Skips without torch."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset
    x, y, xt, yt = digits
    train = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=BATCH,
                       shuffle=True, generator=torch.Generator().manual_seed(0))
    test = DataLoader(TensorDataset(torch.from_numpy(xt), torch.from_numpy(yt)), batch_size=64)
    _, h = run(tmp_path, train, test, num_epochs=2, mesh=one_device_mesh)
    learned(checked(h, 90, epochs=2))
