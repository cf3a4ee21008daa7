"""fit.py: a drop-in training loop for JAX + Flax, in one file you copy into your project.

    from fit import TrainState, lr_schedule, fit, load_ckpt

    lr_fn = lr_schedule(base_lr=1e-3, steps_per_epoch=len(train_ds), epochs=10, warmup_epochs=1)
    var = model.init(jax.random.key(0), x0, train=True)
    state = TrainState.create(apply_fn=model.apply, params=var["params"],
                              batch_stats=var.get("batch_stats", {}),
                              tx=optax.inject_hyperparams(optax.adam)(lr_fn))

    def loss_fn(logits, labels):     # -> scalar loss, or (scalar loss, {name: scalar})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, {"loss": loss}

    def eval_step(state, batch):     # -> scalar (logged as "accuracy") or {name: scalar},
        x, y = batch                 #    each a mean over the batch's examples
        variables = {"params": state.params, "batch_stats": state.batch_stats}
        logits = state.apply_fn(variables, x, train=False)
        return (logits.argmax(-1) == y).mean()

    state, history = fit(state, train_ds, test_ds, loss_fn=loss_fn, eval_step=eval_step,
                         num_epochs=10, log_name="mnist", hparams={"lr": 1e-3})

What you supply
- A `TrainState` (below): params, optimizer, `batch_stats` (empty without BatchNorm), `rng`.
- Data: `(x, y)` numpy arrays with `batch_size=`, or any iterable of `(inputs, targets)` batches
  (a list, a generator, `tfds.as_numpy(...)`, a torch-style loader). Dict batches need
  `batch_keys=("image", "label")`, or your own `train_step`/`eval_step`.
- `loss_fn(outputs, targets)`: the model is called as `apply_fn({"params", "batch_stats"}, inputs,
  train=True, mutable=["batch_stats"], rngs={"dropout": fold_in(rng, step)})` and its output goes
  to `loss_fn`. Any other model layout: pass `train_step(state, batch) -> (state, metrics)`.
- `eval_step(state, batch)`: per-batch means; fit weights them by batch size, so the logged
  metric is exactly the metric over the whole eval set.
- Or an nnx model with its `nnx.Optimizer`: `model, history = fit(model, train_ds, test_ds,
  optimizer=nnx.Optimizer(model, tx, wrt=nnx.Param), loss_fn=loss_fn, eval_step=eval_step)`.
  `loss_fn` gets `model(inputs)` in train mode, `eval_step(model, batch)` the model in eval mode
  (Dropout off, BatchNorm on its running statistics); dropout draws from the model's own
  `nnx.Rngs`. The model and the optimizer are updated in place.

What you get: data-parallel training on every device (a mesh over them, batches sharded, the
state replicated), a progress bar, TensorBoard scalars and hparams under `<workdir>/logs/<run>`,
orbax checkpoints (the last and the best) under `<workdir>/checkpoints/<run>`, exact resume with
`resume=True`, and `(state, history)` back. See README.md for every argument.
"""
import collections
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import re
import signal
import sys
import threading
import time
import types
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as _hparams_summaries
from tqdm.auto import tqdm

__all__ = ["TrainState", "lr_schedule", "fit", "load_ckpt", "History", "EarlyStopping", "Profiler"]


class TrainState(train_state.TrainState):
    """Flax's TrainState plus `batch_stats` (BatchNorm statistics, `{}` without BatchNorm) and
    `rng`, the base key of the run: step n draws its dropout key as `fold_in(rng, n)`, so no key
    is reused and randomness survives a resume. Left `None`, fit fills it from `seed` (and
    returns it as raw `uint32` key data, which orbax can save)."""
    batch_stats: Any = flax.struct.field(default_factory=dict)
    rng: Any = None


def lr_schedule(base_lr, steps_per_epoch, epochs, warmup_epochs=0, init_value=0.0, end_value=0.0):
    """Linear warmup from `init_value` (default 0) to `base_lr` over `warmup_epochs`, then a
    cosine decay that reaches `end_value` (default 0) exactly at the last step,
    `epochs * steps_per_epoch - 1`. Returns an optax schedule (step -> learning rate)."""
    for name, value in (("steps_per_epoch", steps_per_epoch), ("epochs", epochs)):
        _check_positive_int(name, value, "lr_schedule")
    if not (isinstance(warmup_epochs, (int, float)) and 0 <= warmup_epochs < epochs):
        raise ValueError(f"lr_schedule: warmup_epochs must be >= 0 and shorter than epochs, got "
                         f"warmup_epochs={warmup_epochs!r} and epochs={epochs!r}; lower "
                         f"warmup_epochs or raise epochs.")
    total = epochs * steps_per_epoch
    warmup = int(round(warmup_epochs * steps_per_epoch))
    # The cosine spans the steps after warmup up to the last step, so it reaches end_value at
    # step total-1 (a common bug is to decay over `total` and stop one step short, or to decay
    # over the whole run and finish warmup on a schedule that has already started decaying).
    decay_steps = max(total - 1 - warmup, 1)
    cosine = optax.cosine_decay_schedule(base_lr, decay_steps, alpha=end_value / base_lr if base_lr else 0.0)
    if warmup == 0:
        return cosine
    linear = optax.linear_schedule(init_value, base_lr, warmup)
    return optax.join_schedules([linear, cosine], [warmup])


class History(dict):
    """`fit`'s history: a dict of lists (`epoch`, `step`, `train/<metric>` per epoch;
    `eval/epoch`, `eval/step`, `eval/<metric>` per eval; `stopped`: why a run stopped early),
    plus attributes: the run's directories `run`, `log_dir`, `ckpt_dir`, and `timing` (seconds
    spent compiling, evaluating and blocked in saves, and the steady train rate without them)."""
    run = log_dir = ckpt_dir = timing = None


