"""Benchmarks fit.py against the minimal hand-written JAX loops it replaces.

    python benchmarks/bench.py                 # the full run (~20 min on 2 CPU cores; 19-20 min in the last three runs)
    python benchmarks/bench.py --quick         # a smoke test with tiny sizes (< 2 min)
    python benchmarks/bench.py --models cnn --repeats 5 --steps 200 --whole-seconds 30
    python benchmarks/bench.py --fit /tmp/other_fit.py   # measure another version of fit.py

Every model trains on the same in-memory synthetic MNIST-shaped data (28x28x1 float32, 10
classes, batch 128, made with numpy from a fixed seed) with optax.adam(1e-3), given in two forms
(`--data arrays,list`): arrays `(x, y)`, which fit batches itself and the hand loops gather the
same way (a permutation per epoch from `(seed, epoch)`, `x[idx]` per step), and a list of numpy
batches, fed as they are to both (the single-step pair only). The methods:

  hand        one `jax.jit` train step that donates the state, no logging, one
              `block_until_ready` at the end;
  hand_scan   a `lax.scan` of 10 steps per jitted call, fully unrolled (`unroll=True`);
  fit         `fit()` with its defaults: progress bar, TensorBoard, checkpoints every 300 s of
              wall time and at the end (so one, at the end, in these short runs), and
              steps_per_jit="auto" (#49; `history.timing["steps_per_jit"]` says what it chose;
              the per-step scenario pins 1);
  fit_scan    `fit(..., steps_per_jit=10)`.

For the BatchNorm + Dropout model the hand loops do the work of fit's default train step:
`mutable=["batch_stats"]` and a dropout key `fold_in(rng, step)`.

Each measured run is its own subprocess (so peak RSS and compile caches are its own); this
process only orchestrates. Runs alternate (hand, fit, hand, fit, ...; the order of each pair
flips every repeat, so a drift of the machine's speed hits both sides), and every ratio is the
median over repeats of the ratio within one adjacent pair.

Figures:
  steady steps/s  hand loops: the steps after the first (compiling) call, over their time;
                  fit: `history.timing["steady_steps_per_s"]` (compile, eval and blocking save
                  time left out, and the wait for the last save to commit at the end).
  compile s       hand loops: the first call including its `block_until_ready`; fit:
                  `history.timing["compile_s"]`.
  wall s          the whole call (fit: `fit(...)` itself; hand: first call to the final block).
  ms/save         fit: `save_s / save_count`, the blocking part of each asynchronous save.
  peak RSS        `ru_maxrss` of the run's own process at its end (fit.py's bytecode is
                  cached first, as a user's Python does at its first import).

The per-step scenario (#16's decision 3; `--diff-models`, tiny MLP by default) runs each method
twice, for a short and a long number of epochs (`--diff-epochs 1,5`): the per-step cost is the
difference of the two whole calls over the extra steps, so compile, start-up and the final save
cancel (fit's `ckpt_interval`, 300 s, is longer than both runs). `fit_nonorm` is fit with its
log-step norms switched off (benchmark only), to measure what grad_norm and param_norm cost.

The whole-call scenario (CNN by default) trains for about `--whole-seconds` with an eval of a
small test set every epoch (`--whole-test-size 0`: no test set): fit's whole call with its
defaults against a hand loop that does the same evals but writes no checkpoints. #14 and #16's
tiny-MLP whole call is `--models mlp --whole-models mlp --whole-seconds 10 --whole-test-size 0`.
Every ratio is the median of 5 (`--repeats`) within-pair ratios; the tables show their min-max.

The ablation (`--ablation each`, or a comma list of ABLATIONS' names; `--ablation-models`,
tiny MLP by default) pairs fit with fit minus one per-step part of its array path, its source
rewritten (see ABLATIONS: the stubs were written against b603621's fit.py, and a stub whose text
the measured fit.py lacks fails the run), alternating as above; it reports the speedup and the
microseconds a step that each part costs.

The accelerator table (#28 item 5; `--accelerator`, meant for a GPU, runs on any backend; set
JAX_PLATFORMS=cuda there; benchmarks/gpu.sh is the whole device command) adds a 2-layer, 256-wide
causal transformer (`transformer`: 128 tokens, batch 32, float32) and runs, per repeat and model,
`--accel-methods` in a rotating order: hand, fit, fit_cond (fit with the log steps' norms under a
lax.cond, as before #28), fit_nothrottle (the host never waits for the device), fit_hostput (numpy
batches handed to jit as they are, whatever the device) and fit_both, plus fit_before, another
fit.py (`--before`, on `--before-models`); `--accel-data device` gives both loops jax.Arrays.
Before them a dispatch test (200 calls of a jitted step with and without a lax.cond: how long a
call takes to return against the wall time) and, with `--put-test`, the host's time to place one
tiny-MLP batch each way. Writes accelerator.json and .md after every run (a run cut short by its
time limit keeps what it did), and the XLA donation warnings the runs printed.

The null-model table (#49; `--null`, alone: `python benchmarks/bench.py --null`, 5-10 min) times
the host's work a step, on a model with almost no device work (Dense 8 -> 1, batch 8, Adam,
arrays): each of hand, hand_scan (10 steps a call), fit (steps_per_jit=1), fit_scan (10),
fit_auto (fit's defaults) and, where installed, Keras 3's fit on JAX (steps_per_execution 1 and
10) is called for n and 2n steps (`--null-steps`, n = 40,000), each call its own process; a step
costs (wall(2n) - wall(n)) / n, so compile, start-up and the final save cancel. It also reports
the main thread's CPU time a step (the same difference) and the k fit_auto chose in each call
(the two calls must agree, or the difference mixes two rates). Measure it on an idle machine.
Writes null.json and null.md.

Writes benchmarks/results/latest.json and latest.md (quick.json and quick.md with --quick). The
machine's load average is recorded at the start and end: on a shared machine the spread of the
hand loop's own repeats (shown as min–max) says how much to trust a ratio.
"""
import argparse
import datetime
import json
import os
import platform
import py_compile
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 128
BATCHES = {"transformer": 32}  # the causal transformer's batch: 32 sequences of 128 tokens
K = 10  # steps per jitted call for hand_scan and fit_scan (2 with --quick: a 10-step unrolled
        # convolutional scan took 10-30 s to compile here, too long for a smoke test)
WHOLE_EPOCHS = 5
WHOLE_TEST_SIZE = 512
# The whole call per model: (seconds of steady training, test examples evaluated every epoch).
# The tiny MLP's is #16's ~10 s call with fit's defaults alone (no test set).
WHOLE = {"cnn": (25, WHOLE_TEST_SIZE), "cnn_bn_dropout": (25, WHOLE_TEST_SIZE), "mlp": (10, 0)}

# Per model: total steps of a steady run and steps per epoch (fit checkpoints every epoch).
# The convolutional models run ~3-8 steps/s on 2 CPU cores (and take 2-30 s to compile); the
# MLP is dispatch-bound, so it gets MNIST-sized epochs (470 batches of 128 = 60160 examples) and
# many more steps.
DEFAULTS = {"cnn": (60, 30), "cnn_bn_dropout": (60, 30), "mlp": (4700, 470),
            "transformer": (20, 10)}
QUICK = {"cnn": (8, 4), "cnn_bn_dropout": (8, 4), "mlp": (200, 100), "transformer": (4, 2)}
# --accelerator's steady runs (steps, steps per epoch): ~0.1-1 s of steps each on a GPU.
ACCEL = {"mlp": (2000, 250), "cnn": (1000, 250), "transformer": (1000, 250),
         "cnn_bn_dropout": (1000, 250)}
LABELS = {"cnn": "CNN", "cnn_bn_dropout": "CNN-BN-Dropout", "mlp": "tiny MLP",
          "transformer": "transformer"}
PAIRS = (("hand", "fit"), ("hand_scan", "fit_scan"))

# Targets: (what, threshold, direction). Ratios are fit / hand (steps/s, RSS, compile) and
# hand wall / fit wall for the whole call, so ">=" targets are speeds and "<=" targets costs.
STEADY_TARGET = {"cnn": 0.98, "cnn_bn_dropout": 0.98, "mlp": 0.97}  # #28: arrays and lists
SCAN_TARGET = {"cnn": 0.97, "cnn_bn_dropout": 0.97}
SCAN_VS_HAND_TARGET = {"cnn": 1.15}  # fit steps_per_jit=K / the hand single-step loop (#16)
WHOLE_TARGET = {"cnn": 0.97, "mlp": 0.95}  # the tiny MLP's call is measured without a test set
DIFF_TARGET = {"mlp": 0.97}  # per-step speed, hand / fit (differential)
NORMS_TARGET = 0.98  # fit's per-step speed with its norms / without them (they cost <= 2%)
SAVE_MS_TARGET = {"cnn": 50.0}
RSS_TARGET = 1.1  # ... or the hand loop's + RSS_EXTRA_MB, whichever is more (#16 decision 4)
RSS_EXTRA_MB = 60
COMPILE_TARGET = 1.1  # #32 (1.2 before)


