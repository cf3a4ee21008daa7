"""The user's own TrainState through fit, as is: a `flax.training.train_state.TrainState`
subclass with extra fields (an EMA of the parameters, a typed PRNG key), built sharded the way
Flax's lm1b example builds its state (logical partitioning annotations, `jax.eval_shape`,
`nn.get_partition_spec`, `nn.logical_to_mesh_sharding`, a jitted init with `out_shardings`), on
a ("data", "model") mesh, trained by the user's own train_step. Also: state_sharding= given as
PartitionSpecs or not at all, a BatchNorm model in a class without `batch_stats`, and a
three-parameter `train_step(state, batch, rng)`. Every fit call writes under tmp_path."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import CNN, loss_fn
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fit import fit, load_ckpt

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("vocab", None))
N_BATCHES, BATCH, FEATURES = 6, 16, 16
EPOCHS = 2


class EmaState(train_state.TrainState):
    """The user's state: Flax's TrainState, an exponential moving average of the parameters and
    a typed key that the train step splits every step."""
    ema_params: Any = None
    dropout_rng: jax.Array = struct.field(default_factory=lambda: jax.random.key(1))  # typed


class MLP(nn.Module):
    """Dense - ReLU - Dropout - Dense, its kernels annotated with logical axes: the hidden
    features ("mlp") go over the mesh's "model" axis."""

    @nn.compact
    def __call__(self, x, train=False):
        lecun, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros_init()
        x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(lecun, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(zeros, ("mlp",)))(x)
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
        return nn.Dense(10, kernel_init=nn.with_logical_partitioning(lecun, ("mlp", "vocab")),
                        bias_init=nn.with_logical_partitioning(zeros, ("vocab",)))(x)


def make_tx():
    return optax.sgd(0.05, momentum=0.9)


def init_fn(key):
    """The whole state from a key, boxed (LogicallyPartitioned) as the annotations make it."""
    variables = MLP().init(key, jnp.zeros((1, FEATURES)))
    return EmaState.create(apply_fn=MLP().apply, params=variables["params"], tx=make_tx(),
                           ema_params=variables["params"])


def build_sharded(mesh, seed=0):
    """The lm1b recipe: abstract state, its logical specs, their mesh shardings, a jitted init
    that lays the state out, then the boxes taken off. Returns (state, shardings, specs)."""
    key = jax.random.key(seed)
    abstract = jax.eval_shape(init_fn, key)
    logical = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    state = jax.jit(init_fn, out_shardings=shardings)(key)
    return nn.meta.unbox(state), shardings, nn.logical_to_mesh(logical, RULES)


def build_plain(seed=0):
    """The same state, unsharded (one device, committed nowhere)."""
    return nn.meta.unbox(init_fn(jax.random.key(seed)))


def train_step(state, batch):
    x, y = batch
    dropout_rng, next_rng = jax.random.split(state.dropout_rng)

    def loss_of(params):
        logits = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": dropout_rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    state = state.apply_gradients(grads=grads)
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema_params, state.params)
    return state.replace(ema_params=ema, dropout_rng=next_rng), {"loss": loss}


def make_data():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, 10))
    batches = []
    for _ in range(N_BATCHES):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        batches.append((x, (x @ w).argmax(-1).astype(np.int32)))
    return batches


@pytest.fixture
def mesh():
    assert len(jax.devices()) >= 4
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def leaves(tree):
    """Every leaf as numpy, typed keys as their raw data, by path."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(x))
    return out


def assert_close(a, b, atol=1e-5):
    a, b = leaves(a), leaves(b)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k].astype(np.float64), b[k].astype(np.float64), atol=atol,
                                   rtol=0, err_msg=k)


def assert_equal(a, b):
    a, b = leaves(a), leaves(b)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def hand_written(batches, epochs=EPOCHS):
    """The user's own loop: their jitted step over the same batches, in the same order."""
    state = build_plain()
    step = jax.jit(train_step)
    for _ in range(epochs):
        for batch in batches:
            state, _ = step(state, batch)
    return state