def fit(state, train_ds, test_ds=None, *, loss_fn=None, eval_step=None, num_epochs=1,
        eval_freq=1, log_every=50, log_name="run", workdir=None, hparams=None, seed=0,
        resume=False, monitor=None, mode="auto", max_to_keep=1, lr_fn=None, batch_size=None,
        train_step=None, batch_keys=None, ckpt_every=None, max_steps=None, steps_per_epoch=None,
        eval_every=None, eval_steps=None, steps_per_jit=1, hooks=(), on_nonfinite="raise",
        mesh=None, state_sharding=None, axis_name=None, optimizer=None):
    """Trains `state` (a TrainState, or an nnx model with `optimizer=`) on `train_ds` and returns
    `(state, history)`. README.md documents every argument; the defaults are the signature's."""
    # 1. Check everything that can be checked before touching the disk or compiling.
    _check_options(locals())
    mesh = mesh or Mesh(np.array(jax.devices()), ("data",))
    if axis_name:  # a model written for pmap calls lax.pmean(..., axis_name): name the data axis so
        mesh = Mesh(mesh.devices, tuple(axis_name if a == "data" else a for a in mesh.axis_names))
    data_axis = axis_name or "data"
    replicated = NamedSharding(mesh, P())
    custom = train_step is not None
    train = _Data(train_ds, "train_ds", batch_size, True, seed, batch_keys, custom, steps_per_epoch)
    test = test_ds if test_ds is None else _Data(test_ds, "test_ds", batch_size, False, seed,
                                                 batch_keys, eval_step is not None, eval_steps)
    _check_batching(train, test, batch_size, mesh, data_axis)
    finish = lambda state: state
    if _is_nnx(state):  # an nnx model trains as a TrainState of its variables
        state, train_step, eval_step, finish = _nnx_adapter(state, optimizer, loss_fn, eval_step)
    if jax.process_count() > 1 and train.length is None and not (steps_per_epoch or max_steps):
        raise ValueError("fit: with several processes, a train_ds without len() (a generator) needs "
                         "steps_per_epoch= or max_steps=, so that every process runs the same steps.")
    _check_processes_agree(train, test)
    state = _prepare_state(state, seed, _state_shardings(state, state_sharding, mesh))
    placement = (jax.tree.map(lambda x: x.sharding, state), replicated)  # (state, metric sums)
    lr_of = _lr_getter(state, lr_fn)
    step_fn = train_step or _default_train_step(loss_fn, axis_name)
    if axis_name:  # the step runs per device; the default step averages gradients and metrics
        step_fn = jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P(axis_name)),
                                out_specs=(P(), P()), check_vma=False)
    # The steps are jitted on their own as well, so that the first real call reuses the trace
    # `_trace` makes to learn the metric names (tracing a model again cost 0.1-0.2 s a run).
    step_fn, eval_step = jax.jit(step_fn), jax.jit(eval_step or _default_eval_step(loss_fn))
    names = []  # the train metrics, in the order of the accumulator's vectors (set when traced)
    one_step = functools.partial(_train_and_accumulate, step_fn, lr_of, on_nonfinite, names)
    train_fn = jax.jit(one_step, donate_argnums=0, out_shardings=placement)
    # k steps per call: a scan over a stacked group of k batches. XLA's CPU backend runs a rolled
    # scan of convolutions ~10x slower than single steps, and an unrolled one ~1.2x faster.
    train_k = jax.jit(lambda state, acc, batches: jax.lax.scan(
        lambda carry, b: (one_step(*carry, b), None), (state, acc), batches,
        unroll=jax.default_backend() == "cpu")[0], donate_argnums=0, out_shardings=placement)
    acc0 = jax.device_put(_zeros(_trace(train_fn, state, train.spec)[1]), replicated)
    evaluate, eval_names = None, []
    if test is not None:
        eval_fn = jax.jit(functools.partial(_eval_and_accumulate, eval_step), out_shardings=replicated)
        eval0 = jax.device_put(_zeros(_trace(eval_fn, state, test.spec)), replicated)
        eval_names = list(eval0["sum"])
        evaluate = functools.partial(_evaluate, eval_fn, eval0, test)
    train_names = [k for k in names if k != "parameters"]
    monitor, mode = _pick_monitor(monitor, mode, train_names, eval_names)
    spe = steps_per_epoch or train.length
    total = min([n for n in (spe and spe * num_epochs, max_steps) if n], default=None)

    # 2. The run: its directories, checkpoints and logs. A resumed run restores its last state.
    workdir = os.path.abspath(workdir or os.getcwd())
    _check_writable(workdir)
    run, restored = _pick_run(workdir, log_name, resume)
    history = History()
    history.run, history.log_dir, history.ckpt_dir = (run, os.path.join(workdir, "logs", run),
                                                      os.path.join(workdir, "checkpoints", run))
    put = functools.partial(_put, mesh, replicated, data_axis)
    loop = _Loop(types.SimpleNamespace(**locals()), _manager(history.ckpt_dir, monitor, mode, max_to_keep))
    if loop.finished():
        loop.close()
        _say(loop.lead, f"fit: run {run} already finished at step {loop.step}; nothing to do.")
        return finish(loop.state), history
    used = {"num_epochs": num_epochs, "batch_size": train.batch_size * jax.process_count(), "devices": mesh.size,
            "seed": seed, "steps_per_epoch": spe, "max_steps": max_steps,
            "steps_per_jit": steps_per_jit, "monitor": monitor,
            **(hparams or {})}
    loop.open_logs(used, eval_names, total)
    _say(loop.lead, f"fit: {'resuming' if loop.step else 'starting'} run {run!r} at step "
                    f"{loop.step} on {mesh.size} device(s); TensorBoard: tensorboard --logdir "
                    f"{os.path.join(workdir, 'logs')}")
    if lr_of is None:
        _say(loop.lead, "fit: the learning rate is not logged: use optax.inject_hyperparams or pass lr_fn=.")

    # 3. The loop. Nothing on the per-step path reads a device value: metrics are summed on
    # device and fetched at log points from a step that has already finished.
    try:
        with loop.signals:
            loop.hook("train_start")
            while not loop.finished():
                loop.logger.start_epoch(loop.epoch, num_epochs)
                batches = _grouped(train.epoch(loop.epoch, loop.batch, loop.meta["data_state"]),
                                   steps_per_jit, loop.step, max_steps)
                for batch, data_state, k in _prefetch(batches, put):
                    # Checkpoints, step-based evals and stops come before the next batch is
                    # trained, so the saved position (`loop.batch`, `data_state`) is exact.
                    if loop.before_batch(data_state):
                        break
                    loop.train(train_fn if k == 1 else train_k, batch, k)
                else:
                    loop.end_epoch(complete=True)
                    continue
                break  # a stop or max_steps inside an epoch
            loop.end()
    finally:
        loop.close()
    history.timing = loop.logger.timing(loop.step)
    if loop.signals.reason in ("SIGTERM", "preemption"):
        raise SystemExit(128 + signal.SIGTERM)  # 143: what schedulers expect after SIGTERM
    return finish(loop.state), history


def load_ckpt(state, ckpt_dir, step=None, optimizer=None):
    """Restores a state saved by `fit` from a run's checkpoint directory
    (`<workdir>/checkpoints/<run>`, also `history.ckpt_dir`). `step` is a step number,
    `"last"`/`None` (the latest) or `"best"`. `state` gives the structure, shapes and
    shardings; its values are not used. An nnx model (with its `optimizer=`) is restored in
    place, and returned."""
    if _is_nnx(state):
        adapted, _, _, finish = _nnx_adapter(state, optimizer, None, None)
        return finish(load_ckpt(adapted, ckpt_dir, step))
    if optimizer is not None:
        raise ValueError("load_ckpt: optimizer= is for nnx models; a TrainState carries its own (tx).")
    ckpt_dir = os.path.abspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"load_ckpt: no checkpoint directory at {ckpt_dir}.")
    mgr = _open(ckpt_dir, ocp.CheckpointManagerOptions(create=False))
    try:
        steps = mgr.all_steps()
        if not steps:
            raise FileNotFoundError(f"load_ckpt: {ckpt_dir} holds no complete checkpoint.")
        if step in (None, "last"):
            step = max(steps)
        elif step == "best":
            meta = mgr.restore(max(steps), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            step = max(steps) if meta["best_step"] is None else meta["best_step"]
            if step not in steps:
                raise FileNotFoundError(f"load_ckpt: the best step {step} is no longer in {ckpt_dir} "
                                        f"(it holds {sorted(steps)}); load one of those steps.")
        elif step not in steps:
            raise ValueError(f"load_ckpt: step {step!r} is not in {ckpt_dir}; it holds steps "
                             f"{sorted(steps)} (or pass 'last' or 'best').")
        sharding = jax.tree.map(lambda x: getattr(x, "sharding", None), state)
        placed = _prepare_state(state, 0, NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P()))
        if all(isinstance(s, jax.sharding.Sharding) for s in jax.tree.leaves(sharding)):
            placed = jax.device_put(placed, sharding)  # keep the caller's placement
        return _restore(mgr, step, placed)[0]
    finally:
        mgr.close()


class EarlyStopping:
    """A hook that stops training when `monitor` has not improved by more than `min_delta` for
    `patience` evaluations, and (with `restore_best`) returns the state of the best checkpoint.
    It watches fit's own `monitor` (the metric that picks the best checkpoint), so the state
    it restores is the one it judged best."""

    def __init__(self, patience=3, min_delta=0.0, restore_best=True, monitor=None):
        _check_positive_int("patience", patience, "EarlyStopping")
        self.patience, self.min_delta, self.restore_best, self.monitor = patience, min_delta, restore_best, monitor

    def __call__(self, event, run):
        if event == "train_start":
            if self.monitor not in (None, run.monitor):
                raise ValueError(f"EarlyStopping: monitor={self.monitor!r} differs from fit's "
                                 f"monitor={run.monitor!r}, which picks the checkpoint to restore; "
                                 f"pass monitor={self.monitor!r} to fit instead.")
            self.best, self.bad = None, 0
        elif event in ("eval", "epoch_end") and run.monitor in run.metrics:
            value = run.metrics[run.monitor] * (1 if run.mode == "max" else -1)
            if self.best is None or value > self.best + self.min_delta:
                self.best, self.bad = value, 0
            else:
                self.bad += 1
                run.stop = self.bad >= self.patience
        elif event == "train_end" and self.restore_best and run.stopped_early:
            run.state = load_ckpt(run.state, run.ckpt_dir, "best")


class Profiler:
    """A hook that traces steps `start_step` to `start_step + num_steps` with `jax.profiler`
    into the run's TensorBoard directory (TensorBoard's Profile tab; `pip install
    tensorboard-plugin-profile`). Hooks run at log points, so the window is rounded out to them:
    pick `log_every` to suit."""

    def __init__(self, start_step=10, num_steps=20):
        self.start_step, self.stop_step, self.running = start_step, start_step + num_steps, False

    def __call__(self, event, run):
        if not self.running and self.start_step <= run.step < self.stop_step and event != "train_end":
            jax.profiler.start_trace(run.log_dir)
            self.running = True
        elif self.running and (run.step >= self.stop_step or event == "train_end"):
            jax.block_until_ready(run.state)  # include the queued steps in the trace
            jax.profiler.stop_trace()
            self.running = False


# ----------------------------------------------------------------------------------------------
# Device code: everything below up to the host helpers runs inside jax.jit.