# The ablation (#28): fit's per-step host and device parts on the array path, each stubbed in turn
# by rewriting the measured fit.py's source (so a stub's text names exactly what it removes). Each
# stub is a list of (text in fit.py, its replacement); a stub whose text the measured fit.py lacks
# fails its run with a LookupError. The stubs were written against b603621's fit.py (#28 changed
# the put and the throttle's text since: run `--ablation each` with `--fit` of b603621); a stubbed
# run trains the bench's models correctly (no evals, no saves but the last, no steps_per_jit) but
# may log wrong metrics.
_LAYERS = """
def _bench_flat(train, epoch, skip, put):  # one generator instead of epoch, _grouped, _prefetch
    order = np.random.default_rng([train.seed, epoch]).permutation(len(train.x))
    n = train.batch_size
    for i in range(skip, train.length):
        idx = np.sort(order[i * n:(i + 1) * n])
        yield put((train.x[idx], train.y[idx])), (i + 1, None), 1, i == train.length - 1
"""
ABLATIONS = {
    "sort": [("idx = np.sort(order[i * self.batch_size:(i + 1) * self.batch_size])",
              "idx = order[i * self.batch_size:(i + 1) * self.batch_size]")],
    "layers": [("for batch, position, k, last in _prefetch(batches, put):",
                "for batch, position, k, last in _bench_flat(train, epoch, position[0], put):"),
               ("\n\ndef _same_shapes(a, b):", _LAYERS + "\n\ndef _same_shapes(a, b):")],
    "put": [('    if mesh.size == 1 and jax.process_count() == 1 and mesh.devices.flat[0].platform '
             '== "cpu":', "    if True:")],
    "shape_key": [("        shape = (k, *(a.shape for a in jax.tree.leaves(batch)))\n"
                   "        if shape != self.shape:",
                   "        shape = self.shape if self.compiled else (k, *(a.shape for a in "
                   "jax.tree.leaves(batch)))\n        if shape != self.shape:"),
                  ("        if shape in self.compiled:", "        if self.compiled:")],
    "throttle": [('        self.inflight.append(self.acc["count"])\n'
                  "        if len(self.inflight) > 2:", "        if False:")],
    "clocks": [('        self.spent["data"][0] += time.perf_counter() - self.t_ready\n', ""),
               ("        self.t_ready = time.perf_counter()\n        return state\n",
                "        return state\n")],
    "bookkeeping": [("                    step += k\n",
                     "                    step += k\n                    if not (last or step % "
                     "opts.log_every < k or meter.pending):\n                        continue\n")],
    "accumulate": [("    new_state, metrics = train.step_fn(state, batch)\n",
                    "    new_state, metrics = train.step_fn(state, batch)\n"
                    "    return new_state, acc\n")],
    "norms": [("    return jax.lax.cond(_at_log(state, config), norm, lambda tree: "
               "jnp.float32(0), tree)", "    return jnp.float32(0)")],
}
# Every part but the throttle (which the first ablation found to make fit faster, not slower).
ABLATIONS["all"] = [r for name in ABLATIONS if name != "throttle" for r in ABLATIONS[name]] + [
    ("idx = np.sort(order[i * n:(i + 1) * n])", "idx = order[i * n:(i + 1) * n]")]


def _ablated(source, parts):
    """fit.py's source with the stubs of `parts` applied; raises if a stub's text is missing."""
    for old, new in (r for part in parts for r in ABLATIONS[part]):
        if source.count(old) != 1:
            raise LookupError(f"ablation: the measured fit.py lacks {old.strip()[:60]!r}")
        source = source.replace(old, new)
    return source


# ----------------------------------------------------------------------------------------------
# The worker: one measured run, in its own process.

def _models():
    import flax.linen as nn

    class CNN(nn.Module):
        bn_dropout: bool = False

        @nn.compact
        def __call__(self, x, train):
            for features in (32, 64):
                x = nn.Conv(features, (3, 3))(x)
                if self.bn_dropout:
                    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
                x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1)))
            if self.bn_dropout:
                x = nn.Dropout(0.5, deterministic=not train)(x)
            return nn.Dense(10)(x)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(10)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))

    class Transformer(nn.Module):  # 2 pre-LayerNorm blocks, 256 wide, 4 heads, causal, float32
        @nn.compact
        def __call__(self, tokens, train):
            x = nn.Embed(VOCAB, 256)(tokens) + self.param(
                "position", nn.initializers.normal(0.02), (tokens.shape[1], 256))
            mask = nn.make_causal_mask(tokens)
            for _ in range(2):
                h = nn.LayerNorm()(x)
                x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h, mask=mask)
                x = x + nn.Dense(256)(nn.gelu(nn.Dense(1024)(nn.LayerNorm()(x))))
            return nn.Dense(VOCAB)(nn.LayerNorm()(x))

    return {"cnn": CNN(), "cnn_bn_dropout": CNN(bn_dropout=True), "mlp": MLP(),
            "transformer": Transformer()}


VOCAB, LENGTH = 256, 128  # the transformer's byte-sized vocabulary and sequence length


def _data(n, seed, model="mlp"):
    """MNIST-shaped images and labels; for the transformer, token sequences and the next tokens."""
    import numpy as np
    rng = np.random.default_rng(seed)
    if model == "transformer":
        tokens = rng.integers(0, VOCAB, (n, LENGTH + 1)).astype(np.int32)
        return tokens[:, :-1], tokens[:, 1:]
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    return x, y


def _loss_fn(logits, labels):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _eval_step(state, batch):
    x, y = batch
    variables = {"params": state.params}
    if state.batch_stats:
        variables["batch_stats"] = state.batch_stats
    return (state.apply_fn(variables, x, train=False).argmax(-1) == y).mean()


def worker(spec):
    """Runs one method on one model and returns its measurements (a JSON-able dict)."""
    import jax
    import optax

    if spec["model"] == "null":  # #49's null model: the host's cost a step (`--null`)
        return _null(spec)
    if spec["method"] in ("dispatch", "put"):
        out = (_dispatch if spec["method"] == "dispatch" else _put_test)(spec)
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return out
    # (#32) Seconds of each compile stage (trace, lowering, XLA) per function, for the breakdown
    # of fit's first compile against the hand loop's.
    compile_events = {}

    def listen(event, secs, fun_name=None, **_):
        if event.startswith("/jax/core/compile/"):
            key = f"{event.rsplit('/', 1)[1].replace('_duration', '')} {fun_name}"
            compile_events[key] = compile_events.get(key, 0.0) + secs
    jax.monitoring.register_event_duration_secs_listener(listen)
    model = _models()[spec["model"]]
    spe, epochs, method = spec["steps_per_epoch"], spec["epochs"], spec["method"]
    n = BATCHES.get(spec["model"], BATCH)
    x, y = _data(spe * n, 0, spec["model"])
    if spec.get("data") == "list":  # the same numpy batches, in the same order, every epoch
        x = [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(spe)]
        y = None
    if spec.get("data") == "device":  # jax.Arrays on the default device, gathered there
        x, y = jax.device_put(x), jax.device_put(y)
    test = _data(spec["test_size"], 1, spec["model"]) if spec["test_size"] else None
    # Jitted: one compile instead of one per op (eager init of the CNN took ~4 s here).
    x0 = x[0][0][:1] if y is None else x[:1]
    variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), x0, train=False)
    params, batch_stats = variables["params"], variables.get("batch_stats", {})
    tx = optax.adam(1e-3)
    if method.startswith("fit"):
        out = _run_fit(spec, model, params, batch_stats, tx, x, y, test, epochs)
    else:
        out = _run_hand(spec, model, params, batch_stats, tx, x, y, test, epochs)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["loadavg_1min_end"] = os.getloadavg()[0]
    out["compile_events"] = compile_events
    return out


def _run_fit(spec, model, params, batch_stats, tx, x, y, test, epochs):
    import jax
    import numpy as np
    fit_dir = spec["fit_dir"]  # the snapshot of fit.py taken when the benchmark began
    if spec.get("ablate"):  # that fit.py with some per-step parts stubbed (ABLATIONS)
        with open(os.path.join(fit_dir, "fit.py")) as f:
            source = _ablated(f.read(), spec["ablate"])
        fit_dir = os.path.join(spec["workdir"], "ablated")
        os.makedirs(fit_dir)
        with open(os.path.join(fit_dir, "fit.py"), "w") as f:
            f.write(source)
    sys.path.insert(0, fit_dir)
    from fit import TrainState, fit

    if spec["method"] == "fit_ema":  # the optimizer wrapped in fit.ema (#29)
        tx = sys.modules["fit"].ema(tx)
    accum = {"grad_accum": int(spec["method"][9:])} if spec["method"].startswith("fit_accum") \
        else {}  # fit_accum<k>: grad_accum=k (#30)
    state = TrainState.create(apply_fn=model.apply, params=params, batch_stats=batch_stats, tx=tx)
    if spec["method"] == "fit_nonorm":  # grad_norm and param_norm off: what do they cost?
        import jax.numpy as jnp
        sys.modules["fit"]._log_norm = lambda state, opts, tree: jnp.float32(0)
    if spec["method"] == "fit_cond":  # the log steps' norms under a lax.cond on every platform,
        sys.modules["fit"]._NO_COND = ()  # as before #28's item 4
    if spec["method"] in ("fit_nothrottle", "fit_both"):  # the host never waits for the device
        sys.modules["fit"]._AHEAD = 10 ** 9
    if spec["method"] in ("fit_hostput", "fit_both"):  # numpy batches handed to jit as they are
        put = sys.modules["fit"]._putter            # (as on one CPU device), device data placed
        sys.modules["fit"]._putter = lambda mesh, axis: (
            lambda batch, stacked=False: batch if all(isinstance(a, np.ndarray) for a in
                                                      jax.tree.leaves(batch)) else put(mesh, axis)(batch, stacked))
    workdir = spec["workdir"]
    marks = []  # (step, host thread CPU s, process CPU s) at each log point: the steady window

    def mark(event, run):
        if event == "log":
            marks.append((run.step, time.thread_time(), time.process_time()))
    t0 = time.perf_counter()
    state, history = fit(state, x if y is None else (x, y), test, loss_fn=_loss_fn,
                         eval_step=_eval_step if test else None, num_epochs=epochs,
                         batch_size=None if y is None else BATCHES.get(spec["model"], BATCH),
                         workdir=workdir,
                         log_name="bench", hooks=[mark], **accum, **_steps_per_jit(spec))
    jax.block_until_ready(state)
    wall = time.perf_counter() - t0
    timing = dict(history.timing)
    saves = timing.get("save_count") or 0
    return {"steady_steps_per_s": timing["steady_steps_per_s"], "compile_s": timing["compile_s"],
            "wall_s": wall, "steps": timing["steps"], **_cpu_per_step(marks),
            "save_ms": 1000 * timing["save_s"] / saves if saves else None,
            "eval": history.get("eval/accuracy"), "timing": timing}


