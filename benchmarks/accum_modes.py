"""grad_accum's two modes (#50) against grad_accum=1: the compiled train step's time and XLA's
memory estimate for it, on one device, for tests/test_accum_outputs.py's two-tower contrastive
model (InfoNCE, batch 1024: the loss's 1024 x 1024 logits hold most of the work), the same
made wide (batch 256: the encoders hold it, as in CLIP) and tests/conftest.py's CNN (BatchNorm,
Dropout; 8x8 inputs, batch 512); and what the default mode's check costs at fit's first step.

    python benchmarks/accum_modes.py --repeats 5 --before DIR   # DIR/fit.py: the file before #50

Each figure comes from a fresh process (`--one`), the configurations of a round in turn, rounds
repeated: a step's time is the median of 5 blocks of 20 donated calls of the compiled step fit
builds (`_build_steps`, called as `_Dispatch` calls it, one block until ready at each block's
end), reported as the median of the rounds' ratios to grad_accum=1 of the same round [min-max].
Memory: `memory_analysis()` of that executable, arguments + outputs + temporaries - aliased
(the donated state): what the step needs on a device (deterministic). The default mode on the
contrastive loss raises at fit's first step; its step is timed here all the same (the check is
outside the step), for what the exact mode costs against it. The first step: fit's
`timing["compile_s"]` (the step's compile, and the check's beside it) on the CNN with
grad_accum=4, by this fit.py and by the one before #50, in turn, paired by round."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

MODELS = {"towers": 1024, "towers_wide": 256, "cnn": 512}  # model: batch rows


def wide_towers():
    """The test's two towers made wide (inputs 2 x 256, Dense 1024, 1024, embeddings 128), so
    that the encoders, not the loss, hold most of the work, as in CLIP."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fit import TrainState

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            tower = lambda h: nn.Dense(128)(nn.relu(nn.Dense(1024)(nn.relu(nn.Dense(1024)(h)))))
            unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
            scale = self.param("log_scale", lambda key: jnp.log(jnp.float32(10.0)))
            return unit(tower(x[:, :256])), unit(tower(x[:, 256:])), jnp.exp(scale)
    model = Wide()
    params = model.init(jax.random.key(0), np.zeros((1, 512), np.float32), train=False)
    x = np.random.default_rng(0).normal(size=(MODELS["towers_wide"], 512)).astype(np.float32)
    return TrainState.create(apply_fn=model.apply, params=params["params"],
                             tx=optax.adam(1e-3)), (x, np.zeros(len(x), np.int32))
CONFIGS = [(1, "losses"), (4, "losses"), (4, "outputs")]


def setup(model, k, mode):
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import fit as fit_module
    rows = MODELS[model]
    if model.startswith("towers"):
        from test_accum_outputs import clip_loss, pairs, towers_state
        state, (x, y), loss = towers_state().replace(tx=optax.adam(1e-3)), pairs(rows, 0), clip_loss
        state = state.replace(opt_state=state.tx.init(state.params))
        if model == "towers_wide":
            state, (x, y) = wide_towers()
    else:
        from conftest import CNN, loss_fn, make_state
        rng = np.random.default_rng(0)
        x = rng.normal(size=(rows, 8, 8, 1)).astype(np.float32)
        y = rng.integers(0, 10, rows).astype(np.int32)
        state, loss = make_state(CNN(), optax.adam(1e-3)), loss_fn
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    opts = fit_module.Options(loss_fn=loss, grad_accum=k, grad_accum_mode=mode)
    state = fit_module._place_state(state, 0, NamedSharding(mesh, P()))
    data = fit_module._Data([(x, y)], "train_ds", opts, train=True)
    config = fit_module._StepConfig.of(opts, fit_module._linen_forward, None, mesh, linen=True)
    steps = fit_module._build_steps(state, data, None, config, mesh)
    return state, steps, steps.put((x, y))