def _default_train_step(loss_fn, axis_name=None):
    """The step of the template users know: one forward pass in train mode, one update. With
    `axis_name` it runs on each device's share of the batch (under shard_map) and averages the
    gradients and metrics over the devices, as pmap-era code did."""
    def train_step(state, batch):
        inputs, targets = batch
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if axis_name:  # each device draws its own dropout masks
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
        has_bs = bool(jax.tree.leaves(state.batch_stats))

        def loss_of(params):
            variables = {"params": params, **({"batch_stats": state.batch_stats} if has_bs else {})}
            kwargs = {"mutable": ["batch_stats"]} if has_bs else {}
            out = state.apply_fn(variables, inputs, train=True, rngs={"dropout": rng}, **kwargs)
            out, updates = out if has_bs else (out, {})
            loss, metrics = _split_loss(loss_fn(out, targets))
            return loss, (metrics, updates)

        (loss, (metrics, updates)), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        if axis_name:
            grads, loss, metrics = jax.lax.pmean((grads, loss, metrics), axis_name)
        norms = {"grad_norm": optax.tree.norm(grads)}  # (param_norm: _train_and_accumulate's)
        state = state.apply_gradients(grads=grads)
        if has_bs:
            state = state.replace(batch_stats=updates["batch_stats"])
        return state, {"loss": loss, **metrics, **norms}
    return train_step


def _default_eval_step(loss_fn):
    """Without an eval_step, eval reports loss_fn's loss and metrics in inference mode."""
    def eval_step(state, batch):
        inputs, targets = batch
        has_bs = bool(jax.tree.leaves(state.batch_stats))
        variables = {"params": state.params, **({"batch_stats": state.batch_stats} if has_bs else {})}
        loss, metrics = _split_loss(loss_fn(state.apply_fn(variables, inputs, train=False), targets))
        return {"loss": loss, **metrics}
    return eval_step


def _nnx_adapter(model, optimizer, loss_fn, eval_step):
    """Runs an nnx model and its `nnx.Optimizer` as a TrainState, so the loop, sharding,
    checkpoints, resume and logging work unchanged. `params` holds what the optimizer trains
    (its `wrt`), `batch_stats` every other variable (BatchNorm statistics, the Rngs' keys and
    counts: checkpointed, so dropout resumes exactly), `opt_state` the optimizer's optax state,
    `step` its step. Each step merges them into a fresh module inside plain `jax.jit` (nnx.jit
    costs ~0.3 ms more a call) and splits it again; the user's objects are only written by
    `finish(state)`, which updates `model` and `optimizer` in place and returns `model`.
    Returns `(state, train_step, eval_step, finish)`."""
    from flax import nnx
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"fit: an nnx model needs optimizer=nnx.Optimizer(model, tx, "
                        f"wrt=nnx.Param), got optimizer={optimizer!r}.")
    # Plain dicts, not nnx.State: jit flattens the state on every call, and State is a pytree
    # registered in Python (twice as slow to flatten as dicts). Typed PRNG keys travel as raw
    # uint32 data, like fit's own rng: orbax writes a key as its data, which restores as no key.
    is_state = lambda x: isinstance(x, nnx.State)
    pure = lambda tree: jax.tree.map(lambda x: nnx.to_pure_dict(x) if is_state(x) else x,
                                     nnx.as_pure(tree), is_leaf=is_state)
    as_data = lambda tree: jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x,
                                        pure(tree))
    nnx.pop(model, nnx.Intermediate)  # sow()n values are per call outputs, not state to carry
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
    impls = [jax.random.key_impl(x) if _is_key(x) else None for x in jax.tree.leaves(pure(rest))]

    def as_keys(rest):
        leaves, treedef = jax.tree.flatten(rest)
        return treedef.unflatten([x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                                  for x, impl in zip(leaves, impls)])

    state = TrainState(step=optimizer.step[...], apply_fn=None, params=pure(params), tx=optimizer.tx,
                       opt_state=pure(optimizer.opt_state), batch_stats=as_data(rest))
    try:
        jax.eval_shape(state.tx.update, state.params, state.opt_state, state.params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"fit: the optimizer's state does not fit the model's parameters; build "
                         f"it from this model: nnx.Optimizer(model, tx, wrt=nnx.Param). "
                         f"({e})") from None

    def merged(params, rest, train):
        model = nnx.merge(graphdef, params, as_keys(rest))
        model.train() if train else model.eval()  # Dropout and BatchNorm read these flags
        return model

    def train_step(state, batch):
        # Dropout draws from the model's own Rngs (advanced per call, kept in batch_stats), not
        # from fit's `rng`; the update is `optimizer.update`'s: tx.update, then apply_updates.
        inputs, targets = batch

        def loss_of(params):
            model = merged(params, state.batch_stats, train=True)
            loss, metrics = _split_loss(loss_fn(model(inputs), targets))
            nnx.pop(model, nnx.Intermediate)
            return loss, (metrics, as_data(nnx.state(model, nnx.Not(optimizer.wrt))))

        (loss, (metrics, rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        norms = {"grad_norm": optax.tree.norm(grads)}
        state = state.apply_gradients(grads=grads, batch_stats=rest)
        return state, {"loss": loss, **metrics, **norms}

    def eval_fn(state, batch):
        model = merged(state.params, state.batch_stats, train=False)
        if eval_step is not None:
            return eval_step(model, batch)
        loss, metrics = _split_loss(loss_fn(model(batch[0]), batch[1]))
        return {"loss": loss, **metrics}

    def finish(state):
        nnx.update(model, state.params, as_keys(state.batch_stats))
        nnx.update(optimizer.opt_state, nnx.state(state.opt_state))
        optimizer.step[...] = state.step
        return model

    return state, train_step, eval_fn, finish


def _split_loss(out):
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"fit: loss_fn must return a scalar float loss (or (loss, metrics)), got "
                        f"an array of shape {loss.shape} and dtype {loss.dtype}; reduce it with "
                        f".mean().")
    if not isinstance(metrics, dict):
        raise TypeError(f"fit: loss_fn's second output must be a dict of scalar metrics, got "
                        f"{type(metrics).__name__}.")
    return loss, metrics


def _scalars(metrics, who):
    """Checks a step's metrics and casts them to float32 scalars."""
    if not isinstance(metrics, dict):
        metrics = {"accuracy": metrics} if who == "eval_step" else {"loss": metrics}
    out = {}
    for name, value in metrics.items():
        value = jnp.asarray(value)
        if value.shape != ():
            raise TypeError(f"fit: {who} must return scalars (per-batch means), but metric "
                            f"{name!r} has shape {value.shape}; reduce it with .mean().")
        out[name] = value.astype(jnp.float32)
    return out


def _train_and_accumulate(step_fn, lr_of, on_nonfinite, names, state, acc, batch):
    """One train step plus the on-device bookkeeping: metric sums since the last log point, a
    count of steps whose loss or parameters are not finite, and the learning rate. The metrics
    travel as one vector (their names go to `names` when this is traced): on XLA's CPU backend
    every extra small op and output costs microseconds a step, which a tiny model feels."""
    new_state, metrics = step_fn(state, batch)
    metrics = _scalars(metrics, "train_step")
    # The norm of the new parameters is NaN/Inf whenever any of them is (an isfinite per array
    # compiled ~25% slower on a CNN), and is logged as param_norm unless the step has its own.
    norm = optax.tree.norm(new_state.params)
    metrics.setdefault("param_norm", norm)
    checked = {**metrics, **({} if metrics["param_norm"] is norm else {"parameters": norm})}
    names[:] = checked
    values = jnp.stack(list(checked.values()))
    bad = ~jnp.isfinite(values)
    finite = ~jnp.any(bad)
    if on_nonfinite == "skip":  # keep the old state on device, no host round trip; the step
        new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, state)  # counts on
        new_state = new_state.replace(step=state.step + 1)
        values = jnp.where(finite, values, 0.0)
    # Outputs keep the inputs' dtypes and weak types, so the next call hits the same compilation.
    new_state = jax.tree.map(lambda n, o: jnp.asarray(n, o.dtype), new_state, state)
    if acc is None:
        acc = {"sum": jnp.zeros_like(values), "bad_by": jnp.zeros(bad.shape, jnp.int32),
               "count": jnp.zeros(3, jnp.int32), "lr": jnp.float32(0)}
    n, n_bad, first_bad = acc["count"]
    lr = acc["lr"] if lr_of is None else jnp.asarray(lr_of(new_state), jnp.float32)
    return new_state, {
        "sum": acc["sum"] + values,  # (the checked extra, if any, is summed too; never logged)
        "bad_by": acc["bad_by"] + bad,
        "count": jnp.stack([n + (finite | (on_nonfinite == "raise")), n_bad + ~finite,
                            jnp.where((n_bad == 0) & ~finite, state.step.astype(jnp.int32), first_bad)]).astype(jnp.int32),
        "lr": lr,
    }


def _unpack(acc, names):
    """The host's view of a fetched train accumulator: named sums and counts."""
    n, n_bad, first_bad = (int(v) for v in acc["count"])
    return {"sum": {k: float(v) for k, v in zip(names, acc["sum"]) if k != "parameters"},
            "bad_by": {k: int(v) for k, v in zip(names, acc["bad_by"])},
            "n": n, "bad": n_bad, "first_bad": first_bad, "lr": float(acc["lr"])}