def _steps_per_jit(spec):
    """fit_scan: steps_per_jit=k; the per-step scenario: 1 (the cost a step of fit's path, the same
    rate in its short and long calls; #49's null-model table measures the defaults' grouping); the
    rest: fit's default ("auto", #49; 1 before it)."""
    if spec["method"] == "fit_scan":
        return {"steps_per_jit": spec["k"]}
    return {"steps_per_jit": 1} if spec["scenario"] == "diff" else {}


def _run_hand(spec, model, params, batch_stats, tx, x, y, test, epochs):
    """The loop people write by hand: a jitted step that donates the state, numpy batches from a
    fresh permutation each epoch, no logging, one block at the end (plus evals, if asked)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import struct
    from flax.training import train_state

    class State(train_state.TrainState):
        batch_stats: dict = struct.field(default_factory=dict)

    has_bs = bool(jax.tree.leaves(batch_stats))
    state = State.create(apply_fn=model.apply, params=params, batch_stats=batch_stats, tx=tx)
    rng = jax.random.key(0)

    def train_step(state, batch, rng):
        inputs, labels = batch

        def loss_of(params):
            if has_bs:  # fit's default step: mutable batch_stats and a per-step dropout key
                logits, updates = state.apply_fn(
                    {"params": params, "batch_stats": state.batch_stats}, inputs, train=True,
                    mutable=["batch_stats"], rngs={"dropout": jax.random.fold_in(rng, state.step)})
                return _loss_fn(logits, labels), updates["batch_stats"]
            return _loss_fn(state.apply_fn({"params": params}, inputs, train=True), labels), None

        (loss, new_bs), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        if has_bs:
            state = state.replace(batch_stats=new_bs)
        return state, loss

    k = spec["k"] if spec["method"] == "hand_scan" else 1
    if k == 1:
        step = jax.jit(train_step, donate_argnums=0)
    else:
        step = jax.jit(lambda state, batches, rng: jax.lax.scan(
            lambda s, b: train_step(s, b, rng), state, batches, unroll=True), donate_argnums=0)

    def eval_sum(state, correct, batch):
        return correct + _eval_step(state, batch) * batch[0].shape[0]
    eval_fn = jax.jit(eval_sum)

    n = BATCHES.get(spec["model"], BATCH)

    def batches(epoch):  # arrays: a permutation per epoch, gathered per step; a list as it is
        if y is None:
            yield from x
            return
        order = np.random.default_rng([0, epoch]).permutation(len(x))
        if isinstance(x, jax.Array):
            order = jax.device_put(order)
        for i in range(0, len(x) // n, k):
            idx = order[i * n:(i + k) * n]
            batch = (x[idx], y[idx])
            if k > 1:
                batch = (batch[0].reshape(k, n, *x.shape[1:]), batch[1].reshape(k, n, *y.shape[1:]))
            yield batch

    accuracies, compile_s, marks = [], None, []
    t0 = time.perf_counter()
    for epoch in range(epochs):
        for batch in batches(epoch):
            state, loss = step(state, batch, rng)
            if compile_s is None:
                jax.block_until_ready(state)
                t1 = time.perf_counter()
                compile_s = t1 - t0
                marks.append((k, time.thread_time(), time.process_time()))
        if test is not None:  # the same evals as fit: the whole test set, read once per epoch
            correct = jnp.float32(0)
            for j in range(0, len(test[0]), n):
                correct = eval_fn(state, correct, (test[0][j:j + n], test[1][j:j + n]))
            accuracies.append(float(correct) / len(test[0]))
    jax.block_until_ready(state)
    t2 = time.perf_counter()
    steps = epochs * (len(x) if y is None else len(x) // n)
    marks.append((steps, time.thread_time(), time.process_time()))
    return {"steady_steps_per_s": (steps - k) / (t2 - t1) if steps > k else None,
            "compile_s": compile_s, "wall_s": t2 - t0, "steps": steps, "save_ms": None,
            **_cpu_per_step(marks),
            "eval": accuracies or None}


NULL_BATCH = 8  # the null model's batch: Dense 8 -> 1 on 8 rows, Adam
NULL_METHODS = ("hand", "hand_scan", "fit", "fit_scan", "fit_auto", "keras", "keras_scan")
NULL_TARGETS = {"fit": ("hand", 0.8), "fit_scan": ("hand_scan", 0.8), "fit_auto": ("hand", 1.5)}


def _null(spec):
    """One call of `spec["steps"]` steps on #49's null model (Dense 8 -> 1, batch 8, Adam, MSE;
    arrays of `spec["rows"]` rows, one epoch): its wall time and the main thread's CPU time, the
    whole call (compile, start-up and the final save included: they cancel in the difference of
    two calls). hand: a donating jitted step, a permutation per epoch, `x[idx]` per step;
    hand_scan: its `lax.scan` of 10 steps a call, unrolled, `x[idx]` of 10 batches' rows; fit:
    `steps_per_jit=1`, fit_scan: 10, fit_auto: fit's defaults ("auto"), each with its progress
    bar (to the log), TensorBoard and checkpoints; keras / keras_scan: Keras 3's fit (JAX backend)
    with steps_per_execution 1 / 10 (only where keras is installed)."""
    import jax
    import numpy as np
    import optax
    thread = lambda: sum(resource.getrusage(resource.RUSAGE_THREAD)[:2])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(spec["rows"], 8)).astype(np.float32)
    y = rng.normal(size=(spec["rows"], 1)).astype(np.float32)
    method, steps, n = spec["method"], spec["steps"], NULL_BATCH
    out = {"steady_steps_per_s": None, "compile_s": 0.0}
    if method.startswith("keras"):
        import keras
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=True,
                      steps_per_execution=K if method == "keras_scan" else 1)
        t0, c0 = time.perf_counter(), thread()
        model.fit(x[:steps * n], y[:steps * n], batch_size=n, epochs=1, shuffle=True, verbose=0)
        return {**out, "wall_s": time.perf_counter() - t0, "cpu_s": thread() - c0}
    import flax.linen as nn

    class Null(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(1)(x)
    model = Null()
    params = jax.jit(model.init, static_argnames="train")(jax.random.key(0), x[:1], train=False)
    loss_fn = lambda out, targets: ((out - targets) ** 2).mean()
    if method.startswith("fit"):
        sys.path.insert(0, spec["fit_dir"])
        from fit import TrainState, fit
        state = TrainState.create(apply_fn=model.apply, params=params["params"],
                                  tx=optax.adam(1e-3))
        k = {"fit": {"steps_per_jit": 1}, "fit_scan": {"steps_per_jit": K}}.get(method, {})
        t0, c0 = time.perf_counter(), thread()
        state, history = fit(state, (x, y), loss_fn=loss_fn, batch_size=n, max_steps=steps,
                             workdir=spec["workdir"], log_name="null", **k)
        jax.block_until_ready(state)
        timing = {key: v for key, v in history.timing.items() if key.startswith("steps_per_jit")}
        return {**out, "wall_s": time.perf_counter() - t0, "cpu_s": thread() - c0, **timing}
    from flax.training import train_state
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"],
                                          tx=optax.adam(1e-3))

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(
            state.apply_fn({"params": p}, batch[0], train=True), batch[1]))(state.params)
        return state.apply_gradients(grads=grads), loss
    k = K if method == "hand_scan" else 1
    call = jax.jit(step if k == 1 else lambda state, batches: jax.lax.scan(
        step, state, batches, unroll=True), donate_argnums=0)
    t0, c0 = time.perf_counter(), thread()
    done, epoch = 0, 0
    while done < steps:
        order = np.random.default_rng([0, epoch]).permutation(len(x))
        for i in range(0, min(len(x) // n, steps - done) // k * k, k):
            idx = order[i * n:(i + k) * n]
            batch = (x[idx], y[idx]) if k == 1 else (x[idx].reshape(k, n, 8),
                                                      y[idx].reshape(k, n, 1))
            state, loss = call(state, batch)
            done += k
        epoch += 1
    jax.block_until_ready(state)
    return {**out, "wall_s": time.perf_counter() - t0, "cpu_s": thread() - c0}


def _dispatch(spec):
    """#28's dispatch test: `calls` calls of a jitted step (4 float32 matmuls of `size` squared
    (2048; 256 with --quick), the state donated, its step count on the device) whose norm is computed every step or under a
    lax.cond at every 10th; how long each call takes to return against the wall time of them all.
    Where a conditional blocks the host until the device is done, each call with the cond returns
    only after its step ran, so the host cannot run ahead."""
    import functools
    import jax
    import jax.numpy as jnp
    n = spec["size"]
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / n ** 0.5

    def step(state, with_cond):
        w, i = state
        for _ in range(4):
            w = jnp.tanh(x @ w)
        norm = (jax.lax.cond(i % 10 == 0, jnp.linalg.norm, lambda w: jnp.float32(0), w)
                if with_cond else jnp.linalg.norm(w))
        return (w, i + 1), norm

    out = {"device": str(jax.devices()[0]), "calls": spec["calls"], "size": n}
    for with_cond in (False, True, False, True):  # each twice, alternating; the second is kept
        f = jax.jit(functools.partial(step, with_cond=with_cond), donate_argnums=0)
        state, _ = f((x + 0, jnp.int32(0)))
        jax.block_until_ready(state)
        returns = []
        t0 = time.perf_counter()
        for _ in range(spec["calls"]):
            t = time.perf_counter()
            state, norm = f(state)
            returns.append(time.perf_counter() - t)
        dispatched = time.perf_counter() - t0
        jax.block_until_ready(state)
        wall = time.perf_counter() - t0
        out["cond" if with_cond else "plain"] = {
            "return_us_median": 1e6 * statistics.median(returns),
            "return_us_mean": 1e6 * statistics.fmean(returns),
            "return_us_first20": 1e6 * statistics.median(returns[:20]),
            "dispatched_s": dispatched, "wall_s": wall,
            "wall_us_per_call": 1e6 * wall / spec["calls"]}
    out["steady_steps_per_s"], out["compile_s"], out["wall_s"] = None, 0.0, out["cond"]["wall_s"]
    return out


def _put_test(spec):
    """The host's time to place one tiny-MLP batch (128x28x28x1 float32, 128 int32), `calls`
    times, each way fit or a hand loop might: numpy to a jitted call, or jax.device_put first."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    x, y = _data(BATCH, 0)
    batch = (x, y)
    f = jax.jit(lambda b: b[0].sum() + b[1].sum())
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P())
    ways = {"jit(numpy)": lambda: f(batch),
            "jit(device_put(named))": lambda: f(jax.device_put(batch, one)),
            "jit(device_put(device))": lambda: f(jax.device_put(batch, jax.devices()[0])),
            "device_put(named)": lambda: jax.device_put(batch, one),
            "jit(device array)": lambda: f(xd)}
    xd = jax.device_put(batch)
    out = {"device": str(jax.devices()[0]), "calls": spec["calls"]}
    for _ in range(2):  # the second round is kept
        for name, way in ways.items():
            jax.block_until_ready(way())
            t0 = time.perf_counter()
            results = [way() for _ in range(spec["calls"])]
            host = time.perf_counter() - t0
            jax.block_until_ready(results)
            out[name] = {"host_us": 1e6 * host / spec["calls"],
                         "wall_us": 1e6 * (time.perf_counter() - t0) / spec["calls"]}
    out["steady_steps_per_s"], out["compile_s"], out["wall_s"] = None, 0.0, 0.0
    return out


