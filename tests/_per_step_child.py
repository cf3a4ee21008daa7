"""Child of tests/test_per_step.py: counts the host work of ordinary steps on 2 simulated devices.

    python tests/_per_step_child.py FIT_PY OUT_JSON

Trains the tiny MLP with FIT_PY (the repo's fit.py, or an older one from git) on a list of numpy
batches, with fit's defaults (log_every=50: no log point, eval or save in the first 30 steps), and
counts, between the 5th and the 15th dispatch of a step (`_Dispatch.__call__`), the calls of fit's
`_kinds`, numpy's `dtype.__str__` (Python code in numpy 2), `NamedSharding(...)`,
`jax.process_count()`, and of the loop's bookkeeping (`_Readings.read`, `_Plan.due`). Writes
`{name: count}` to OUT_JSON.
"""
import collections
import importlib.util
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import numpy._core._dtype as numpy_dtype  # noqa: E402
import optax  # noqa: E402

from conftest import MLP, loss_fn  # noqa: E402

fit_path, out_path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("fit", fit_path)
fit = importlib.util.module_from_spec(spec)
sys.modules["fit"] = fit  # (dataclasses look the module up)
spec.loader.exec_module(fit)
assert jax.device_count() == 2, jax.devices()

counts, window = collections.Counter(), []


def counted(name, fn):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return wrapper


fit._kinds = counted("_kinds", fit._kinds)
READINGS = getattr(fit, "_Readings", None) or fit._Meter  # (the sums on the host; _Meter before #43)
READINGS.read = counted("read", READINGS.read)  # the loop's bookkeeping: a log point
fit._Plan.due = counted("_Plan.due", fit._Plan.due)  # read, and whether anything is due
numpy_dtype.__str__ = counted("dtype.__str__", numpy_dtype.__str__)
jax.process_count = counted("process_count", jax.process_count)
real_sharding = fit.NamedSharding


class Counted(type):  # NamedSharding(...) counted; isinstance(x, NamedSharding) as before
    def __call__(cls, *args, **kwargs):
        counts["NamedSharding"] += 1
        return real_sharding(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, real_sharding)


fit.NamedSharding = Counted("NamedSharding", (), {})
if hasattr(fit, "_Dispatch"):  # (#43: the compiled steps' calls are an object of their own)
    OWNER, DISPATCH = fit._Dispatch, "__call__"
else:  # (_Meter.dispatch before #43, named train before #33)
    OWNER, DISPATCH = fit._Meter, "dispatch" if hasattr(fit._Meter, "dispatch") else "train"
real_train = getattr(OWNER, DISPATCH)


def train(self, *args, **kwargs):
    window.append(dict(counts))  # before each dispatch: calls 5 and 15 bound 10 ordinary steps
    return real_train(self, *args, **kwargs)


setattr(OWNER, DISPATCH, train)
rng = np.random.default_rng(0)
batches = [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
            rng.integers(0, 10, 16).astype(np.int32)) for _ in range(30)]
model = MLP()
variables = model.init(jax.random.key(0), batches[0][0][:1], train=False)
state = fit.TrainState.create(apply_fn=model.apply, params=variables["params"],
                              tx=optax.adam(1e-3))
fit.fit(state, batches, loss_fn=loss_fn, workdir=tempfile.mkdtemp(), verbose=0,
        tensorboard=False)
before, after = window[4], window[14]
result = {name: after.get(name, 0) - before.get(name, 0)
          for name in ("_kinds", "dtype.__str__", "NamedSharding", "process_count",
                       "read", "_Plan.due")}
with open(out_path, "w") as f:
    json.dump(result, f)
