"""fit's nnx path against its TrainState path, on bench.py's models and data.

    python benchmarks/nnx.py                       # cnn_bn_dropout and mlp, 3 pairs each
    python benchmarks/nnx.py --models cnn --repeats 6 --steps 150

The same architectures written in linen (trained as a TrainState) and in flax.nnx (trained with
`fit(model, ..., optimizer=nnx.Optimizer(...))`), on bench.py's synthetic MNIST-shaped data,
batch 128, optax.adam(1e-3), fit's defaults (a checkpoint every epoch). Each run is its own
subprocess; the two paths alternate and the order of each pair flips every repeat. Reported:
`history.timing["steady_steps_per_s"]` of each run, and the median over pairs of the ratio
nnx / TrainState (target >= 0.95). Writes benchmarks/results/nnx.json and nnx.md (--out).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402  (its models, data, loss and sizes)

TARGET = 0.95


def _nnx_models():
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, bn_dropout, rngs):
            self.convs = nnx.List([nnx.Conv(1, 32, (3, 3), rngs=rngs), nnx.Conv(32, 64, (3, 3), rngs=rngs)])
            self.bns = nnx.List([nnx.BatchNorm(f, momentum=0.9, rngs=rngs) for f in (32, 64)]) if bn_dropout else None
            self.dense = nnx.Linear(7 * 7 * 64, 256, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs) if bn_dropout else None
            self.out = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            for i, conv in enumerate(self.convs):
                x = conv(x)
                if self.bns is not None:
                    x = self.bns[i](x)
                x = nnx.avg_pool(nnx.relu(x), (2, 2), strides=(2, 2))
            x = nnx.relu(self.dense(x.reshape(x.shape[0], -1)))
            return self.out(self.drop(x) if self.drop is not None else x)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(784, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))

    return {"cnn": lambda r: CNN(False, r), "cnn_bn_dropout": lambda r: CNN(True, r), "mlp": MLP}


def worker(model_name, method, steps, spe):
    sys.path.insert(0, os.path.dirname(HERE))
    import jax
    import optax
    from flax import nnx

    from fit import TrainState, fit

    x, y = bench._data(spe * bench.BATCH, seed=0)
    common = dict(loss_fn=bench._loss_fn, batch_size=bench.BATCH, num_epochs=max(1, steps // spe),
                  workdir=tempfile.mkdtemp(prefix="fitbench-nnx-"), log_name="bench")
    if method == "trainstate":
        model = bench._models()[model_name]
        var = jax.jit(model.init, static_argnames="train")(jax.random.key(0), x[:1], train=False)
        state = TrainState.create(apply_fn=model.apply, params=var["params"],
                                  batch_stats=var.get("batch_stats", {}), tx=optax.adam(1e-3))
        _, history = fit(state, (x, y), **common)
    else:
        model = _nnx_models()[model_name](nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        _, history = fit(model, (x, y), optimizer=optimizer, **common)
    return {"steady_steps_per_s": history.timing["steady_steps_per_s"],
            "compile_s": history.timing["compile_s"], "steps": history.timing["steps"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cnn_bn_dropout,mlp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="train steps of each run (default: bench.py's per model)")
    parser.add_argument("--out", default="nnx", help="results name: benchmarks/results/<out>.json and .md")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model, method, steps, spe = args.worker
        print("RESULT " + json.dumps(worker(model, method, int(steps), int(spe))))
        return
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("XLA_FLAGS", None)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": bench.machine_info(), "target": TARGET, "models": {}}
    for model in [m.strip() for m in args.models.split(",")]:
        steps, spe = bench.DEFAULTS[model]
        steps = args.steps or steps
        pairs = []
        for r in range(args.repeats):
            got = {}
            for method in (("trainstate", "nnx") if r % 2 == 0 else ("nnx", "trainstate")):
                out = subprocess.run([sys.executable, __file__, "--worker", model, method, str(steps), str(spe)],
                                     env=env, capture_output=True, text=True)
                line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")]
                if not line:
                    sys.exit(f"nnx bench: {model} {method} failed:\n{out.stderr[-3000:]}")
                got[method] = json.loads(line[-1][len("RESULT "):])
                print(f"  {model:15s} {method:10s} repeat {r + 1}/{args.repeats}: "
                      f"{got[method]['steady_steps_per_s']:.2f} steps/s", flush=True)
            pairs.append(got)
        ratios = [p["nnx"]["steady_steps_per_s"] / p["trainstate"]["steady_steps_per_s"] for p in pairs]
        report["models"][model] = {
            "steps": steps, "steps_per_epoch": spe, "pairs": pairs, "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "trainstate_median": statistics.median(p["trainstate"]["steady_steps_per_s"] for p in pairs),
            "nnx_median": statistics.median(p["nnx"]["steady_steps_per_s"] for p in pairs)}
    report["machine"]["loadavg_end"] = os.getloadavg()
    lines = ["# fit.py: nnx path vs TrainState path", "",
             f"- date: {report['date']}; load average at start / end: "
             f"{report['machine']['loadavg_start'][0]:.2f} / {report['machine']['loadavg_end'][0]:.2f}",
             f"- {args.repeats} alternating pairs per model, each run its own process; ratio = median of per-pair nnx / TrainState", "",
             "| model | TrainState steps/s | nnx steps/s | per-pair ratios | ratio (target >= 0.95) |",
             "|---|---|---|---|---|"]
    for model, m in report["models"].items():
        verdict = "PASS" if m["median_ratio"] >= TARGET else "FAIL"
        lines.append(f"| {bench.LABELS[model]} | {m['trainstate_median']:.2f} | {m['nnx_median']:.2f} | "
                     f"{', '.join(f'{r:.3f}' for r in m['ratios'])} | {m['median_ratio']:.3f}x {verdict} |")
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, args.out + ".json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, args.out + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