def assert_laid_out_like(state, shardings):
    """Every params and ema_params leaf is where the given sharding put it."""
    for part in ("params", "ema_params"):
        for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(getattr(state, part)),
                                jax.tree.leaves(getattr(shardings, part))):
            assert isinstance(x.sharding, NamedSharding), (part, path, x.sharding)
            assert x.sharding.is_equivalent_to(s, x.ndim), (part, path, x.sharding, s)
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P(None, "model")
    assert state.params["Dense_1"]["kernel"].sharding.spec == P("model", None)
    assert len({str(s.index) for s in kernel.addressable_shards}) == 2  # really split in two


def stop_at(step):
    def stop_hook(event, run):
        if event == "log" and run.step >= step:
            run.stop = True
    return stop_hook


COMMON = dict(train_step=train_step, num_epochs=EPOCHS, log_every=1, verbose=0,
              tensorboard=False)


# ----------------------------------------------------------------------------------------------

def test_the_users_sharded_state_trains_resumes_and_loads_as_its_own_class(mesh, tmp_path):
    batches = make_data()
    state, shardings, _ = build_sharded(mesh)
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")  # (the recipe)
    assert jnp.issubdtype(state.dropout_rng.dtype, jax.dtypes.prng_key)

    out, h = fit(state, batches, mesh=mesh, state_sharding=shardings, workdir=str(tmp_path),
                 log_name="full", **COMMON)
    assert type(out) is EmaState
    assert int(out.step) == EPOCHS * N_BATCHES and h["train/loss"][-1] < h["train/loss"][0]
    assert jnp.issubdtype(out.dropout_rng.dtype, jax.dtypes.prng_key)
    assert_laid_out_like(out, shardings)

    # The same numbers as the user's own loop on one device, and as fit on one device.
    hand = hand_written(batches)
    assert_close(out.params, hand.params)
    assert_close(out.ema_params, hand.ema_params)
    assert not np.allclose(leaves(out.ema_params)["['Dense_0']['kernel']"],
                           leaves(out.params)["['Dense_0']['kernel']"])  # (an EMA, not a copy)
    assert_equal(out.dropout_rng, hand.dropout_rng)
    one = Mesh(np.array(jax.devices()[:1]), ("data",))
    single, _ = fit(build_plain(), batches, mesh=one, workdir=str(tmp_path), log_name="one",
                    **COMMON)
    assert type(single) is EmaState
    assert_close(single.params, out.params)
    assert_close(single.ema_params, out.ema_params)

    # Stopped by a hook mid-epoch (at step 4, or the step after: logs are read a step late),
    # then continued with resume=True from the checkpoint into a fresh state of another seed: bit
    # for bit the uninterrupted run, every field (the key as its data). A hook's stop is final
    # (README, Resuming): the continuation asks for more epochs than the stopped call did.
    part = dict(COMMON, num_epochs=1)
    first, _ = fit(build_sharded(mesh)[0], batches, mesh=mesh, state_sharding=shardings,
                   workdir=str(tmp_path), log_name="part", hooks=[stop_at(4)], **part)
    assert 4 <= int(first.step) < N_BATCHES and type(first) is EmaState
    resumed, h2 = fit(build_sharded(mesh, seed=7)[0], batches, mesh=mesh,
                      state_sharding=shardings, workdir=str(tmp_path), log_name="part",
                      resume=True, **COMMON)
    assert h2.run == "part_1" and int(resumed.step) == EPOCHS * N_BATCHES
    assert type(resumed) is EmaState
    assert_equal(resumed, out)
    assert_laid_out_like(resumed, shardings)

    # load_ckpt into a fresh state of the user's class (another seed): the trained values, the
    # key still a typed key.
    fresh = build_sharded(mesh, seed=3)[0]
    loaded = load_ckpt(fresh, h.ckpt_dir)
    assert type(loaded) is EmaState
    assert jnp.issubdtype(loaded.dropout_rng.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(loaded.dropout_rng) == jax.random.key_impl(out.dropout_rng)
    assert_equal(loaded, out)
    assert_laid_out_like(loaded, shardings)


def test_state_sharding_as_partition_specs(mesh, tmp_path):
    batches = make_data()
    state, shardings, specs = build_sharded(mesh)
    assert specs.params["Dense_0"]["kernel"] == P(None, "model")  # (PartitionSpecs, no mesh)
    out, _ = fit(state, batches, mesh=mesh, state_sharding=specs, workdir=str(tmp_path), **COMMON)
    assert type(out) is EmaState
    assert_laid_out_like(out, shardings)
    hand = hand_written(batches)
    assert_close(out.params, hand.params)
    assert_close(out.ema_params, hand.ema_params)


def test_an_already_sharded_state_keeps_its_shardings_without_state_sharding(mesh, tmp_path):
    batches = make_data()
    state, shardings, _ = build_sharded(mesh)
    out, _ = fit(state, batches, workdir=str(tmp_path), **COMMON)  # no mesh=, no state_sharding=
    assert type(out) is EmaState
    assert_laid_out_like(out, shardings)
    assert out.params["Dense_0"]["kernel"].sharding.mesh.shape == mesh.shape
    hand = hand_written(batches)
    assert_close(out.params, hand.params)
    assert_close(out.ema_params, hand.ema_params)


def test_batchnorm_in_a_class_without_batch_stats_is_a_clear_error(digits, tmp_path):
    x, y, _, _ = digits
    model = CNN()
    variables = model.init(jax.random.key(0), x[:1], train=False)
    assert "batch_stats" in variables
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                          tx=optax.adam(1e-3))
    with pytest.raises((TypeError, ValueError), match="batch_stats") as e:
        fit(state, (x[:64], y[:64]), loss_fn=loss_fn, batch_size=32, workdir=str(tmp_path),
            verbose=0)
    assert len(str(e.value)) < 600, str(e.value)
    assert list(tmp_path.iterdir()) == []  # refused before any directory was made