def _eval_and_accumulate(eval_step, state, acc, batch):
    """Adds one eval batch's metrics, weighted by its size, to the running sums."""
    metrics = _scalars(eval_step(state, batch), "eval_step")
    n = jax.tree.leaves(batch)[0].shape[0]
    if acc is None:
        acc = {"sum": {k: jnp.float32(0) for k in metrics}, "n": jnp.float32(0)}
    return {"sum": {k: acc["sum"][k] + v * n for k, v in metrics.items()}, "n": acc["n"] + n}


# ----------------------------------------------------------------------------------------------
# Host code: data, placement, checkpoints, logging.

def _zeros(tree):
    # numpy, placed by the caller: jnp.zeros compiles an eager op for each new shape (20-50 ms
    # each on CPU, a few per run).
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)


class _Data:
    """Turns a data argument into per-epoch iterators of `(batch, data_state)` on the host.

    Arrays `(x, y)` are batched here and shuffled from `(seed, epoch)`. A re-iterable (list,
    loader) is iterated once per epoch. A one-shot iterator (generator) is read as one stream:
    with `steps_per_epoch` each epoch takes that many batches from it, else it is one epoch.
    """

    def __init__(self, ds, name, batch_size, shuffle, seed, batch_keys, custom, steps_per_epoch):
        self.name, self.shuffle, self.seed, self.keys, self.custom = name, shuffle, seed, batch_keys, custom
        # (x, y): two arrays, or anything np.asarray takes that has a shape (torch, tf tensors)
        self.arrays = isinstance(ds, (tuple, list)) and len(ds) == 2 and all(
            hasattr(a, "__array__") and len(getattr(a, "shape", ())) > 0 for a in ds)
        self.steps_per_epoch = steps_per_epoch
        if self.arrays:
            if batch_size is None:
                raise ValueError(f"fit: {name} is a pair of arrays (x, y); pass batch_size= so fit "
                                 f"can batch them.")
            x, y = (np.asarray(a) for a in ds)
            if len(x) != len(y) or len(x) == 0:
                raise ValueError(f"fit: {name} must be two non-empty arrays with the same number of "
                                 f"examples, got {len(x)} inputs and {len(y)} targets.")
            self.x, self.y = x, y
            self.length = math.ceil(len(x) / batch_size)
            if steps_per_epoch:
                self.length = min(self.length, steps_per_epoch)
            first = self._convert((x[:batch_size], y[:batch_size]), 0)
            self.sizes = [min(batch_size, len(x) - i * batch_size) for i in range(self.length)]
        else:
            if hasattr(ds, "set_epoch"):
                ds.set_epoch(0)
            try:
                iterator = iter(ds)
            except TypeError:
                raise TypeError(f"fit: {name} must be arrays (x, y) or an iterable of batches, got "
                                f"{type(ds).__name__}.") from None
            self.stream = iterator is ds  # a one-shot iterator: generators, tfds.as_numpy, ...
            self.fresh = True
            position = None if self.stream else _position(iterator)
            try:
                raw = next(iterator)
            except StopIteration:
                raise ValueError(f"fit: {name} is empty: it yielded no batches.") from None
            # Epoch 0 goes on from this iterator: a loader with workers (torch, grain) starts
            # them at each iter(), which can take seconds.
            self.peeked = None if self.stream else (iterator, [(raw, position)])
            first = self._convert(raw, 0)
            self.sizes = None
            if isinstance(ds, (list, tuple)):  # in memory already: check every batch up front
                self.spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), first)
                self.sizes = [jax.tree.leaves(first)[0].shape[0]] + [
                    jax.tree.leaves(self._convert(raw, i))[0].shape[0] for i, raw in enumerate(ds[1:], 1)]
            if self.stream:
                self.ds = itertools.chain([raw], iterator)
            else:
                self.ds = ds
            self.length = len(ds) if hasattr(ds, "__len__") and not self.stream else None
        self.spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), first)
        self.batch_size = jax.tree.leaves(first)[0].shape[0]

    def describe(self):
        """What every process must agree on: batches per epoch ('?': not known before
        iterating), how many of each size, and the first batch's shapes and dtypes."""
        sizes = ", ".join(f"{k} of {n}" for n, k in sorted(collections.Counter(self.sizes or []).items()))
        shapes = ", ".join(f"{s.shape} {s.dtype}" for s in jax.tree.leaves(self.spec))
        return (f"{self.name}: {'?' if self.length is None else self.length} batches"
                f"{f' ({sizes} rows)' if sizes else ''} shaped {shapes}")

    def _convert(self, batch, index):
        """A host batch as numpy arrays, with a clear error for anything else."""
        if isinstance(batch, dict) and self.keys is not None:
            missing = [k for k in self.keys if k not in batch]
            if missing:
                raise KeyError(f"fit: batch_keys {self.keys!r} name keys missing from {self.name}'s "
                               f"batches, which have keys {sorted(batch)}.")
            batch = (batch[self.keys[0]], batch[self.keys[1]])
        elif isinstance(batch, dict) and not self.custom:
            raise TypeError(f"fit: {self.name} yields dict batches with keys {sorted(batch)}; say "
                            f"which are inputs and targets with batch_keys=(inputs_key, "
                            f"targets_key), or pass your own train_step/eval_step.")
        if not self.custom and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"fit: {self.name} must yield (inputs, targets) pairs, but batch "
                            f"{index} is a {type(batch).__name__}"
                            f"{f' of length {len(batch)}' if hasattr(batch, '__len__') else ''}.")
        batch = jax.tree.map(np.asarray, tuple(batch) if isinstance(batch, list) else batch)
        leaves = jax.tree.leaves(batch)
        if not leaves or any(a.ndim == 0 for a in leaves) or len({a.shape[0] for a in leaves}) != 1:
            raise ValueError(f"fit: every array in a batch of {self.name} needs the same leading "
                             f"(batch) dimension; batch {index} has shapes "
                             f"{[a.shape for a in leaves]}.")
        spec = getattr(self, "spec", None)
        if spec is not None:
            same = jax.tree.structure(batch) == jax.tree.structure(spec) and all(
                a.shape[1:] == s.shape[1:] and a.dtype == s.dtype
                for a, s in zip(leaves, jax.tree.leaves(spec)))
            if not same:
                raise ValueError(f"fit: batch {index} of {self.name} has shapes/dtypes "
                                 f"{[(a.shape, str(a.dtype)) for a in leaves]}, unlike the first "
                                 f"batch's {[(s.shape, str(s.dtype)) for s in jax.tree.leaves(spec)]}; "
                                 f"only the batch size may change.")
        return batch

    def epoch(self, epoch, skip=0, data_state=None):
        """Yields `(batch, data_state)` for one epoch, skipping the first `skip` batches (already
        trained on before a resume) without converting or placing them."""
        if self.arrays:
            n = len(self.x)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            for i in range(skip, self.length):
                idx = order[i * self.batch_size:(i + 1) * self.batch_size]  # (the first batch's size)
                if self.shuffle:
                    idx = np.sort(idx)  # contiguous reads are faster; the set is what is random
                yield (self.x[idx], self.y[idx]), None
            return
        if self.stream:
            # A resumed stream restarts at its beginning: drop what earlier epochs and this one
            # already consumed (exact when the stream is deterministic).
            drop = skip + (epoch * self.steps_per_epoch if self.steps_per_epoch else 0)
            iterator = itertools.islice(self.ds, drop if self.fresh else skip, None)
            if self.steps_per_epoch:
                iterator = itertools.islice(iterator, self.steps_per_epoch - skip)
            self.fresh = False
            for i, raw in enumerate(iterator, skip):
                yield self._convert(raw, i), None
            return
        peeked, self.peeked = self.peeked, None
        if peeked and not (epoch or skip):
            iterator, first = peeked
        else:
            if hasattr(self.ds, "set_epoch"):
                self.ds.set_epoch(epoch)
            iterator, first = iter(self.ds), []
            if data_state is not None and skip and hasattr(iterator, "set_state"):
                iterator.set_state(data_state["bytes"].encode() if "bytes" in data_state else data_state["state"])
            else:
                for _ in range(skip):  # (not islice: that would hide get_state)
                    next(iterator, None)

        def positioned():
            while True:
                # The iterator's state is taken before the batch is fetched: it is the position
                # to restore if this batch was not yet trained on when a checkpoint is written.
                position = _position(iterator)
                try:
                    raw = next(iterator)
                except StopIteration:
                    return
                yield raw, position
        limit = (self.steps_per_epoch - skip) if self.steps_per_epoch else None
        for i, (raw, position) in enumerate(itertools.islice(itertools.chain(first, positioned()), limit), skip):
            yield self._convert(raw, i), position


def _position(iterator):
    """A resumable (grain) iterator's state as JSON for the checkpoint, else None; grain's
    DataLoader gives bytes of JSON."""
    if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
        return None
    state = iterator.get_state()
    if isinstance(state, bytes):
        return {"bytes": state.decode()}
    return {"state": _jsonable(state)}


