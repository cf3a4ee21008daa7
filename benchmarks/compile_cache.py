"""What JAX's persistent compilation cache saves fit's users: the time to the first step of the
README's example (the CNN on the digits), each run in a fresh process, as a second process of a
sweep or a restarted job would.

    python benchmarks/compile_cache.py [--repeats 3]

Four kinds of process, alternating: without the cache (twice), and with the README's recipe (the
first fills a fresh cache directory, the second reads it). A child reports the seconds from its
start (before `import jax`) to the end of step 1, and fit's `compile_s`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "examples"))
import jax
cache = {cache!r}
if cache:  # the README's recipe, before any jax work
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import optax
from fit import TrainState, fit
from mnist import CNN, eval_step, load_digits, loss_fn
(x, y), test = load_digits()
variables = CNN().init(jax.random.key(0), x[:1], train=False)
state = TrainState.create(apply_fn=CNN().apply, params=variables["params"],
                          batch_stats=variables["batch_stats"], tx=optax.adam(5e-3))
first = []
hook = lambda event, run: first.append(time.perf_counter() - t0) if event == "epoch_end" else None
_, history = fit(state, (x, y), test, loss_fn=loss_fn, eval_step=eval_step, batch_size=32,
                 max_steps=1, workdir={workdir!r}, hooks=[hook], verbose=0, tensorboard=False)
print(json.dumps({{"first_step_s": first[0], "compile_s": history.timing["compile_s"],
                   "process_s": time.perf_counter() - t0}}))
"""


def child(cache, workdir):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = CHILD.format(root=root, cache=cache, workdir=workdir)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {k: [] for k in ("no cache", "cache, cold", "cache, warm")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            cache = os.path.join(tmp, f"cache{r}")
            for kind, directory in (("no cache", None), ("cache, cold", cache),
                                    ("cache, warm", cache), ("no cache", None)):
                t = time.perf_counter()
                rows[kind].append(child(directory, os.path.join(tmp, f"w{r}")))
                print(f"  {kind:12s} repeat {r + 1}: first step {rows[kind][-1]['first_step_s']:.2f}"
                      f" s, compile_s {rows[kind][-1]['compile_s']:.2f}, "
                      f"process {time.perf_counter() - t:.1f} s", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    print(json.dumps(med, indent=1))
    base, warm = med["no cache"], med["cache, warm"]
    print(f"time to the first step: {base['first_step_s']:.2f} s without the cache, "
          f"{warm['first_step_s']:.2f} s from a warm cache ({base['first_step_s'] / warm['first_step_s']:.2f}x "
          f"faster); fit's compile_s {base['compile_s']:.2f} -> {warm['compile_s']:.2f} s")


if __name__ == "__main__":
    main()