def one(model, k, mode, calls):
    """A fresh process's figures for one configuration, as JSON on stdout."""
    import jax
    state, steps, batch = setup(model, k, mode)
    out = {}
    for key in ("check_first_s", "check_again_s") if steps.accum_check else ():
        t = time.perf_counter()  # the first step's check (compile and run), then its run alone
        try:
            steps.accum_check(state, batch)()
        except ValueError:  # (the contrastive loss: refused, as fit would at its first step)
            out["check_raised"] = True
        out[key] = time.perf_counter() - t
    t = time.perf_counter()
    compiled = steps.train.lower(state, steps.acc0, batch).compile()
    out["compile_s"] = time.perf_counter() - t
    m = compiled.memory_analysis()
    out["memory_mb"] = (m.argument_size_in_bytes + m.output_size_in_bytes +
                        m.temp_size_in_bytes - m.alias_size_in_bytes) / 2**20
    out["temp_mb"] = m.temp_size_in_bytes / 2**20
    acc = steps.acc0
    for _ in range(10):
        state, acc = compiled(state, acc, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(5):  # 5 blocks of calls / 5 calls; the median block's time a call
        t = time.perf_counter()
        for _ in range(calls // 5):
            state, acc = compiled(state, acc, batch)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t) / (calls // 5))
    out["step_ms"] = 1e3 * statistics.median(times)
    print(json.dumps(out))


def first_step(fit_dir):
    """fit's compile time (to its first step) with grad_accum=4 on the CNN, by the fit.py in
    `fit_dir`: the check's cost at the first step, as a run pays it (beside the step's compile)."""
    sys.path.insert(0, fit_dir)
    import numpy as np
    import optax

    import fit as fit_module
    from conftest import CNN, loss_fn, make_state
    assert os.path.dirname(os.path.abspath(fit_module.__file__)) == os.path.abspath(fit_dir)
    rng, rows = np.random.default_rng(0), MODELS["cnn"]
    x = rng.normal(size=(2 * rows, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, 2 * rows).astype(np.int32)
    import tempfile
    with tempfile.TemporaryDirectory() as workdir:
        t = time.perf_counter()
        _, history = fit_module.fit(make_state(CNN(), optax.adam(1e-3)), (x, y), loss_fn=loss_fn,
                                    batch_size=rows, grad_accum=4, verbose=0, tensorboard=False,
                                    workdir=workdir)
        wall = time.perf_counter() - t
    print(json.dumps({"compile_s": history.timing["compile_s"], "wall_s": wall}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "K", "MODE"))
    parser.add_argument("--before", help="a directory with the fit.py before #50: fit's first "
                                         "step with grad_accum=4 by each file, in turn")
    parser.add_argument("--first-step", help=argparse.SUPPRESS)  # (a child: the fit.py's dir)
    args = parser.parse_args()
    if args.one:
        return one(args.one[0], int(args.one[1]), args.one[2], args.calls)
    if args.first_step:
        return first_step(args.first_step)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
    import jax
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, {jax.devices()[0].platform}; "
          f"{args.repeats} rounds, {args.calls} calls a figure", flush=True)
    results = {}
    for r in range(args.repeats):
        for model in args.models.split(","):
            for k, mode in CONFIGS:
                proc = subprocess.run([sys.executable, __file__, "--one", model, str(k), mode,
                                       "--calls", str(args.calls)], capture_output=True,
                                      text=True, env=env, check=True)
                figures = json.loads(proc.stdout.strip().splitlines()[-1])
                results.setdefault((model, k, mode), []).append(figures)
                print(r, model, k, mode, figures, flush=True)
        for name, where in (("after", ROOT), ("before", args.before)) if args.before else ():
            proc = subprocess.run([sys.executable, __file__, "--first-step", where],
                                  capture_output=True, text=True, env=env, check=True)
            figures = json.loads(proc.stdout.strip().splitlines()[-1])
            results.setdefault(("first", name), []).append(figures)
            print(r, "first step", name, results[("first", name)][-1], flush=True)
    report(results, args)


def report(results, args):
    print("\n| model (batch) | mode | step time / grad_accum=1 | step ms | memory / grad_accum=1 "
          "| memory MB | temp MB | compile s | check at the first step s (again) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for model in args.models.split(","):
        base = results[(model, 1, "losses")]
        for k, mode in CONFIGS:
            runs = results[(model, k, mode)]
            ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(runs, base)]
            med = lambda key, rs=runs: statistics.median(r[key] for r in rs)
            check = (f"{med('check_first_s'):.2f} ({med('check_again_s'):.3f})" + (
                ", raised" if runs[0].get("check_raised") else "") if "check_first_s" in runs[0]
                else "-")
            name = "grad_accum=1" if k == 1 else f"grad_accum={k}, {mode!r}"
            print(f"| {model} ({MODELS[model]}) | {name} | {statistics.median(ratios):.3f}x "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}] | {med('step_ms'):.2f} | "
                  f"{runs[0]['memory_mb'] / base[0]['memory_mb']:.3f}x | "
                  f"{runs[0]['memory_mb']:.2f} | {runs[0]['temp_mb']:.2f} | "
                  f"{med('compile_s'):.2f} | {check} |")
            rows[f"{model}/{k}/{mode}"] = runs
    if args.before:
        after, before = results[("first", "after")], results[("first", "before")]
        for key in ("compile_s", "wall_s"):
            diffs = [a[key] - b[key] for a, b in zip(after, before)]
            print(f"\nfit's first call, CNN, grad_accum=4, {key}: before #50 "
                  f"{statistics.median(b[key] for b in before):.2f} s, after "
                  f"{statistics.median(a[key] for a in after):.2f} s; the paired difference "
                  f"{statistics.median(diffs):+.2f} s [{min(diffs):+.2f} to {max(diffs):+.2f}]")
        rows["first_step"] = {"after": after, "before": before}
    with open(os.path.join(HERE, "results", "accum_modes.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