def _grouped(batches, k, step, max_steps=None):
    """Stacks runs of `k` equally shaped batches for `steps_per_jit`. Groups start at multiples
    of k in absolute steps, so a resumed run groups (and so rounds) exactly like the original;
    batches before the first such step, a smaller last batch and an epoch's remainder run as
    single steps. Yields `(batch, data_state, steps)`."""
    group = []
    for batch, data_state in batches:
        if k > 1 and (group or (step % k == 0 and not (max_steps and step + k > max_steps))):
            if group and jax.tree.structure(batch) == jax.tree.structure(group[0][0]) and all(
                    a.shape == b.shape for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(group[0][0]))):
                group.append((batch, data_state))
            elif not group:
                group = [(batch, data_state)]
            else:  # a batch of another shape ends the group early: run it all as single steps
                yield from ((b, s, 1) for b, s in group + [(batch, data_state)])
                step += len(group) + 1
                group = []
                continue
            if len(group) == k:
                yield jax.tree.map(lambda *xs: np.stack(xs), *[b for b, _ in group]), group[0][1], k
                step += k
                group = []
            continue
        yield batch, data_state, 1
        step += 1
    yield from ((b, s, 1) for b, s in group)


def _crossed(before, after, every):
    """Whether the steps in (before, after] include a multiple of `every`."""
    return after // every > before // every


def _prefetch(batches, put, size=2):
    """Places the next `size` batches on device while the current step runs (transfers are
    asynchronous, so this overlaps them with compute)."""
    queue = collections.deque()
    for batch, data_state, *rest in batches:
        queue.append((put(batch, len(rest) and rest[0] > 1), data_state, *rest))
        if len(queue) > size:
            yield queue.popleft()
    while queue:
        yield queue.popleft()


def _put(mesh, replicated, data_axis, batch, stacked=False):
    """Shards a host batch along its leading axis over the mesh. A batch that does not split
    evenly (a small last batch) is placed whole on every device instead: each device computes the
    same full batch, so results stay exact at the cost of redundant work on that one batch."""
    if mesh.size == 1 and jax.process_count() == 1 and mesh.devices.flat[0].platform == "cpu":
        return batch  # one CPU device: jit's own C++ path takes numpy faster than device_put
    n = jax.tree.leaves(batch)[0].shape[int(stacked)]
    spec = P(None, data_axis) if stacked else P(data_axis)  # a stack of k: shard each batch
    sharding = NamedSharding(mesh, spec) if n % _local_shards(mesh, data_axis) == 0 else replicated
    if jax.process_count() > 1:
        if sharding is replicated:  # every device needs the whole global batch: gather all
            batch = jax.tree.map(  # processes' rows (a host round trip, for one batch an epoch)
                lambda a: np.concatenate(a, axis=int(stacked)), multihost_utils.process_allgather(batch))
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), batch)
    return jax.device_put(batch, sharding)


def _evaluate(eval_fn, acc, test, state, put):
    """Metrics over the whole eval set: sums weighted by batch size, fetched once at the end."""
    for batch, _ in _prefetch(test.epoch(0), put):
        acc = eval_fn(state, acc, batch)
    acc = jax.device_get(acc)
    if not acc["n"]:
        raise ValueError("fit: test_ds yielded no batches; a generator can be iterated only once: "
                         "pass a list or a re-iterable loader.")
    return {k: float(v) / float(acc["n"]) for k, v in acc["sum"].items()}


def _state_shardings(state, state_sharding, mesh):
    """Where each leaf of the state lives: replicated by default, else `state_sharding` (a tree
    like the state, or a function of it, of PartitionSpecs or shardings; e.g. from
    `flax.linen.get_partition_spec`), with specs laid over `mesh`."""
    if state_sharding is None:
        return NamedSharding(mesh, P())
    tree = state_sharding(state) if callable(state_sharding) else state_sharding
    is_leaf = lambda x: x is None or isinstance(x, (P, jax.sharding.Sharding))
    to_sharding = lambda s: s if isinstance(s, jax.sharding.Sharding) else NamedSharding(mesh, s or P())
    try:
        return jax.tree.map(to_sharding, tree, is_leaf=is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(f"fit: state_sharding must be a tree like the state (or a function of "
                         f"it) of PartitionSpecs or shardings: {e}") from None


def _prepare_state(state, seed, sharding):
    """A private, placed copy of the caller's state with stable dtypes.

    The copy keeps the caller's arrays alive although the step donates its input. Every leaf gets
    a strong dtype (`TrainState.create` makes a weakly-typed int step, orbax restores a strong
    one), so a fresh and a restored state hit the same compilation.
    """
    if not isinstance(state, TrainState):
        state = TrainState(step=state.step, apply_fn=state.apply_fn, params=state.params,
                           tx=state.tx, opt_state=state.opt_state,
                           batch_stats=getattr(state, "batch_stats", {}) or {},
                           rng=getattr(state, "rng", None))
    rng = jax.random.key(seed) if state.rng is None else state.rng
    rng = jnp.asarray(jax.random.key_data(rng) if _is_key(rng) else rng, jnp.uint32)
    state = state.replace(rng=rng, batch_stats=state.batch_stats or {})
    # Weak types and non-jax leaves (Python and numpy scalars) become strong numpy values.
    state = jax.tree.map(lambda x: x if isinstance(x, jax.Array) and not x.weak_type
                         else np.asarray(x), state)
    # The transfer makes the copy (a jnp copy compiled an eager op per leaf shape: ~13 MB more
    # peak memory on a small CNN). Onto several devices it still reuses the caller's buffer as
    # one shard of a replicated array (jax 0.10), which donation would delete: copy those again.
    placed = jax.device_put(state, sharding, may_alias=False)
    return jax.tree.map(lambda p, x: jnp.array(p, copy=True) if _aliases(p, x) else p, placed, state)


def _aliases(a, b):
    buffers = lambda x: {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    return isinstance(b, jax.Array) and bool(buffers(a) & buffers(b))


def _is_nnx(x):
    # flax.nnx is imported only where an nnx model is passed, and its user has imported it:
    # importing it for every run added ~0.3 s and ~9 MB of memory to runs that never use it.
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def _is_key(x):
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _lr_getter(state, lr_fn):
    """How to read, from the state after a step, the learning rate that step used: optax's
    `inject_hyperparams` stores it in the optimizer state; `lr_fn` gets the step's number."""
    if lr_fn is not None:
        return lambda s: lr_fn(s.step - 1)
    found = []

    def visit(node, path):
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, dict):
            for key in ("learning_rate", "lr"):
                if key in hp:
                    found.append(path + ((key,),))
                    return
        if isinstance(node, (tuple, list)):
            for i, child in enumerate(node):
                visit(child, path + (i,))
    visit(state.opt_state, ())
    if not found:
        return None
    path = found[0]

    def get(s):
        node = s.opt_state
        for part in path:
            node = node.hyperparams[part[0]] if isinstance(part, tuple) else node[part]
        return node
    return get


def _pick_monitor(monitor, mode, train_names, eval_names):
    names = [f"train/{n}" for n in train_names] + [f"eval/{n}" for n in eval_names]
    if monitor is None:
        monitor = ("eval/accuracy" if "accuracy" in eval_names else
                   f"eval/{eval_names[0]}" if eval_names else "train/loss")
    if monitor not in names:
        raise ValueError(f"fit: monitor={monitor!r} is not a metric of this run; it has {names}.")
    if mode == "auto":
        lower_better = re.search(r"loss|err|perplexity|mse|mae|nll", monitor.lower())
        mode = "min" if lower_better else "max"
    return monitor, mode


def _check_options(args):
    """Checks fit's arguments that need no data: a clear message before any work starts."""
    for name in ("num_epochs", "eval_freq", "log_every", "max_to_keep", "steps_per_jit"):
        _check_positive_int(name, args[name])
    for name in ("ckpt_every", "max_steps", "steps_per_epoch", "eval_every", "eval_steps", "batch_size"):
        if args[name] is not None:
            _check_positive_int(name, args[name])
    for name, allowed in (("mode", ("auto", "min", "max")), ("on_nonfinite", ("raise", "skip"))):
        if args[name] not in allowed:
            raise ValueError(f"fit: {name} must be one of {allowed}, got {args[name]!r}.")
    if args["eval_every"] and args["eval_freq"] != 1:
        raise ValueError(f"fit: eval_every={args['eval_every']} (steps) and eval_freq="
                         f"{args['eval_freq']} (epochs) contradict each other; pass one of them.")
    if args["train_step"] is None and args["loss_fn"] is None:
        raise ValueError("fit: pass loss_fn(outputs, targets)" + (
            "." if _is_nnx(args["state"]) else " (or your own train_step)."))
    for name in ("loss_fn", "eval_step", "train_step", "lr_fn"):
        if args[name] is not None and not callable(args[name]):
            raise TypeError(f"fit: {name} must be a function, got {type(args[name]).__name__}.")
    if not isinstance(args["hooks"], (list, tuple)) or not all(callable(h) for h in args["hooks"]):
        raise TypeError(f"fit: hooks must be a list of functions hook(event, run), got {args['hooks']!r}.")
    if args["hparams"] is not None and not isinstance(args["hparams"], dict):
        raise TypeError(f"fit: hparams must be a dict of name -> value, got {type(args['hparams']).__name__}.")
    keys = args["batch_keys"]
    if keys is not None and not (isinstance(keys, (tuple, list)) and len(keys) == 2):
        raise ValueError(f"fit: batch_keys must be a pair (inputs_key, targets_key), got {keys!r}.")
    if not isinstance(args["log_name"], str) or not re.fullmatch(r"[\w.-]+", args["log_name"]):
        raise ValueError(f"fit: log_name must be a non-empty name of letters, digits, '_', '-' "
                         f"or '.', got {args['log_name']!r}.")
    state, mesh = args["state"], args["mesh"]
    if _is_nnx(state):
        for name in ("train_step", "axis_name"):
            if args[name] is not None:
                raise ValueError(f"fit: {name}= is for TrainState runs; an nnx model trains with "
                                 f"loss_fn(model(inputs), targets) and eval_step(model, batch).")
    elif args["optimizer"] is not None:
        raise ValueError("fit: optimizer= is for nnx models; a TrainState carries its own (tx).")
    elif getattr(state, "tx", None) is None or not hasattr(state, "apply_gradients"):
        raise ValueError(f"fit: state must be a TrainState with an optimizer (tx), got "
                         f"{type(state).__name__} with tx={getattr(state, 'tx', None)!r}; build it "
                         f"with TrainState.create(apply_fn=..., params=..., tx=optax.adam(...)), "
                         f"or pass an nnx model with optimizer=nnx.Optimizer(model, tx, wrt=nnx.Param).")
    if mesh is not None and "data" not in mesh.axis_names:
        raise ValueError(f"fit: mesh must have a 'data' axis to shard batches over, got axes "
                         f"{mesh.axis_names}.")


def _trace(fn, state, spec):
    """The output shapes of `fn(state, None, batch)`: checks the user's functions before any
    compile or directory, and turns pmap-only models' cryptic failure into advice."""
    try:
        return jax.eval_shape(fn, state, None, spec)
    except NameError as e:
        name = re.search(r"unbound axis name: ([\w-]+)", str(e))
        if not name:
            raise
        raise ValueError(f"fit: the model uses the named axis {name.group(1)!r} (e.g. "
                         f"BatchNorm(axis_name={name.group(1)!r}), written for pmap), which plain "
                         f"jit does not bind; pass axis_name={name.group(1)!r} to fit to run the step "
                         f"per device over that axis.") from None


def _check_batching(train, test, batch_size, mesh, data_axis):
    if batch_size is not None and not (train.arrays or (test is not None and test.arrays)):
        raise ValueError(f"fit: batch_size={batch_size} is only for array data (x, y), but train_ds "
                         f"and test_ds yield their own batches; drop batch_size.")
    n, d = train.batch_size, _local_shards(mesh, data_axis)
    if n % d:
        raise ValueError(f"fit: the train batch size ({n}) must be divisible by the number of "
                         f"devices ({d}) so every device gets an equal share; use a batch size of "
                         f"{n - n % d or d} or {n + d - n % d}. (Only a smaller last batch may "
                         f"split unevenly: it is run whole on every device.)")


def _check_processes_agree(*datas):
    """Every process must feed the same number of batches of the same shapes (its own share of
    each global batch). A mismatch hangs in the first collective it reaches, or silently trains
    on different global arrays on each process, so compare once, before the first step: every
    process sees the same table and raises the same error."""
    if jax.process_count() == 1:
        return
    mine = "; ".join(d.describe() for d in datas if d is not None).encode()
    row = np.zeros(32 + 2048, np.uint8)  # a digest to compare, the text (cut) to show
    row[:32] = np.frombuffer(hashlib.sha256(mine).digest(), np.uint8)
    row[32:32 + len(mine[:2048])] = np.frombuffer(mine[:2048], np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row))
    if (rows[:, :32] == rows[0, :32]).all():
        return
    listed = "\n  ".join(f"process {i}: {bytes(r[32:]).rstrip(bytes(1)).decode(errors='replace')}"
                         for i, r in enumerate(rows))
    raise ValueError(f"fit: the processes' data disagree:\n  {listed}\nEvery process must feed "
                     f"the same number of batches, of the same shapes (its own share of each global "
                     f"batch); otherwise the run hangs in a collective or trains on mismatched arrays.")