def _cpu_per_step(marks):
    """CPU time a step between the first and the last mark: the host thread's (Python: what the
    loop itself costs, unmoved by other machines' load) and the process's (XLA's threads too)."""
    if len(marks) < 2 or marks[-1][0] == marks[0][0]:
        return {"host_us_per_step": None, "cpu_us_per_step": None}
    (s0, h0, p0), (s1, h1, p1) = marks[0], marks[-1]
    return {"host_us_per_step": 1e6 * (h1 - h0) / (s1 - s0),
            "cpu_us_per_step": 1e6 * (p1 - p0) / (s1 - s0)}


# ----------------------------------------------------------------------------------------------
# The orchestrator.

def run_one(spec, log_dir):
    """Runs `spec` in a fresh subprocess with its own temp workdir; returns its result dict."""
    workdir = tempfile.mkdtemp(prefix=f"fitbench-{spec['model']}-{spec['method']}-")
    spec = dict(spec, workdir=workdir)
    out_path = os.path.join(workdir, "result.json")
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), KERAS_BACKEND="jax",
               TF_CPP_MIN_LOG_LEVEL="2")
    log_path = os.path.join(log_dir, f"{spec['scenario']}-{spec['model']}-{spec['method']}-"
                                     f"{'-'.join(spec.get('ablate') or [])}-{spec.get('data')}-"
                                     f"r{spec['repeat']}.log")
    t = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, os.path.join(spec["fit_dir"], "bench.py"), "--worker",
                                   json.dumps(spec), "--worker-out", out_path],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env)
        if proc.returncode != 0:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"worker {spec['model']}/{spec['method']} failed with exit code "
                               f"{proc.returncode}; its log ({log_path}) ends:\n{tail}")
        with open(out_path) as f:
            result = json.load(f)
        with open(log_path) as f:  # e.g. XLA's "Some donated buffers were not usable"
            result["warnings"] = sorted({line.strip()[:300] for line in f if "donat" in line})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["process_s"] = time.perf_counter() - t
    return result


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def verdict(value, threshold, at_least):
    if value is None or threshold is None:
        return ""
    ok = value >= threshold if at_least else value <= threshold
    return "PASS" if ok else "FAIL"


def machine_info():
    import jax
    import flax
    import optax
    import orbax.checkpoint as ocp
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "orbax": getattr(ocp, "__version__", "?"), "backend": jax.default_backend(),
            "device_count": jax.device_count(), "devices": str(jax.devices()),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "processor": _cpu_name(),
            "loadavg_start": os.getloadavg()}


