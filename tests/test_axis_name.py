"""Models written for pmap: BatchNorm(axis_name="batch") calls lax.pmean over a named axis."""
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from conftest import flat, loss_fn
from fit import TrainState, fit


class ResBlockNet(nn.Module):
    """A ResNet-style net (conv, BatchNorm, residual block, pooling) as Flax's ImageNet example
    writes it: its BatchNorm averages batch statistics over the pmap axis `axis_name`."""
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)
        x = nn.relu(norm()(nn.Conv(8, (3, 3))(x)))
        y = nn.relu(norm()(nn.Conv(8, (3, 3))(x)))
        y = norm()(nn.Conv(8, (3, 3))(y))
        x = nn.relu(x + y)
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def _state(axis_name):
    model = ResBlockNet(axis_name)
    # init in train mode would pmean too: initialise with the axis-free twin (same parameters)
    var = ResBlockNet(None).init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)
    return TrainState.create(apply_fn=model.apply, params=var["params"],
                             batch_stats=var["batch_stats"], tx=optax.sgd(0.1))


def _data():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(6)]


def test_axis_name_model_matches_the_default_path(tmp_path):
    two = Mesh(np.array(jax.devices()[:2]), ("data",))
    kwargs = dict(loss_fn=loss_fn, num_epochs=2, workdir=str(tmp_path), mesh=two)
    pmapped, h1 = fit(_state("batch"), _data(), _data()[:2], axis_name="batch", **kwargs)
    plain, h2 = fit(_state(None), _data(), _data()[:2], **kwargs)
    np.testing.assert_allclose(flat(pmapped.params), flat(plain.params), atol=2e-5)
    np.testing.assert_allclose(flat(pmapped.batch_stats), flat(plain.batch_stats), atol=2e-5)
    np.testing.assert_allclose(h1["train/loss"], h2["train/loss"], rtol=1e-5)
    assert h1["eval/loss"] == pytest.approx(h2["eval/loss"], rel=1e-5)


def test_without_the_option_the_error_names_the_axis_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"named axis 'batch'.*pass axis_name='batch' to fit"):
        fit(_state("batch"), _data(), loss_fn=loss_fn, workdir=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing created before the error