@functools.lru_cache(maxsize=None)
def _local_shards(mesh, axis):
    """Over how many slices of `axis` this process's devices split its rows of a batch (the
    whole axis in a single process)."""
    i = mesh.axis_names.index(axis)
    return len({idx[i] for idx in np.ndindex(mesh.devices.shape)
                if mesh.devices[idx].process_index == jax.process_index()})


def _check_positive_int(name, value, where="fit"):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")


def _check_writable(workdir):
    """Fails before any directory is made, on the nearest existing ancestor of `workdir`."""
    probe = workdir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise PermissionError(f"fit: workdir {workdir!r} cannot be used: {probe!r} {why}; pass "
                              f"workdir= a directory you can write to.")


def _pick_run(workdir, log_name, resume):
    """Run names are `<log_name>_<n>`. A fresh run takes the next free n, so it never touches an
    earlier run's files; `resume=True` takes the highest existing n, if any."""
    taken = set()
    for sub in ("logs", "checkpoints"):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.listdir(os.path.join(workdir, sub)):
                m = re.fullmatch(re.escape(log_name) + r"_(\d+)", entry)
                if m:
                    taken.add(int(m.group(1)))
    n, reuse, restored = max(taken, default=0) + 1, False, False
    if resume and taken:  # the latest run: from its checkpoint, or afresh if it saved none
        n, reuse = max(taken), True
        with contextlib.suppress(FileNotFoundError):
            restored = any(d.isdigit() for d in os.listdir(os.path.join(workdir, "checkpoints", f"{log_name}_{n}")))
    if jax.process_count() > 1:  # process 0's choice, by a collective that every process reaches
        n, reuse, restored = (int(v) for v in multihost_utils.broadcast_one_to_all(
            np.array([n, reuse, restored], np.int32)))
    if not reuse:
        for sub in ("logs", "checkpoints"):
            os.makedirs(os.path.join(workdir, sub, f"{log_name}_{n}"), exist_ok=True)
    return f"{log_name}_{n}", bool(restored)


def _manager(ckpt_dir, monitor, mode, max_to_keep):
    """Keeps exactly the latest checkpoint and the `max_to_keep` best by `monitor`.

    `best_fn` with `max_to_keep` alone would delete the latest step, and saves without metrics
    (mid-epoch ones) would be kept forever; two preservation policies do it right."""
    metric = lambda m: m[monitor]
    policy = ocp.checkpoint_managers.AnyPreservationPolicy([
        ocp.checkpoint_managers.LatestN(1),
        ocp.checkpoint_managers.BestN(get_metric_fn=metric, reverse=mode == "min", n=max_to_keep,
                                      keep_checkpoints_without_metrics=False)])
    options = ocp.CheckpointManagerOptions(preservation_policy=policy, cleanup_tmp_directories=True)
    return _open(ckpt_dir, options)


def _open(ckpt_dir, options):
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(ckpt_dir, item_handlers=handlers, options=options)


def _fresh_meta():
    return {"epoch": 0, "batch": 0, "data_state": None, "best": None, "best_step": None, "skipped": 0,
            "history": {"epoch": [], "step": []}, "log": {"sum": {}, "n": 0},
            "epoch_sum": {"sum": {}, "n": 0}}