def _fit_version(path):
    """The fit.py measured: its sha256 and how it relates to the repo's HEAD."""
    import hashlib
    with open(path, "rb") as f:
        data = f.read()
    out = f"sha256 {hashlib.sha256(data).hexdigest()[:12]}"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        committed = subprocess.run(["git", "show", "HEAD:fit.py"], cwd=ROOT, capture_output=True,
                                   check=True).stdout
        out += f", repo HEAD {head}" + (" (same as HEAD's fit.py)" if committed == data else
                                        " (differs from HEAD's fit.py)")
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=None,
                        help=f"comma-separated, from {','.join(DEFAULTS)} (default: all but the "
                             "transformer; with --accelerator: mlp,cnn,transformer)")
    parser.add_argument("--steps", type=int, default=None,
                        help="train steps of each steady run, all models (a multiple of 10; "
                             "default per model: " + ", ".join(f"{m} {s}" for m, (s, _) in DEFAULTS.items()) + ")")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--whole-seconds", type=float, default=None,
                        help="steady training seconds of the whole-call run, all models (default "
                             "per model: " + ", ".join(f"{m} {w[0]}" for m, w in WHOLE.items())
                        + "; 2 with --quick); 0 skips it")
    parser.add_argument("--whole-models", default="cnn,mlp",
                        help="models of the whole-call scenario")
    parser.add_argument("--whole-test-size", type=int, default=None,
                        help="test examples evaluated every epoch of the whole call, all models "
                             "(default per model: " + ", ".join(f"{m} {w[1]}" for m, w in
                                                                  WHOLE.items())
                        + "; 0: no test set, fit's defaults alone)")
    parser.add_argument("--diff-models", default="mlp",
                        help="models of the per-step (differential) scenario; '' skips it")
    parser.add_argument("--diff-epochs", default="1,5",
                        help="the short and the long call's epochs of the per-step scenario")
    parser.add_argument("--data", default="arrays,list",
                        help="data forms of the steady scenario: arrays (x, y) with batch_size=, "
                             "gathered per step from a permutation per epoch, and/or a list of "
                             "numpy batches fed as they are (default: both; the list form runs "
                             "the single-step pair only)")
    parser.add_argument("--ablation", default="",
                        help="fit's per-step parts to stub in turn, each paired with fit itself "
                             f"(from {','.join(ABLATIONS)}; 'each': every one); '' skips it")
    parser.add_argument("--ablation-models", default="mlp", help="models of the ablation")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 2 steps per jitted call: a smoke test (< 2 min)")
    parser.add_argument("--fit", default=os.path.join(ROOT, "fit.py"),
                        help="the fit.py to measure (default: the repo's); it is copied when the "
                             "benchmark starts, so edits during a run do not mix versions")
    parser.add_argument("--null", action="store_true",
                        help="#49's null-model table alone (Dense 8 -> 1, batch 8, Adam): the host's "
                             "cost a step, differential (a call of 2n steps minus one of n), for "
                             "hand, hand_scan, fit (steps_per_jit=1), fit_scan (10), fit_auto (the "
                             "defaults) and Keras 3 (JAX) if installed; writes null.json and null.md")
    parser.add_argument("--null-steps", type=int, default=40000,
                        help="with --null: n, the short call's steps (the long call runs 2n)")
    parser.add_argument("--null-methods", default=",".join(NULL_METHODS),
                        help="with --null: which of them (Keras' only if installed)")
    parser.add_argument("--accelerator", action="store_true",
                        help="#28's table for a GPU (any backend runs it): the dispatch test, then "
                             "per model hand, fit and fit_cond (fit with the log steps' norms "
                             "under a lax.cond, as before #28) and fit_before (--before), arrays, "
                             f"steps per model {', '.join(f'{m} {s}' for m, (s, _) in ACCEL.items())}"
                             "; writes accelerator.json and .md after every run")
    parser.add_argument("--before", default=None,
                        help="with --accelerator: an older fit.py measured as fit_before")
    parser.add_argument("--accel-methods", default="hand,fit,fit_cond",
                        help="with --accelerator: from hand, fit, fit_cond, fit_nothrottle (no "
                             "wait for the device), fit_hostput (numpy batches to jit as they "
                             "are), fit_both, fit_ema (the optimizer wrapped in fit.ema), "
                             "fit_accum<k> (grad_accum=k)")
    parser.add_argument("--no-dispatch", dest="dispatch", action="store_false",
                        help="with --accelerator: skip the dispatch test")
    parser.add_argument("--put-test", action="store_true",
                        help="with --accelerator: time placing one batch by jit, device_put")
    parser.add_argument("--accel-data", default="arrays",
                        help="with --accelerator: arrays (numpy) or device (jax.Arrays)")
    parser.add_argument("--before-models", default="mlp",
                        help="with --before: the models fit_before runs on (default: mlp)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"),
                        help="where the results go: latest.json and latest.md (quick.json and "
                             "quick.md with --quick, so a smoke test never overwrites a full run)")
    parser.add_argument("--render", metavar="JSON",
                        help="only rewrite the markdown table next to JSON from its recorded runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        result = worker(json.loads(args.worker))
        with open(args.worker_out, "w") as f:
            json.dump(result, f)
        return
    if args.render:
        with open(args.render) as f:
            old = json.load(f)
        report = summarize(old["runs"], list(old["steady"]), {m: {k: w[k] for k in (
            "steps_per_epoch", "epochs", "steps", "rate_used", "test_size") if k in w}
            for m, w in old["whole"].items()},
            old["repeats"], old["steps_per_jit"], old["machine"], old["args"],
            list(old.get("per_step", {})), ("arrays",), list(old.get("ablation", {})))
        with open(args.render, "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(markdown(report))
        print(markdown(report))
        return

    models = [m.strip() for m in (args.models or ("mlp,cnn,transformer" if args.accelerator else
              "cnn,cnn_bn_dropout,mlp")).split(",") if m.strip()]
    whole_models = [m.strip() for m in args.whole_models.split(",") if m.strip()]
    diff_models = [m.strip() for m in args.diff_models.split(",") if m.strip()]
    diff_epochs = [int(e) for e in args.diff_epochs.split(",")]
    if len(diff_epochs) != 2 or not 0 < diff_epochs[0] < diff_epochs[1]:
        parser.error(f"--diff-epochs must be two increasing counts, got {args.diff_epochs!r}")
    data_forms = [d.strip() for d in args.data.split(",") if d.strip()]
    ablation_models = [m.strip() for m in args.ablation_models.split(",") if m.strip()]
    parts = list(ABLATIONS) if args.ablation == "each" else [
        a.strip() for a in args.ablation.split(",") if a.strip()]
    if not parts:
        ablation_models = []
    for m in models + whole_models + diff_models + ablation_models:
        if m not in DEFAULTS:
            parser.error(f"unknown model {m!r}; choose from {', '.join(DEFAULTS)}")
    for d in data_forms:
        if d not in ("arrays", "list"):
            parser.error(f"unknown data form {d!r}; choose from arrays, list")
    for a in parts:
        if a not in ABLATIONS:
            parser.error(f"unknown ablation {a!r}; choose from {', '.join(ABLATIONS)}")
    k = 2 if args.quick else K
    if args.steps is not None and (args.steps < 2 * k or args.steps % k):
        parser.error(f"--steps must be a multiple of {k} and at least {2 * k}, got {args.steps}")
    repeats = args.repeats or (1 if args.quick else 3)
    whole_seconds = {m: args.whole_seconds if args.whole_seconds is not None else
                     2 if args.quick else w[0] for m, w in WHOLE.items()}
    test_sizes = {m: w[1] if args.whole_test_size is None else args.whole_test_size
                  for m, w in WHOLE.items()}
    sizes = QUICK if args.quick else DEFAULTS

    os.makedirs(args.out, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="fitbench-logs-")
    fit_dir = os.path.join(log_dir, "fit_snapshot")
    os.makedirs(fit_dir)
    shutil.copyfile(args.fit, os.path.join(fit_dir, "fit.py"))
    shutil.copyfile(os.path.abspath(__file__), os.path.join(fit_dir, "bench.py"))  # the workers
    # A user's Python caches fit.py's bytecode at its first import; cache it here too, so that
    # workers import fit as users do even where PYTHONDONTWRITEBYTECODE is set (as on these
    # machines, where compiling the file in every worker added ~5 MB to fit's peak RSS).
    py_compile.compile(os.path.join(fit_dir, "fit.py"), doraise=True)
    info = machine_info()
    info["fit"] = _fit_version(args.fit)
    print(f"bench: jax {info['jax']} on {info['backend']} ({info['device_count']} device(s), "
          f"{info['cpu_count']} CPUs); load average {info['loadavg_start'][0]:.2f}; worker logs "
          f"in {log_dir}", flush=True)
    t_start = time.perf_counter()
    runs = []  # every measured run, with its spec

    def measure(spec):
        method = spec["method"] + "".join(f"-{a}" for a in spec.get("ablate") or []) + (
            "+list" if spec.get("data") == "list" else "")
        print(f"  {spec['scenario']:6s} {spec['model']:15s} {method:10s} repeat "
              f"{spec['repeat'] + 1}/{repeats} ... ", end="", flush=True)
        result = run_one(spec, log_dir)
        runs.append({**spec, **result})
        rate = result["steady_steps_per_s"]
        print(f"{rate or float('nan'):8.2f} steps/s, compile {result['compile_s']:.2f} s, wall "
              f"{result['wall_s']:.1f} s, RSS {result['peak_rss_mb']:.0f} MB", flush=True)
        return result

    if args.accelerator:
        _accelerator(args, models, repeats, k, fit_dir, log_dir, info, measure, runs)
        return
    if args.null:
        _null_table(args, repeats, fit_dir, log_dir, info, runs)
        return

    # 1. Steady rate, compile time, saves and RSS: per model, pairs alternate within a repeat.
    for model in models:
        steps, spe = sizes[model]
        if args.steps is not None:
            steps, spe = args.steps, min(spe, args.steps)
        spe = max(k, spe // k * k)
        epochs = max(1, steps // spe)
        for data in data_forms:
            for r in range(repeats):
                for pair in PAIRS if data == "arrays" else PAIRS[:1]:
                    for method in (pair if r % 2 == 0 else pair[::-1]):
                        measure({"scenario": "steady", "model": model, "method": method,
                                 "repeat": r, "steps_per_epoch": spe, "epochs": epochs,
                                 "test_size": 0, "k": k, "fit_dir": fit_dir, "data": data})

    # 2. The whole call: ~`seconds` of training (with an eval every epoch where the model has
    # a test set). The number of steps comes from the hand loop's steady rate measured above (or
    # a short calibration run).
    whole = {}
    for model in whole_models:
        seconds, test_size = whole_seconds[model], test_sizes[model]
        if seconds <= 0:
            continue
        rates = [r["steady_steps_per_s"] for r in runs
                 if r["scenario"] == "steady" and r["model"] == model and r["method"] == "hand"]
        if not rates:
            steps, spe = QUICK[model]
            rates = [measure({"scenario": "calib", "model": model, "method": "hand",
                              "repeat": 0, "steps_per_epoch": spe, "epochs": steps // spe,
                              "test_size": 0, "k": k, "fit_dir": fit_dir})["steady_steps_per_s"]]
        rate = median(rates)
        spe = max(k, -(-int(seconds * rate / WHOLE_EPOCHS) // k) * k)
        whole[model] = {"steps_per_epoch": spe, "epochs": WHOLE_EPOCHS,
                        "steps": spe * WHOLE_EPOCHS, "rate_used": rate, "test_size": test_size}
        print(f"bench: whole call for {model}: {WHOLE_EPOCHS} epochs of {spe} steps "
              f"(~{spe * WHOLE_EPOCHS / rate:.0f} s at {rate:.2f} steps/s), eval of "
              f"{test_size} examples every epoch", flush=True)
        for r in range(repeats):
            for method in (("hand", "fit") if r % 2 == 0 else ("fit", "hand")):
                measure({"scenario": "whole", "model": model, "method": method, "repeat": r,
                         "steps_per_epoch": spe, "epochs": WHOLE_EPOCHS,
                         "test_size": test_size, "k": k, "fit_dir": fit_dir})

    # 3. Per-step cost, differential: a short and a long call of each method, in turn.
    for model in diff_models:
        spe = sizes[model][1]
        methods = ("hand", "fit", "fit_nonorm")
        for r in range(repeats):
            for method in (methods if r % 2 == 0 else methods[::-1]):
                for epochs in diff_epochs:
                    measure({"scenario": "diff", "model": model, "method": method, "repeat": r,
                             "steps_per_epoch": spe, "epochs": epochs, "test_size": 0, "k": k,
                             "fit_dir": fit_dir})

    # 4. The ablation: fit paired with fit minus one per-step part, for each part in turn.
    for model in ablation_models:
        steps, spe = sizes[model]
        if args.steps is not None:
            steps, spe = args.steps, min(spe, args.steps)
        for r in range(repeats):
            for part in parts:
                for method in (("fit", part) if r % 2 == 0 else (part, "fit")):
                    measure({"scenario": "ablation", "model": model, "method": "fit",
                             "ablate": [] if method == "fit" else [part], "pair": part,
                             "repeat": r, "steps_per_epoch": spe, "epochs": steps // spe,
                             "test_size": 0, "k": k, "fit_dir": fit_dir, "data": "arrays"})

    info["loadavg_end"] = os.getloadavg()
    info["bench_s"] = time.perf_counter() - t_start
    report = summarize(runs, models, whole, repeats, k, info, vars(args), diff_models,
                       data_forms, ablation_models)
    stem = "quick" if args.quick else "latest"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    shutil.rmtree(log_dir, ignore_errors=True)
    print(f"bench: wrote {os.path.join(args.out, stem + '.json')} and {stem}.md in "
          f"{info['bench_s']:.0f} s", flush=True)


def _null_table(args, repeats, fit_dir, log_dir, info, runs):
    """#49: per repeat, each method (in a rotating order) called for n and 2n steps, each call a
    fresh process; a method's cost a step is (wall(2n) - wall(n)) / n, so compile, start-up and
    the final save cancel. Ratios are the median [min-max] of within-repeat ratios."""
    import importlib.util
    n, methods = args.null_steps, [m for m in args.null_methods.split(",") if m and (
        not m.startswith("keras") or importlib.util.find_spec("keras") is not None)]
    for r in range(repeats):
        for method in methods[r % len(methods):] + methods[:r % len(methods)]:
            for steps in (n, 2 * n):
                spec = {"scenario": "null", "model": "null", "method": method, "repeat": r,
                        "steps": steps, "rows": 2 * n * NULL_BATCH, "fit_dir": fit_dir}
                t = time.perf_counter()
                result = run_one(spec, log_dir)
                runs.append({**spec, **result})
                print(f"  null {method:10s} {steps:6d} steps, repeat {r + 1}/{repeats}: wall "
                      f"{result['wall_s']:.2f} s (process {time.perf_counter() - t:.0f} s)"
                      + (f", k {result['steps_per_jit']}" if "steps_per_jit" in result else ""),
                      flush=True)
    info["loadavg_end"] = os.getloadavg()
    report = null_report(runs, methods, repeats, n, info, vars(args))
    for ext, text in (("json", json.dumps(report, indent=1)), ("md", null_markdown(report))):
        with open(os.path.join(args.out, f"null.{ext}"), "w") as f:
            f.write(text)
    print("\n" + null_markdown(report), flush=True)


def null_report(runs, methods, repeats, n, info, args):
    """Per method and repeat: seconds and host CPU seconds a step (differential); per method the
    median steps/s [min-max] and its ratio to its baseline (hand; fit_scan: hand_scan)."""
    def cost(method, rep, key):
        calls = {r["steps"]: r for r in runs if r["method"] == method and r["repeat"] == rep}
        return (calls[2 * n][key] - calls[n][key]) / n if len(calls) == 2 else None

    def spread(values):
        values = [v for v in values if v]
        return [median(values), min(values), max(values)] if values else None
    table = {}
    for m in methods:
        base = NULL_TARGETS.get(m, ("hand",))[0]
        base = base if base in methods else m
        per = [cost(m, rep, "wall_s") for rep in range(repeats)]
        table[m] = {"steps_per_s": spread([1 / c for c in per if c]),
                    "host_us_per_step": median([1e6 * c for c in (cost(m, rep, "cpu_s")
                                                                for rep in range(repeats)) if c]),
                    "ratio": spread([ratio(cost(base, rep, "wall_s"), c) for rep, c in
                                     enumerate(per) if c]), "baseline": base,
                    "target": NULL_TARGETS.get(m, (None, None))[1],
                    "steps_per_jit": sorted({r.get("steps_per_jit") for r in runs
                                             if r["method"] == m and "steps_per_jit" in r})}
    return {"machine": info, "args": {k: v for k, v in args.items() if not k.startswith("worker")},
            "n": n, "repeats": repeats, "methods": table, "runs": runs}


def null_markdown(report):
    info, rows = report["machine"], report["methods"]
    labels = {"hand": "hand-written jitted loop, donating, one call a step",
              "hand_scan": f"the hand loop's `lax.scan` of {K} steps a call (unrolled)",
              "fit": "fit, `steps_per_jit=1`", "fit_scan": f"fit, `steps_per_jit={K}`",
              "fit_auto": "fit, its defaults (`steps_per_jit=\"auto\"`)",
              "keras": "Keras 3 fit, JAX backend, steps_per_execution 1",
              "keras_scan": f"Keras 3 fit, JAX backend, steps_per_execution {K}"}
    cell = lambda v, d: "–" if not v else f"{v[0]:,.{d}f} [{v[1]:,.{d}f}–{v[2]:,.{d}f}]"
    lines = ["# fit.py: the null model (#49)", "",
             f"- date: {info['date']}; jax {info['jax']}, flax {info['flax']}, optax {info['optax']}; "
             f"fit.py {info['fit']}",
             f"- {info['cpu_count']} CPUs ({info['processor']}); load average (1 min) at start / "
             f"end: {info['loadavg_start'][0]:.2f} / {info['loadavg_end'][0]:.2f} (measure on an "
             f"idle machine: with other work on the cores the ratios mean little)",
             f"- Dense 8 -> 1, batch {NULL_BATCH}, Adam, arrays `(x, y)`; each method called for "
             f"n = {report['n']:,} and 2n steps, each call its own process; a step's cost = "
             f"(wall(2n) - wall(n)) / n; median of {report['repeats']} repeats [min-max]; ratios "
             f"within a repeat, to the hand loop (fit's k={K}: to the hand scan)", "",
             "| loop | steps/s | vs its baseline (target) | host CPU us a step | k chosen |",
             "|---|---|---|---|---|"]
    for m, v in rows.items():
        target = (f" {verdict(v['ratio'][0], v['target'], True)} (>= {v['target']})"
                  if v["target"] and v["ratio"] else "")
        lines.append(f"| {labels[m]} | {cell(v['steps_per_s'], 0)} | "
                     f"{cell(v['ratio'], 2)}x of {v['baseline']}{target} | "
                     f"{_f(v['host_us_per_step'], 1)} | "
                     f"{', '.join(map(str, v['steps_per_jit'])) or '–'} |")
    return "\n".join(lines) + "\n"


def _accelerator(args, models, repeats, k, fit_dir, log_dir, info, measure, runs):
    """#28 item 5: the dispatch test, then per repeat and model the methods in a rotating order,
    the report rewritten after every run (a run cut short by its time limit keeps what it did)."""
    methods = args.accel_methods.split(",")
    dirs = dict.fromkeys(methods, fit_dir)
    if args.before:
        dirs["fit_before"] = os.path.join(log_dir, "fit_before")
        os.makedirs(dirs["fit_before"])
        shutil.copyfile(args.before, os.path.join(dirs["fit_before"], "fit.py"))
        shutil.copyfile(os.path.abspath(__file__), os.path.join(dirs["fit_before"], "bench.py"))
        py_compile.compile(os.path.join(dirs["fit_before"], "fit.py"), doraise=True)
        info["fit_before"] = _fit_version(args.before)
        methods.append("fit_before")
    stem = os.path.join(args.out, "accelerator-quick" if args.quick else "accelerator")

    def attempt(spec):
        try:
            measure(spec)
        except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
            print(f"FAILED: {str(e)[-2000:]}", flush=True)
            runs.append({**spec, "error": str(e)[-2000:]})
        report = accelerator_report(runs, models, methods, info, vars(args))
        with open(stem + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(accelerator_markdown(report))
        return report

    report = None
    if args.put_test:
        report = attempt({"scenario": "put", "model": "mlp", "method": "put", "repeat": 0,
                          "calls": 500, "fit_dir": fit_dir})
    if args.dispatch:
        report = attempt({"scenario": "dispatch", "model": "-", "method": "dispatch", "repeat": 0,
                          "calls": 200, "size": 256 if args.quick else 2048, "fit_dir": fit_dir})
    for r in range(repeats):
        for model in models:
            steps, spe = (QUICK if args.quick else ACCEL)[model]
            if args.steps is not None:
                steps, spe = args.steps, min(spe, args.steps)
            here = [m for m in methods if m != "fit_before" or model in args.before_models.split(",")]
            for method in here[r % len(here):] + here[:r % len(here)]:
                report = attempt({"scenario": "accel", "model": model, "method": method,
                                  "repeat": r, "steps_per_epoch": spe, "epochs": steps // spe,
                                  "test_size": 0, "k": k, "data": args.accel_data,
                                  "fit_dir": dirs[method]})
    print("\n" + accelerator_markdown(report), flush=True)


def accelerator_report(runs, models, methods, info, args):
    """Per model and method the median steady rate with its min-max, and per method the median
    of its within-repeat ratios to the hand loop (and fit's to fit_cond)."""
    def pick(model, method, repeat=None):
        return [r for r in runs if r["scenario"] == "accel" and r["model"] == model
                and r["method"] == method and r.get("steady_steps_per_s")
                and repeat in (None, r["repeat"])]

    def spread(values):
        values = [v for v in values if v is not None]
        return [median(values), min(values), max(values)] if values else None

    table = {}
    for model in models:
        per = {m: {"steps_per_s": spread([r["steady_steps_per_s"] for r in pick(model, m)]),
                   "compile_s": median([r["compile_s"] for r in pick(model, m)]),
                   "host_us_per_step": median([r.get("host_us_per_step") for r in pick(model, m)]),
                   "warnings": sorted({w for r in pick(model, m) for w in r.get("warnings", [])})}
               for m in methods}
        ratios = {}
        for a, b in [(m, "hand") for m in methods[1:]] + [("fit", "fit_cond")]:
            ratios[f"{a}/{b}"] = spread([
                ratio(pick(model, a, rep)[0]["steady_steps_per_s"],
                      pick(model, b, rep)[0]["steady_steps_per_s"])
                for rep in {r["repeat"] for r in runs} if pick(model, a, rep) and pick(model, b, rep)])
        table[model] = {"methods": per, "ratios": ratios}
    dispatch = next((r for r in runs if r["scenario"] == "dispatch" and "error" not in r), None)
    return {"machine": info, "args": args, "methods": methods, "models": table,
            "dispatch": dispatch, "errors": [r["error"] for r in runs if "error" in r], "runs": runs}


def accelerator_markdown(report):
    info, methods = report["machine"], report["methods"]
    cell = lambda v, d=2: "–" if not v else f"{v[0]:.{d}f} [{v[1]:.{d}f}–{v[2]:.{d}f}]"
    lines = [f"# fit.py on {info['backend']}: {info['devices']}", "",
             f"jax {info['jax']}, flax {info['flax']}, optax {info['optax']}, orbax "
             f"{info['orbax']}; fit.py {info['fit']}" + (f"; fit_before {info['fit_before']}"
                                                          if "fit_before" in info else ""), "",
             "Steady steps/s, median [min–max] of the repeats; ratios are medians of within-"
             "repeat ratios. fit_cond: fit with the log steps' norms under a lax.cond, as before "
             "#28 item 4. Host us/step: the Python thread's CPU time per step.", "",
             "| model | " + " | ".join(f"{m} steps/s" for m in methods) + " | "
             + " | ".join(report["models"][next(iter(report["models"]))]["ratios"]) if
             report["models"] else "", ]
    if report["models"]:
        ratio_names = list(report["models"][next(iter(report["models"]))]["ratios"])
        lines[-1] += " | compile s (" + ", ".join(methods) + ") | host us/step (" + ", ".join(
            methods) + ") |"
        lines.append("|" + " --- |" * (1 + len(methods) + len(ratio_names) + 2))
        for model, row in report["models"].items():
            per = row["methods"]
            lines.append(
                f"| {_label(model)} | " + " | ".join(cell(per[m]["steps_per_s"], 1) for m in methods)
                + " | " + " | ".join(cell(row["ratios"][n], 3) for n in ratio_names) + " | "
                + ", ".join(_f(per[m]["compile_s"]) for m in methods) + " | "
                + ", ".join(_f(per[m]["host_us_per_step"], 0) for m in methods) + " |")
        warnings = sorted({w for row in report["models"].values() for m in row["methods"].values()
                           for w in m["warnings"]})
        lines += ["", "Donation warnings: " + ("; ".join(warnings) if warnings else "none")]
    d = report["dispatch"]
    if d:
        lines += ["", f"Dispatch test on {d['device']}: {d['calls']} calls of a jitted step "
                  f"(4 float32 {d['size']}x{d['size']} matmuls), its norm every step or under a lax.cond:", "",
                  "| step | return from a call, median us | first 20 calls, median us | mean us "
                  "| all calls dispatched, s | wall, s | wall us per call |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name in ("plain", "cond"):
            v = d[name]
            lines.append(f"| {name} | {v['return_us_median']:.0f} | "
                         f"{v.get('return_us_first20', float('nan')):.0f} | {v['return_us_mean']:.0f} | "
                         f"{v['dispatched_s']:.4f} | {v['wall_s']:.4f} | "
                         f"{v['wall_us_per_call']:.0f} |")
    p = next((r for r in report["runs"] if r["scenario"] == "put" and "error" not in r), None)
    if p:
        lines += ["", f"Placing a tiny-MLP batch on {p['device']}, {p['calls']} times:", "",
                  "| way | host us per call | wall us per call |", "| --- | --- | --- |"]
        lines += [f"| {name} | {v['host_us']:.0f} | {v['wall_us']:.0f} |" for name, v in p.items()
                  if isinstance(v, dict)]
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e.splitlines()[-1] if e else e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def summarize(runs, models, whole, repeats, k, info, args, diff_models=(), data_forms=("arrays",),
              ablation_models=()):
    """Medians per (scenario, model, method), and ratios as medians of within-pair ratios. The
    steady scenario's models are keyed `model` for arrays, `model+list` for a list of batches."""
    def pick(scenario, model, method, repeat=None, ablate=()):
        model, data = (model.split("+") + ["arrays"])[:2]
        return [r for r in runs if r["scenario"] == scenario and r["model"] == model
                and r["method"] == method and (repeat is None or r["repeat"] == repeat)
                and r.get("data", "arrays") == data and list(r.get("ablate") or []) == list(ablate)]

    def med(scenario, model, method, key):
        return median([r.get(key) for r in pick(scenario, model, method)])

    def med_where(scenario, model, part, stubbed):  # an ablation pair's fit or stubbed rate
        return median([r["steady_steps_per_s"] for r in runs if r["scenario"] == scenario
                       and r["model"] == model and r.get("pair") == part
                       and bool(r.get("ablate")) == stubbed])

    def paired(scenario, model, fit_method, hand_method, key, invert=False, spread=False):
        """The median of the within-pair ratios (with `spread`: also their min and max)."""
        values = []
        for rep in range(repeats):
            f, h = pick(scenario, model, fit_method, rep), pick(scenario, model, hand_method, rep)
            if f and h:
                values.append(ratio(h[0][key], f[0][key]) if invert else ratio(f[0][key], h[0][key]))
        values = [v for v in values if v is not None]
        if not spread:
            return median(values)
        return median(values), ([min(values), max(values)] if values else None)

    steady = {}
    for model in [m if d == "arrays" else f"{m}+list" for m in models for d in data_forms]:
        methods = {}
        for method in ("hand", "fit", "hand_scan", "fit_scan"):
            methods[method] = {key: med("steady", model, method, key) for key in
                               ("steady_steps_per_s", "compile_s", "wall_s", "save_ms", "peak_rss_mb",
                                "host_us_per_step", "cpu_us_per_step")}
            rates = [r["steady_steps_per_s"] for r in pick("steady", model, method)
                     if r["steady_steps_per_s"] is not None]
            methods[method]["steady_range"] = [min(rates), max(rates)] if rates else None
        ratios = {}
        for hand, fit_m in PAIRS:
            ratios[fit_m] = {
                "steady": paired("steady", model, fit_m, hand, "steady_steps_per_s"),
                "compile": paired("steady", model, fit_m, hand, "compile_s"),
                "wall_speed": paired("steady", model, fit_m, hand, "wall_s", invert=True),
                "rss": paired("steady", model, fit_m, hand, "peak_rss_mb")}
        # max(1.1x, hand + 60 MB) as a ratio to the hand loop's median peak RSS
        rss_limit = lambda hand: hand["peak_rss_mb"] and round(
            max(RSS_TARGET, 1 + RSS_EXTRA_MB / hand["peak_rss_mb"]), 3)
        steady_target = STEADY_TARGET.get(model.split("+")[0])
        scan_target = SCAN_TARGET.get(model)
        save_target = SAVE_MS_TARGET.get(model)
        def target(value, threshold, at_least, spread=None):
            return [value, threshold, ">=" if at_least else "<=", verdict(value, threshold, at_least),
                    spread]
        steady_spread = {m: paired("steady", model, m, h, "steady_steps_per_s", spread=True)[1]
                         for h, m in PAIRS}
        targets = {
            "fit_steady": target(ratios["fit"]["steady"], steady_target, True, steady_spread["fit"]),
            "fit_scan_steady": target(ratios["fit_scan"]["steady"], scan_target, True,
                                      steady_spread["fit_scan"]),
            "fit_scan_vs_hand": target(*paired("steady", model, "fit_scan", "hand",
                                               "steady_steps_per_s", spread=True)[:1],
                                       SCAN_VS_HAND_TARGET.get(model), True,
                                       paired("steady", model, "fit_scan", "hand",
                                              "steady_steps_per_s", spread=True)[1]),
            "fit_compile": target(ratios["fit"]["compile"], COMPILE_TARGET, False),
            "fit_rss": target(ratios["fit"]["rss"], rss_limit(methods["hand"]), False,
                              paired("steady", model, "fit", "hand", "peak_rss_mb", spread=True)[1]),
            "fit_scan_rss": target(ratios["fit_scan"]["rss"], rss_limit(methods["hand_scan"]),
                                   False, paired("steady", model, "fit_scan", "hand_scan",
                                                 "peak_rss_mb", spread=True)[1]),
            "fit_save_ms": target(methods["fit"]["save_ms"], save_target, False),
        }
        some = pick("steady", model, "fit")
        steady[model] = {"steps": some[0]["steps"] if some else None,
                         "steps_per_epoch": some[0]["steps_per_epoch"] if some else None,
                         "methods": methods, "ratios": ratios, "targets": targets}

    whole_out = {}
    for model, cfg in whole.items():
        speed, spread = paired("whole", model, "fit", "hand", "wall_s", invert=True, spread=True)
        whole_out[model] = {**cfg, "hand_wall_s": med("whole", model, "hand", "wall_s"),
                            "fit_wall_s": med("whole", model, "fit", "wall_s"),
                            "fit_save_ms": med("whole", model, "fit", "save_ms"),
                            "fit_eval_s": median([r["timing"]["eval_s"] for r in pick("whole", model, "fit")]),
                            "speed_ratio": speed,
                            "target": [speed, WHOLE_TARGET.get(model), ">=",
                                       verdict(speed, WHOLE_TARGET.get(model), True), spread]}

    per_step = {}
    for model in diff_models:
        def cost(method, rep):  # seconds per extra step of the long call over the short one
            calls = sorted(pick("diff", model, method, rep), key=lambda r: r["epochs"])
            if len(calls) != 2:
                return None
            short, long = calls
            extra = (long["epochs"] - short["epochs"]) * long["steps_per_epoch"]
            return (long["wall_s"] - short["wall_s"]) / extra

        def within(a, b):  # cost(b) / cost(a) per repeat: a's speed relative to b's
            values = [ratio(cost(b, r), cost(a, r)) for r in range(repeats)]
            values = [v for v in values if v is not None]
            return median(values), ([min(values), max(values)] if values else None)

        speed, spread = within("fit", "hand")
        norms, norms_spread = within("fit", "fit_nonorm")
        ms = {m: median([cost(m, r) for r in range(repeats)]) for m in ("hand", "fit", "fit_nonorm")}
        per_step[model] = {
            "ms_per_step": {m: v and 1000 * v for m, v in ms.items()},
            "target": [speed, DIFF_TARGET.get(model), ">=",
                       verdict(speed, DIFF_TARGET.get(model), True), spread],
            "norms_target": [norms, NORMS_TARGET, ">=", verdict(norms, NORMS_TARGET, True),
                             norms_spread]}

    ablation = {}
    for model in ablation_models:
        parts = list(dict.fromkeys(r["pair"] for r in runs if r["scenario"] == "ablation"
                                   and r["model"] == model))
        ablation[model] = {}
        for part in parts:
            gains, saved, host = [], [], []
            for rep in range(repeats):
                base = [r for r in pick("ablation", model, "fit", rep) if r["pair"] == part]
                stub = [r for r in pick("ablation", model, "fit", rep, [part])]
                if base and stub and base[0]["steady_steps_per_s"] and stub[0]["steady_steps_per_s"]:
                    a, b = base[0]["steady_steps_per_s"], stub[0]["steady_steps_per_s"]
                    gains.append(b / a)
                    saved.append(1e6 * (1 / a - 1 / b))
                if base and stub and base[0].get("host_us_per_step") and stub[0].get(
                        "host_us_per_step"):
                    host.append(base[0]["host_us_per_step"] - stub[0]["host_us_per_step"])
            ablation[model][part] = {
                "speedup": median(gains), "speedup_range": [min(gains), max(gains)] if gains else None,
                "us_per_step_saved": median(saved),
                "host_us_saved": median(host),
                "host_us_range": [min(host), max(host)] if host else None,
                "fit_steps_per_s": med_where("ablation", model, part, False),
                "stub_steps_per_s": med_where("ablation", model, part, True)}

    return {"machine": info, "args": {k: v for k, v in args.items() if not k.startswith("worker")},
            "repeats": repeats, "batch_size": BATCH, "steps_per_jit": k,
            "steady": steady, "whole": whole_out, "per_step": per_step, "ablation": ablation,
            "runs": runs}


def _label(model):
    name, _, data = model.partition("+")
    return LABELS[name] + (", a list of batches" if data == "list" else "")


def _f(value, digits=2, suffix=""):
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _target_cell(target):
    value, threshold, op, result, spread = (list(target) + [None])[:5]
    cell = _f(value, 3, "x")
    if spread:  # the min-max of the within-pair ratios
        cell += f" [{spread[0]:.3f}–{spread[1]:.3f}]"
    if threshold is None:
        return cell
    noise = _noise(target)
    return f"{cell} {result}{noise and ', ' + noise} ({op} {threshold})"


def _noise(target):
    """Decision 3 of #16: a verdict is the median's; the report says where the spread of the
    within-pair ratios straddles the target."""
    spread, threshold = (list(target) + [None])[4], target[1]
    return "within noise" if spread and spread[0] < threshold < spread[1] else ""


def _in_noise(target):
    return f" ({_noise(target)})" if _noise(target) else ""


def markdown(report):
    info, k = report["machine"], report["steps_per_jit"]
    lines = [
        "# fit.py benchmark",
        "",
        f"- date: {info['date']}",
        f"- jax {info['jax']}, flax {info['flax']}, optax {info['optax']}, orbax "
        f"{info['orbax']}, python {info['python']}",
        f"- fit.py measured: {info['fit']}",
        f"- backend: {info['backend']}, device count: {info['device_count']}, CPU count: "
        f"{info['cpu_count']} ({info['processor']})",
        f"- load average (1 min) at start / end: {info['loadavg_start'][0]:.2f} / "
        f"{info['loadavg_end'][0]:.2f}; benchmark took {info['bench_s']:.0f} s",
        f"- batch {report['batch_size']}, synthetic 28x28x1 float32, 10 classes, optax.adam(1e-3); "
        f"median of {report['repeats']} repeat(s); each run in its own process; runs alternate "
        f"hand/fit and each ratio is the median of within-pair ratios",
        "",
        "## Steady training",
        "",
        "| model | method | steady steps/s (min–max) | ratio (target) | us/step (host CPU, all "
        "CPU) | compile s | compile ratio (target) | wall s | ms/save | peak RSS MB | RSS ratio "
        "(target) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, s in report["steady"].items():
        m, rt, t = s["methods"], s["ratios"], s["targets"]
        name = f"{_label(model)} ({s['steps']} steps, {s['steps_per_epoch']}/epoch)"
        rows = [
            ("hand (jit, k=1)", m["hand"], "1 (baseline)", "1 (baseline)", "1 (baseline)"),
            ("fit defaults", m["fit"], _target_cell(t["fit_steady"]), _target_cell(t["fit_compile"]),
             _target_cell(t["fit_rss"])),
            (f"hand scan k={k} unrolled", m["hand_scan"], "1 (baseline)",
             "1 (baseline)", "1 (baseline)"),
            (f"fit steps_per_jit={k}", m["fit_scan"], _target_cell(t["fit_scan_steady"]),
             _f(rt["fit_scan"]["compile"], 3, "x"), _target_cell(t["fit_scan_rss"])),
        ]
        if "fit_scan_vs_hand" in t:  # (older results lack it)
            rows.append((f"fit steps_per_jit={k} vs hand k=1", m["fit_scan"],
                         _target_cell(t["fit_scan_vs_hand"]), "", ""))
        if model.endswith("+list"):  # (the single-step pair only)
            rows = rows[:2]
        for label, v, steady_cell, compile_cell, rss_cell in rows:
            save = _f(v["save_ms"], 1)
            if label == "fit defaults" and t["fit_save_ms"][1] is not None:
                save = f"{save} {t['fit_save_ms'][3]} (<= {t['fit_save_ms'][1]:.0f})"
            spread = v.get("steady_range")
            rate = _f(v["steady_steps_per_s"]) + (f" ({spread[0]:.2f}–{spread[1]:.2f})"
                                                   if spread and spread[0] != spread[1] else "")
            per_step = (f"{_f(1e6 / v['steady_steps_per_s'] if v['steady_steps_per_s'] else None, 1)}"
                        f" ({_f(v.get('host_us_per_step'), 1)}, {_f(v.get('cpu_us_per_step'), 1)})")
            lines.append(f"| {name} | {label} | {rate} | {steady_cell} | {per_step} | "
                         f"{_f(v['compile_s'])} | {compile_cell} | {_f(v['wall_s'], 1)} | {save} | "
                         f"{_f(v['peak_rss_mb'], 0)} | {rss_cell} |")
    lines += ["",
              "Ratios: fit / hand for steady steps/s, compile time and peak RSS (its target: "
              f"max({RSS_TARGET}x, the hand loop's + {RSS_EXTRA_MB} MB), as a ratio); a verdict is "
              "the median's, 'within noise' where the pairs' min-max straddles the target; fit "
              "defaults pair "
              f"with the k=1 hand loop, steps_per_jit={k} with the unrolled k={k} scan. ms/save is the "
              "blocking part of fit's asynchronous orbax save (save_s / save_count). Wall s is the "
              "whole call of that run (fit: including its checkpoints and writer setup). us/step "
              "is 1e6 / the steady rate, then the CPU time a step over the steady window (fit: "
              "from the first to the last log point; hand: after the first call): the main "
              "thread's (the host loop's own work) and the whole process's (XLA's threads too).",
              ""]
    if report["whole"]:
        lines += ["## Whole call", "",
                  "fit's whole call with its defaults (progress bar, TensorBoard, checkpoints on "
                  "its wall-time schedule and at the end; an eval every epoch where there is a "
                  "test set) against a hand loop that does the same evals but saves NO "
                  "checkpoints. Ratio = hand wall / fit wall (higher is better for fit), the "
                  "median of the within-pair ratios [their min–max].", "",
                  "| model | steps (epochs x steps) | test examples | hand wall s | fit wall s | "
                  "fit ms/save | fit eval s | ratio (target) |",
                  "|---|---|---|---|---|---|---|---|"]
        for model, w in report["whole"].items():
            lines.append(f"| {LABELS[model]} | {w['steps']} ({w['epochs']} x {w['steps_per_epoch']}) "
                         f"| {w.get('test_size', WHOLE_TEST_SIZE)} | {_f(w['hand_wall_s'], 1)} "
                         f"| {_f(w['fit_wall_s'], 1)} "
                         f"| {_f(w['fit_save_ms'], 1)} | {_f(w['fit_eval_s'], 2)} "
                         f"| {_target_cell(w['target'])} |")
        lines.append("")
    if report.get("per_step"):
        lines += ["## Per step (differential)", "",
                  "Each method called twice, for a short and a long run; per-step cost = (long "
                  "wall - short wall) / extra steps, so compile, start-up and the final save "
                  "cancel. Ratio = hand cost / fit cost (fit's speed relative to the hand loop), "
                  "and fit without its norms' cost / fit's (what the log-step norms cost), each "
                  "the median of within-repeat ratios [their min–max].", "",
                  "| model | hand ms/step | fit ms/step | fit w/o norms ms/step | fit vs hand "
                  "(target) | norms kept (target) |", "|---|---|---|---|---|---|"]
        for model, d in report["per_step"].items():
            ms = d["ms_per_step"]
            lines.append(f"| {LABELS[model]} | {_f(ms['hand'], 4)} | {_f(ms['fit'], 4)} | "
                         f"{_f(ms['fit_nonorm'], 4)} | {_target_cell(d['target'])} | "
                         f"{_target_cell(d['norms_target'])} |")
        lines.append("")
    if report.get("ablation"):
        lines += ["## Ablation of fit's per-step parts (arrays)", "",
                  "fit paired with fit minus one part (its source rewritten: `ABLATIONS` in "
                  "bench.py); speedup = stubbed steady steps/s / fit's, the median of the "
                  "within-pair ratios [min–max]; us/step = 1e6 (1/fit rate - 1/stubbed rate), "
                  "the median over pairs: what the part costs a step; host us/step: the main "
                  "thread's CPU time a step (fit's minus the stubbed run's, over the steady "
                  "window between the first and the last log point), unmoved by the machine's "
                  "load.", "",
                  "| model | part stubbed | fit steps/s | stubbed steps/s | speedup | us/step "
                  "| host CPU us/step [min–max] |", "|---|---|---|---|---|---|---|"]
        for model, parts in report["ablation"].items():
            ranked = sorted(parts.items(), key=lambda kv: -(kv[1]["us_per_step_saved"] or 0))
            for part, a in ranked:
                spread = a["speedup_range"]
                cell = _f(a["speedup"], 3, "x") + (f" [{spread[0]:.3f}–{spread[1]:.3f}]"
                                                   if spread else "")
                hr = a.get("host_us_range")
                host = _f(a.get("host_us_saved"), 1) + (f" [{hr[0]:.1f}–{hr[1]:.1f}]" if hr else "")
                lines.append(f"| {LABELS[model]} | {part} | {_f(a['fit_steps_per_s'], 0)} | "
                             f"{_f(a['stub_steps_per_s'], 0)} | {cell} | "
                             f"{_f(a['us_per_step_saved'], 1)} | {host} |")
        lines.append("")
    fails = [f"{_label(m)} {k}{_in_noise(t)}" for m, s in report["steady"].items()
             for k, t in s["targets"].items() if t[3] == "FAIL"]
    fails += [f"{LABELS[m]} whole call{_in_noise(w['target'])}" for m, w in report["whole"].items()
              if w["target"][3] == "FAIL"]
    fails += [f"{LABELS[m]} {label}{_in_noise(d[name])}" for m, d in report.get("per_step", {}).items()
              for name, label in (("target", "per step"), ("norms_target", "norms' cost"))
              if d[name][3] == "FAIL"]
    lines += [f"**Targets failed:** {', '.join(fails)}" if fails else "**All targets passed.**", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