class KeyState(train_state.TrainState):
    """Flax's TrainState (no `rng` field) plus a place to keep the last key a step was given."""
    last_key: Any = None


def test_a_three_parameter_train_step_gets_the_steps_key(tmp_path):
    batches = make_data()[:4]

    def as_key(rng):  # a typed key or its raw uint32 data: either is fine
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            assert rng.dtype == jnp.uint32, rng.dtype
            rng = jax.random.wrap_key_data(rng)
        return rng

    def step3(state, batch, rng):
        rng = as_key(rng)
        x, y = batch

        def loss_of(params):
            logits = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": rng})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        state = state.apply_gradients(grads=grads).replace(last_key=jax.random.key_data(rng))
        return state, {"loss": loss, "draw": jax.random.uniform(rng)}

    def run(seed, name):
        params = nn.meta.unbox(MLP().init(jax.random.key(0), jnp.zeros((1, FEATURES))))["params"]
        state = KeyState.create(apply_fn=MLP().apply, params=params, tx=make_tx(),
                                last_key=jnp.zeros(2, jnp.uint32))
        draws = []

        def spy(event, run):
            if event == "log":
                draws.append((run.step, run.metrics["train/draw"]))
        out, _ = fit(state, batches, train_step=step3, seed=seed, num_epochs=2, log_every=1,
                     hooks=[spy], workdir=str(tmp_path), log_name=name, verbose=0,
                     tensorboard=False)
        return out, draws

    out, draws = run(0, "a")
    assert [s for s, _ in draws] == list(range(1, 9))
    values = [d for _, d in draws]
    assert len(set(values)) == len(values)  # a new key every step
    again, draws_again = run(0, "b")
    assert draws_again == draws  # the same seed: the same keys
    np.testing.assert_array_equal(np.asarray(again.last_key), np.asarray(out.last_key))
    _, other = run(1, "c")
    assert [d for _, d in other] != values  # another seed: other keys
    # What the API promises: step n's key is fold_in(key(seed), n), n counted from 0.
    expected = [float(jax.random.uniform(jax.random.fold_in(jax.random.key(0), n)))
                for n in range(8)]
    np.testing.assert_allclose(values, expected, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.last_key), np.asarray(
        jax.random.key_data(jax.random.fold_in(jax.random.key(0), 7))))