def _restore(mgr, step, state):
    """Restores `(state, meta)` of `step` into `state`'s structure, shapes and shardings."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    # Compare first: orbax's own errors do not name the parameter whose shape differs.
    stored = {_keystr(p): tuple(m.shape) for p, m in
              jax.tree_util.tree_leaves_with_path(mgr.item_metadata(step)["state"])}
    wanted = {_keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(target)}
    problems = ([f"{k}: in the checkpoint, not in the state" for k in stored.keys() - wanted.keys()] +
                [f"{k}: in the state, not in the checkpoint" for k in wanted.keys() - stored.keys()] +
                [f"{k}: shape {stored[k]} in the checkpoint, {wanted[k]} in the state"
                 for k in stored.keys() & wanted.keys() if stored[k] != wanted[k]])
    if problems:
        listed = "\n  ".join(sorted(problems)[:12]) + ("\n  ..." if len(problems) > 12 else "")
        raise ValueError(f"fit: the checkpoint at step {step} in {mgr.directory} does not fit this "
                         f"state ({len(problems)} differences, another model or optimizer?):\n  "
                         f"{listed}\nUse the model and optimizer of the run that wrote it, or start "
                         f"a fresh run (resume=False or another log_name).")
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                    meta=ocp.args.JsonRestore()))
    restored = jax.tree.map(lambda r, s: jnp.asarray(r, s.dtype), out["state"], state)
    return restored, out["meta"]


def _keystr(path):
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _jsonable(tree):
    return json.loads(json.dumps(tree, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def _hparam_value(v):
    return v if isinstance(v, (bool, int, float, str)) else str(v)


def _hparam_metrics(train_names, eval_names, monitor):
    tags = [f"train/{n}" for n in train_names] + [f"eval/{n}" for n in eval_names]
    return tags + [f"best/{monitor}"]


def _say(lead, message):
    if lead:
        tqdm.write(message)


class _Stop:
    """Why the run is stopping, if it is: a hook's request, or the first SIGINT/SIGTERM, turned
    into a stop after the current step (a second SIGINT interrupts at once). Installs no handler
    off the main thread, nor for SIGTERM after `jax.distributed.initialize`, where JAX's
    preemption notifier owns it and orbax's `reached_preemption` tells all processes."""

    def __init__(self):
        self.reason, self.previous, self.forwarded = None, {}, False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if sig == signal.SIGINT or jax.process_count() == 1:
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, sig, frame):
        if (self.reason or self.forwarded) and sig == signal.SIGINT:
            raise KeyboardInterrupt
        if jax.process_count() > 1 and jax.config.jax_enable_preemption_service:
            # Stopping here alone would leave the other processes waiting in the next
            # collective: JAX's preemption notifier (which owns SIGTERM) picks one step for all.
            self.forwarded = True
            signal.raise_signal(signal.SIGTERM)
            return
        self.reason = signal.Signals(sig).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class _Loop:
    """One run's moving parts: the state and where the run is (`step`; `epoch` and `batch`, the
    batches of that epoch trained on), the checkpoint manager, the logger and the hooks, and what
    happens at each point of the loop."""

    def __init__(self, cfg, mgr):
        self.cfg, self.mgr, self.history = cfg, mgr, cfg.history
        self.lead = jax.process_index() == 0
        self.signals, self.logger = _Stop(), None
        self.state, self.meta = cfg.state, _fresh_meta()
        if cfg.restored:
            try:
                self.state, self.meta = _restore(mgr, mgr.latest_step(), self.state)
            except BaseException:
                mgr.close()
                raise
        self.history.update(self.meta["history"])
        self.meta["history"] = self.history  # one object, saved with every checkpoint
        self.step = int(jax.device_get(self.state.step))
        self.epoch, self.batch, self.data_state = self.meta["epoch"], self.meta["batch"], self.meta["data_state"]
        self.saved = self.step if cfg.restored else None
        self.last_ckpt = self.last_eval = self.step
        self.acc, self.inflight, self.compiled = cfg.acc0, collections.deque(), set()

    def finished(self):
        cfg = self.cfg
        return bool(self.signals.reason or self.epoch >= cfg.num_epochs or
                    (cfg.max_steps and self.step >= cfg.max_steps))

    def open_logs(self, used, eval_names, total):
        cfg = self.cfg
        writer = None
        if self.lead:
            # TensorBoard drops earlier points from this step on: the resumed run logs the steps
            # after its checkpoint again. (0 for a fresh run also clears a crashed attempt's.)
            writer = SummaryWriter(self.history.log_dir, purge_step=self.step + 1 if self.step else 0)
            # tensorboardX queues events for a thread that flushes every 120 s, and flush() skips
            # the queue: write events directly, so the flush before each checkpoint puts every
            # step logged so far on disk, and a killed run loses no logs that its resume skips.
            events = writer._get_file_writer().event_writer
            events.add_event = events._ev_writer.write_event
            if self.step == 0:  # hparams once per run, at its start, so a crashed run shows them
                tags = [f"train/{n}" for n in cfg.train_names] + [f"eval/{n}" for n in eval_names]
                exp, ssi, _ = _hparams_summaries({k: _hparam_value(v) for k, v in used.items() if v is not None},
                                                 {t: 0.0 for t in tags + [f"best/{cfg.monitor}"]})
                writer._get_file_writer().add_summary(exp)
                writer._get_file_writer().add_summary(ssi)
                writer.flush()
        self.logger = _Logger(writer, self.history, self.meta, self.lead, total, self.step,
                              cfg.train.batch_size * jax.process_count(), cfg.on_nonfinite, cfg.lr_of is not None, self.hook, cfg.names)

    def before_batch(self, data_state):
        """Runs what is due before the next batch; returns True when the loop must stop here."""
        cfg = self.cfg
        self.data_state = data_state
        self.logger.waited()
        if jax.process_count() > 1 and self.mgr.reached_preemption(self.step):
            self.signals.reason = "preemption"  # every process stops at this same step
        due_eval = cfg.evaluate and cfg.eval_every and _crossed(self.last_eval, self.step, cfg.eval_every)
        value = self.evaluate() if due_eval else None
        if due_eval or (cfg.ckpt_every and _crossed(self.last_ckpt, self.step, cfg.ckpt_every)):
            self.save(value)
        return self.finished()

    def train(self, fn, batch, k):
        shape = (k, jax.tree.leaves(batch)[0].shape)
        if shape in self.compiled:
            self.state, self.acc = fn(self.state, self.acc, batch)
        else:  # one wait per new shape, so compile time is kept out of the rate
            with self.logger.timed("compile", k):
                self.state, self.acc = fn(self.state, self.acc, batch)
                jax.block_until_ready(self.acc)
            self.compiled.add(shape)
        self.step, self.batch = self.step + k, self.batch + k
        self.logger.poll()  # reads the interval stashed at the last log point, finished by now
        if _crossed(self.step - k, self.step, self.cfg.log_every):
            self.acc = self.logger.stash(self.acc, self.cfg.acc0, self.step)
        # Keep the host at most two calls ahead, so it does not queue up batches.
        self.inflight.append(self.acc["count"])
        if len(self.inflight) > 2:
            self.inflight.popleft().block_until_ready()
        self.logger.ready()

    def end_epoch(self, complete):
        """An epoch's end; or, with `complete=False`, the end of a run that reached `max_steps`
        inside an epoch (its position is saved, so a longer run can go on from it)."""
        cfg = self.cfg
        if complete and self.batch == 0:
            raise ValueError(f"fit: train_ds yielded no batches in epoch {self.epoch + 1}; a "
                             f"generator can be iterated only once: pass a list or a re-iterable "
                             f"loader, or set steps_per_epoch.")
        self.acc = self.logger.flush(self.acc, cfg.acc0, self.step)
        self.hook("epoch_end", self.logger.end_epoch(self.epoch, self.step))
        last = (self.epoch + 1 == cfg.num_epochs and complete) or bool(cfg.max_steps and self.step >= cfg.max_steps)
        due = (self.epoch + 1) % cfg.eval_freq == 0 and complete and not cfg.eval_every
        value = None
        if cfg.evaluate and (due or last) and self.last_eval != self.step:
            value = self.evaluate()
        if cfg.monitor.startswith("train/"):
            value = self.history[cfg.monitor][-1]
            self.logger.track_best(cfg.monitor, cfg.mode, value, self.step)
        if complete:
            self.epoch, self.batch, self.data_state = self.epoch + 1, 0, None
        self.save(value)

    def evaluate(self):
        cfg = self.cfg
        with self.logger.timed("eval"):
            results = cfg.evaluate(self.state, cfg.put)
        self.last_eval = self.step
        self.logger.log_eval(self.epoch + 1, self.step, results)
        value = results.get(cfg.monitor[len("eval/"):]) if cfg.monitor.startswith("eval/") else None
        if value is not None:
            self.logger.track_best(cfg.monitor, cfg.mode, value, self.step)
        self.hook("eval", {f"eval/{k}": v for k, v in results.items()})
        return value

    def save(self, value):
        """Writes a checkpoint of this step, asynchronously: only the device-to-host copy blocks.
        The flush first is also the non-finite check: a NaN state is never written."""
        if self.step == self.saved:
            return
        self.acc = self.logger.flush(self.acc, self.cfg.acc0, self.step)
        self.meta.update(epoch=self.epoch, batch=self.batch,
                         data_state=self.data_state if self.batch else None)
        if self.logger.writer is not None:
            self.logger.writer.flush()
        with self.logger.timed("save"):
            self.mgr.save(self.step, metrics=None if value is None else {self.cfg.monitor: value},
                          args=ocp.args.Composite(state=ocp.args.StandardSave(self.state),
                                                  meta=ocp.args.JsonSave(_jsonable(self.meta))))
        self.saved = self.last_ckpt = self.step

    def end(self):
        """After the loop: save where a stop or max_steps left the run, then the train_end hooks."""
        if self.signals.reason:
            self.history.setdefault("stopped", []).append(f"{self.signals.reason} at step {self.step}")
            self.save(None)
            _say(self.lead, f"fit: stopped by {self.signals.reason} at step {self.step}; "
                            f"checkpoint saved, continue with resume=True.")
        elif self.batch:
            self.end_epoch(complete=False)
        if self.logger.writer is not None and not self.signals.reason:  # the HParams session ended well
            self.logger.writer._get_file_writer().add_summary(_hparams_summaries({}, {})[2])
        with self.logger.timed("finish"):  # the last save's commit: once a run, not steady work
            self.mgr.wait_until_finished()
        self.hook("train_end", {})

    def hook(self, event, metrics=None, step=None):
        """Calls each hook with `(event, run)`; `run` carries the step, state and metrics, and
        takes `run.stop = True` (stop after this step) or, at train_end, a new `run.state`.
        At `log`, `run.step` is the step the metrics are for; the state may be a call ahead,
        because the metrics are read only once the device has moved on."""
        if not self.cfg.hooks:
            return
        cfg = self.cfg
        run = types.SimpleNamespace(
            event=event, step=self.step if step is None else step, epoch=self.epoch, state=self.state, metrics=metrics or {},
            history=self.history, monitor=cfg.monitor, mode=cfg.mode, log_dir=self.history.log_dir,
            ckpt_dir=self.history.ckpt_dir, writer=self.logger and self.logger.writer,
            stopped_early=bool(self.signals.reason), stop=False)
        for hook in cfg.hooks:
            hook(event, run)
            if run.stop and not self.signals.reason:
                self.signals.reason = getattr(hook, "__name__", type(hook).__name__)
        self.state = run.state if event == "train_end" else self.state

    def close(self):
        try:
            self.mgr.wait_until_finished()  # raises errors of asynchronous saves, never loses them
        finally:
            self.mgr.close()
            if self.logger:
                self.logger.close()


