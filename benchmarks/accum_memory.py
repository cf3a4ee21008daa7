"""The compiled train step's memory at grad_accum = 1, 2, 4 (#30): XLA's own estimate,
`memory_analysis()` of the step fit compiles, for bench.py's CNN (batch 128) and transformer
(2 layers, 256 wide, 128 tokens, batch 32), on one device of whatever backend JAX picks.

    python benchmarks/accum_memory.py          # ~1 min on 2 CPU cores

Temp bytes are the step's scratch (activations among them): a rolled scan over k microbatches
keeps one microbatch's activations at a time, so they should fall with k; arguments (the state,
the batch) and outputs stay."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import collections  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import bench  # noqa: E402
import fit as fit_module  # noqa: E402


def step_memory(name, k):
    model = bench._models()[name]
    n = bench.BATCHES.get(name, bench.BATCH)
    x, y = bench._data(n, 0, name)
    variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), x[:1], train=False)
    state = fit_module.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                         tx=optax.adam(1e-3))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    opts = fit_module.Options(loss_fn=bench._loss_fn, grad_accum=k)
    state = fit_module._place_state(state, 0, NamedSharding(mesh, P()))
    train = fit_module._Data([(x, y)], "train_ds", opts, train=True)
    config = fit_module._StepConfig.of(opts, fit_module._linen_forward, None, mesh, linen=True)
    fit_module._STEPS = collections.OrderedDict()
    steps = fit_module._build_steps(state, train, None, config, mesh)
    memory = steps.train.lower(state, steps.acc0, (x, y)).compile().memory_analysis()
    return {"temp": memory.temp_size_in_bytes, "argument": memory.argument_size_in_bytes,
            "output": memory.output_size_in_bytes}


if __name__ == "__main__":
    print(f"jax {jax.__version__} on {jax.devices()[0]}")
    print("| model | grad_accum | temp MB | argument MB | output MB |")
    print("|---|---|---|---|---|")
    for name in ("cnn", "transformer"):
        for k in (1, 2, 4):
            m = step_memory(name, k)
            print(f"| {bench.LABELS[name]} | {k} | {m['temp'] / 2**20:.1f} | "
                  f"{m['argument'] / 2**20:.1f} | {m['output'] / 2**20:.1f} |", flush=True)