class _Logger:
    """The host side of metrics: the progress bar, TensorBoard and the history.

    Train metrics arrive as on-device sums; `stash` keeps a reference at a log point and `poll`
    reads it one step later, when the device has finished it, so the host never waits. The
    running sums (`interval`, `epoch_acc`) live in the checkpoint's meta, so a resumed run logs
    what an uninterrupted one would."""

    def __init__(self, writer, history, meta, lead, total, step, batch_size, on_nonfinite, lr_known, hook, names):
        self.writer, self.history, self.meta, self.lead, self.names = writer, history, meta, lead, names
        self.interval, self.epoch_acc = meta["log"], meta["epoch_sum"]
        self.batch_size, self.skipping, self.lr_known, self.hook = batch_size, on_nonfinite == "skip", lr_known, hook
        self.pending, self.lr, self.first_step, self.epoch_name = None, None, step, ""
        self.bar = tqdm(total=total, initial=step, disable=not lead, unit="step", dynamic_ncols=True)
        self.t0 = self.t_ready = self.t_log = time.perf_counter()
        self.spent = {"compile": 0.0, "eval": 0.0, "save": 0.0, "finish": 0.0, "data": 0.0}
        self.counts = {"compile": 0, "eval": 0, "save": 0, "finish": 0}
        self.spent_steps, self.step_log, self.data_log = 0, step, 0.0

    @contextlib.contextmanager
    def timed(self, what, steps=0):
        """Times a compile, an eval, a save's blocking part or the wait for the last save to
        commit, to leave it out of the rate."""
        self.bar.set_description("compiling" if what == "compile" else what + "uating" if what == "eval" else "saving")
        t = time.perf_counter()
        yield
        self.spent[what] += time.perf_counter() - t
        self.spent_steps += steps
        self.counts[what] += 1
        self.bar.set_description(self.epoch_name)
        self.t_ready = time.perf_counter()

    def waited(self):
        """Time from the last dispatch to the next batch being ready: host time on the data."""
        self.spent["data"] += time.perf_counter() - self.t_ready

    def ready(self):
        self.t_ready = time.perf_counter()

    def steady_rate(self, step):
        seconds = time.perf_counter() - self.t0 - sum(v for k, v in self.spent.items() if k != "data")
        steps = step - self.first_step - self.spent_steps
        return steps / seconds if steps > 0 and seconds > 0 else None

    def timing(self, step):
        return {**{f"{k}_s": v for k, v in self.spent.items()},
                **{f"{k}_count": v for k, v in self.counts.items()},
                "steps": step - self.first_step, "steady_steps_per_s": self.steady_rate(step),
                "wall_s": time.perf_counter() - self.t0}

    def stash(self, acc, acc0, step):
        self.poll()
        self.pending = (acc, step)
        return acc0

    def poll(self):
        if self.pending is not None:
            acc, step = self.pending
            self.pending = None
            self._add(_unpack(jax.device_get(acc), self.names), step)
            self._log_interval(step)

    def flush(self, acc, acc0, step):
        """Reads everything accumulated so far: a sync point, used at epoch ends and saves."""
        self.poll()
        self._add(_unpack(jax.device_get(acc), self.names), step)
        return acc0

    def _add(self, acc, step):
        if acc["bad"] and not self.skipping:
            what = ", ".join(sorted((k for k, v in acc["bad_by"].items() if v), key=lambda k: k != "loss"))
            raise FloatingPointError(
                f"fit: non-finite values (NaN or Inf) in {what} at step {int(acc['first_bad']) + 1} "
                f"(checked by step {step}); no checkpoint was written after it. Lower the learning "
                f"rate, check the data, or pass on_nonfinite='skip' to drop such updates.")
        for target in (self.interval, self.epoch_acc):
            for k, v in acc["sum"].items():
                target["sum"][k] = target["sum"].get(k, 0.0) + float(v)
            target["n"] += int(acc["n"])
        self.interval["skipped"] = self.interval.get("skipped", 0) + int(acc["bad"])
        self.meta["skipped"] += int(acc["bad"])
        if self.lr_known:
            self.lr = float(acc["lr"])

    def _log_interval(self, step):
        if step == self.step_log:
            return
        n = self.interval["n"]  # (0 when every step of the interval was skipped: no means)
        means = {f"train/{k}": v / n for k, v in self.interval["sum"].items()} if n else {}
        if self.lr is not None:
            means["train/lr"] = self.lr
        if self.skipping:
            means["train/skipped_steps"] = self.meta["skipped"]
        now = time.perf_counter()
        rate = self.steady_rate(step)
        perf = {"perf/steps_per_s": rate, "perf/seconds_per_step": rate and 1 / rate,
                "perf/examples_per_s": rate and rate * self.batch_size,
                "perf/data_wait_fraction": (self.spent["data"] - self.data_log) / max(now - self.t_log, 1e-9),
                "perf/compile_s": self.spent["compile"]}  # (this call's compiles so far)
        if self.writer is not None:
            for k, v in list(means.items()) + list(perf.items()):
                if v is not None:
                    self.writer.add_scalar(k, v, step)
        postfix = {k.split("/")[-1]: f"{v:.4g}" for k, v in means.items()}
        if rate:
            postfix["ex/s"] = f"{rate * self.batch_size:.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)
        self.interval.update(sum={}, n=0, skipped=0)
        self.step_log, self.t_log, self.data_log = step, now, self.spent["data"]
        self.hook("log", means, step)

    def start_epoch(self, epoch, num_epochs):
        self.epoch_name = f"epoch {epoch + 1}/{num_epochs}"
        self.bar.set_description(self.epoch_name)

    def end_epoch(self, epoch, step):
        """Logs the last interval and appends the epoch's means to the history."""
        self._log_interval(step)
        n = self.epoch_acc["n"]  # (0 if every step was skipped as non-finite: NaN, not a fake 0)
        self.history["epoch"].append(epoch + 1)
        self.history["step"].append(step)
        row = {f"train/{k}": v / n if n else float("nan") for k, v in self.epoch_acc["sum"].items()}
        if self.skipping:
            row["train/skipped_steps"] = self.meta["skipped"]
        for k, v in row.items():
            self.history.setdefault(k, []).append(v)
        self.epoch_acc.update(sum={}, n=0)
        return row

    def log_eval(self, epoch, step, results):
        for k, v in results.items():
            self.history.setdefault(f"eval/{k}", []).append(v)
        self.history.setdefault("eval/epoch", []).append(epoch)
        self.history.setdefault("eval/step", []).append(step)
        if self.writer is not None:
            for k, v in results.items():
                self.writer.add_scalar(f"eval/{k}", v, step)
        _say(self.lead, f"step {step}: " + ", ".join(f"eval/{k}={v:.4f}" for k, v in results.items()))

    def track_best(self, monitor, mode, value, step):
        best = self.meta["best"]
        # A tie moves the best to the later step: orbax's BestN keeps the later of equal ones.
        if best is None or (value >= best if mode == "max" else value <= best):
            self.meta.update(best=value, best_step=step)
        if self.writer is not None:
            self.writer.add_scalar(f"best/{monitor}", self.meta["best"], step)

    def close(self):
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
