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

You supply (`help(Options)` has every option, `help(fit)` what a run does): a `TrainState` or an
nnx model with `optimizer=nnx.Optimizer(model, tx, wrt=nnx.Param)`; a tuple `(x, y)` of arrays
with `batch_size=` (the global batch: every process passes the same arrays) or any iterable of
`(inputs, targets)` batches (a list is batches); `loss_fn(outputs, targets)`, the model called as
`apply_fn({"params", "batch_stats"}, inputs, train=True, mutable=["batch_stats"], rngs={"dropout":
fold_in(rng, step)})` (another model: `train_step(state, batch[, rng]) -> (state, metrics)`);
`eval_step(state, batch)`: per-batch means that fit weights by batch size, `Weighted`, arrays of
counts or metric states, exact over the eval set (`_EvalSums`; `test_ds` may be a dict of named
sets, each logged as `eval/<name>/<metric>`), and `eval_metrics` computed in Python; hooks
`hook(event, run)` that may set `run.stop`, `run.save` (`_Run`).

How to read this file: `fit` is the whole story, top to bottom; the parts it uses follow in
that order, each opened by a banner comment; the guards come last, below a banner that names who
calls them. One training step, from `fit` to the device and back: `fit`'s loop, `_Data.calls`
(its batch), `_Dispatch` (its call of the step `_new_steps` compiled), `_train_and_accumulate`
(the bookkeeping), `_default_train_step` and `_gradient_step` (the math), then at a log point
`_Loop.log` and `_Readings.read` (the sums, one call late). The map, by job:

    TrainState, Weighted, Total        public building blocks; lr_schedule; ema, the average
    Options, fit                       every option and its rules; the story of a run
    load_ckpt, evaluate, History       the rest of the public API
    EarlyStopping, Profiler            hooks; ProgressBar and TensorBoard are the built-in ones
    _adapt, _linen_forward             how the model is called: edit the forward here
    _mesh, _place_state, _putter       placement: the mesh, the state's copy, batches
    _Data, _grouped                    the data: an epoch's calls (`_Data.calls`), positions
    _gradient_step                     the step's math: change the step here (bf16, grads)
    _StepConfig, _build_steps          the compiled steps, cached; what traced code reads
    _step_values, _TrainSums           a per-step quantity (`step_metrics`, public), the sums
    _jit_eval, _EvalSums               the eval: an eval step's sums, any shape of metric
    _Plan, _pick_monitor               every period in steps; the monitor (the best, its mode)
    _Progress, _Checkpoints            what a checkpoint holds (one field list), saves, restores
    _Run, _Loop                        what hooks see; the loop's body: log, evals, checkpoint
    _Dispatch, _Readings, _Clock       the steps' calls (steps_per_jit's k); train metrics on the
                                       host; time, speed
    guards                             checks before any work, advice on your functions, the
                                       run's claim and lock, checkpoints that do not fit
"""
import collections.abc
import contextlib
import dataclasses
import difflib
import errno
import functools
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

try:
    import fcntl  # (the run's lock; not on Windows)
except ImportError:
    fcntl = None

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tensorboardX import SummaryWriter, record_writer
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import hparams as hparams_summaries, scalar as scalar_summary
from tqdm.auto import tqdm

__all__ = ["TrainState", "Weighted", "Total", "lr_schedule", "ema", "Options", "fit", "evaluate",
           "load_ckpt", "History", "EarlyStopping", "Profiler", "ProgressBar", "TensorBoard"]


# -- Public building blocks, the options and fit ---------------------------------------------------

class TrainState(train_state.TrainState):
    """Flax's TrainState plus `batch_stats` (BatchNorm's statistics, `{}` without; an nnx model's:
    its variables neither trained nor frozen, `_adapt`) and `rng`, the base key (None: fit fills it
    from `seed`): the update from step n to n + 1 draws `fold_in(rng, n)` (so the step hooks and
    checkpoints call K drew `fold_in(rng, K - 1)`), so randomness survives a resume and the device
    count. `tx=None`: no optimizer, for `evaluate` and `load_ckpt`. Any flax TrainState subclass
    trains too, every field saved and returned (e.g. `ema_params`); this one's two fields are
    keyword-only, so a subclass may add fields without defaults (a GAN's `disc`)."""
    batch_stats: Any = flax.struct.field(default_factory=dict, kw_only=True)
    rng: Any = flax.struct.field(default=None, kw_only=True)

    @classmethod
    def create(cls, *, apply_fn: Callable | None, params: Any, tx: Any = None,
               **kwargs: Any) -> "TrainState":
        if tx is not None:
            return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        return cls(step=0, apply_fn=apply_fn, params=params, tx=None, opt_state=None, **kwargs)


class Weighted(collections.namedtuple("Weighted", "total weight")):
    """A metric as a sum and its weight, e.g. `Weighted(token_losses.sum(), mask.sum())` for a
    padded batch: fit logs sum(total) / sum(weight) over the whole eval set or log interval,
    exactly, where a plain per-batch mean is weighted by rows (eval) or steps (train). A loss may
    be one too: the step descends total / weight (summed over microbatches and devices first)."""
    __slots__ = ()


class Total(collections.namedtuple("Total", "value")):
    """A train quantity summed over the whole run, not averaged: a `step_metrics` value such as
    `Total(rows)`, examples seen, logged as its running total at every log point and epoch end,
    exact over a resume (it is checkpointed with the train sums)."""
    __slots__ = ()


def lr_schedule(base_lr: float, steps_per_epoch: int, epochs: int, warmup_epochs: float = 0,
                init_value: float = 0.0, end_value: float = 0.0, *,
                continue_from: int | None = None) -> optax.Schedule:
    """An optax schedule: linear warmup from `init_value` to `base_lr` over `warmup_epochs` (may be
    fractional), then a cosine decay reaching `end_value` exactly at the last step, `epochs *
    steps_per_epoch - 1` (for arrays, `steps_per_epoch` is `ceil(len(x) / batch_size)`).
    `continue_from=n`, to train a finished run of n epochs on to `epochs` (`fit(...,
    resume=True, num_epochs=epochs)`): its first n epochs' curve, then a warm restart (as SGDR's):
    from the rate it ended at (`end_value`), a warmup over `warmup_epochs` back to `base_lr`, then
    a cosine to `end_value` at the new last step."""
    for name, value in (("steps_per_epoch", steps_per_epoch), ("epochs", epochs)):
        if not _positive_int(value):
            raise ValueError(f"lr_schedule: {name} must be a positive integer, got {value!r}.")
    if continue_from is not None:
        if not (_positive_int(continue_from) and continue_from < epochs):
            raise ValueError(f"lr_schedule: continue_from must be the epochs trained so far, a "
                             f"positive integer below epochs={epochs}, got {continue_from!r}.")
        before = lr_schedule(base_lr, steps_per_epoch, continue_from, warmup_epochs, init_value,
                             end_value)
        after = lr_schedule(base_lr, steps_per_epoch, epochs - continue_from, warmup_epochs,
                            end_value, end_value)
        return optax.join_schedules([before, after], [continue_from * steps_per_epoch])
    if not (isinstance(warmup_epochs, (int, float)) and 0 <= warmup_epochs < epochs):
        raise ValueError(f"lr_schedule: warmup_epochs must be >= 0 and below epochs, got "
                         f"warmup_epochs={warmup_epochs!r} and epochs={epochs!r}; lower one.")
    total = epochs * steps_per_epoch
    warmup = int(round(warmup_epochs * steps_per_epoch))
    # The cosine spans the steps after warmup up to the last, total-1 (not `total`, a step short).
    decay_steps = max(total - 1 - warmup, 1)
    return optax.warmup_cosine_decay_schedule(init_value, base_lr, warmup, warmup + decay_steps,
                                              end_value)


def ema(tx: optax.GradientTransformation, decay: float = 0.999,
        warmup: bool = True) -> optax.GradientTransformationExtraArgs:
    """`tx`, then an exponential moving average of the parameters it produces (`optax.ema` averages
    the updates): an optax transformation whose state keeps the average (`fit_ema_params`), saved,
    sharded and resumed with the optimizer state. Wrap the whole chain, inside `optax.MultiSteps`
    if any. `warmup=True`: update t uses `min(decay, (1 + t) / (10 + t))`, so the random init
    fades at once. fit evaluates the average at every eval (`eval_ema/...`), can keep the best by
    it (`monitor="eval_ema/accuracy"`); `load_ckpt(..., ema=True)` loads it as the params."""
    if not (isinstance(decay, (int, float)) and 0 <= decay < 1):
        raise ValueError(f"fit.ema: decay must be a number in [0, 1), e.g. 0.999, got {decay!r}.")
    if not isinstance(warmup, bool):
        raise TypeError(f"fit.ema: warmup must be True or False, got {warmup!r}.")

    def init(params):
        return _EmaState(tx.init(params), jnp.zeros([], jnp.int32),
                         jax.tree.map(lambda p: jnp.array(p, copy=True), params))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("fit.ema needs the params: call tx.update(grads, opt_state, params).")
        updates, inner = tx.update(updates, state.inner, params, **extra)
        t = state.fit_ema_count.astype(jnp.float32)  # (jnp.minimum, not a cond: see _NO_COND)
        d = jnp.minimum(decay, (1 + t) / (10 + t)) if warmup else jnp.float32(decay)
        average = lambda e, p: (d * e + (1 - d) * p).astype(e.dtype)
        new = jax.tree.map(average, state.fit_ema_params, optax.apply_updates(params, updates))
        return updates, _EmaState(inner, state.fit_ema_count + 1, new)

    return optax.GradientTransformationExtraArgs(init, update)


# Field names found nowhere else: the average is found in any optimizer state and checkpoint.
_EmaState = collections.namedtuple("_EmaState", "inner fit_ema_count fit_ema_params")


_is_ema = lambda x: isinstance(x, tuple) and hasattr(x, "fit_ema_params")


def _ema_params(opt_state):
    """The EMA's params in an optimizer state, or None; more than one `fit.ema` raises."""
    found = [x.fit_ema_params for x in jax.tree.leaves(opt_state, is_leaf=_is_ema) if _is_ema(x)]
    if len(found) > 1:
        raise ValueError(f"fit: the optimizer holds {len(found)} fit.ema averages; wrap it once.")
    return found[0] if found else None


def _positive_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0


_TRACED = {"traced": True}  # the mark of an option that traced code reads (see _StepConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Every option of `fit` (and the data and placement ones of `evaluate`), checked when built
    (the long form of each: docs/reference.md):
    loss_fn: `(outputs, targets) -> loss or (loss, {name: scalar})`; see the module docstring.
    eval_step: `(state, batch) -> scalar` ("accuracy") or `{name: value}`; None: `loss_fn`'s loss.
        A value may be a per-batch mean, a `Weighted`, an array of counts (summed, e.g. a
        confusion matrix) or a metric state with `merge` and `compute` (clu's); see `_EvalSums`.
    eval_metrics: `{name: fn(state, batches) -> float}`, metrics computed in Python at every eval
        (BLEU from decoded text): `state` as `eval_step` gets it, `batches` the eval set's; logged
        and ranked as `eval/<name>`, so a `monitor`; process 0's value holds for all processes.
    train_step: `(state, batch[, rng]) -> (state, metrics)`, replacing fit's step; TrainState only.
        Metrics are logged as interval means, but `grad_norm` and `param_norm` as the log step's.
    step_metrics: `fn(step) -> {name: value}`, the step's own quantities: fit's train step calls
        it with `step.grads`, `step.updates` (the params' change), `step.state` (after the
        update) and `step.batch`; each value is logged as `train/<name>`: a scalar as the
        interval's mean, a `Total` as the run's running total, and one named `grad_norm/...` or
        `param_norm/...` (a layer's) as its log step's value (with `axis_name`: a Total summed
        over the devices, the rest averaged). None: nothing added to the step.
    optimizer: an nnx model's `nnx.Optimizer` (or an object with `tx`, `opt_state`, `step`, `wrt`).
    nnx_loss_fn: `(model, batch, rngs) -> loss or (loss, metrics)`, instead of `loss_fn`, for an
        nnx model called its own way; `rngs` is an `nnx.Rngs` of the step's key.
    num_epochs=1: epochs to train; resumed with a larger value, the run goes on.
    max_steps: the step to stop at, mid-epoch if need be, counting the state's own steps (a
        loaded state already there trains nothing; see fit).
    steps_per_epoch: batches per epoch, for data without `len()` (a generator: one stream).
    batch_size: for arrays `(x, y)`, which fit batches (the last batch may be smaller).
    batch_keys: `(inputs_key, targets_key)` of dict batches; every function then gets pairs.
    eval_freq=1: epochs between evals; the last epoch always evaluates.
    eval_every: steps between evals, instead of `eval_freq` (the end evaluates too).
    eval_steps: at most this many eval batches; with named eval sets, for each, or a dict by set.
    ema_eval=True: with `ema(tx)`, every eval also runs on the average (`eval_ema/<metric>`).
    log_every=50: steps between train logs (bar, TensorBoard, `log` hooks): the interval's means.
    ckpt_interval=300.0: seconds from a save to the next, due at the first log point after.
    ckpt_every: steps between checkpoints, exactly, besides those of `ckpt_interval`.
    max_to_keep=1: best checkpoints kept (by `monitor`), besides the latest.
    monitor: the best checkpoint's metric; None: `eval/accuracy`, `eval/loss`, ... (named sets:
        the first set's, `eval/<set>/accuracy`, ...), and no best without an eval set; or
        `eval_ema/...`, or a train metric (`train/loss`: its best epoch's end is saved).
    mode="auto": "min" or "max"; "auto" reads the monitor's name (loss, accuracy, ...) or raises.
    log_name="run": runs are `<log_name>_<n>`, in `<workdir>/logs/` and `<workdir>/checkpoints/`.
    workdir: where `logs/` and `checkpoints/` go; None: the current directory. A GCS bucket,
        `"gs://bucket/exp"`, needs gcsfs and google-cloud-storage; its run lock is a `_Lease`.
    resume=False: a fresh run, `<log_name>_<n+1>`; True: go on with the latest run of `log_name`
        (afresh if it saved nothing); a run's name, e.g. `"mnist_3"`: that run. See fit.
    hparams: a dict for TensorBoard's HParams tab, beside the plain options and derived values.
    seed=0: fills `state.rng` if None, shuffles arrays from `(seed, epoch)`; checked on resume.
    shuffle=True: arrays' train rows in a new order each epoch; False: in order (other data
        come as given). Checked on resume, as the seed.
    lr_fn: `lr_fn(step) -> learning rate`, to log the rate without `optax.inject_hyperparams`.
    steps_per_jit="auto": k steps per compiled call, over groups of k batches of one shape starting
        at multiples of k, where logs, evals, saves and stops then fall; other batches run singly.
        "auto": 1, unless fit measures that its steps wait for the host (`_steps_per_call`).
    grad_accum=1: k microbatches per train batch, in a rolled scan inside the step: the losses'
        totals' gradients and their weights are summed, then divided once, so an update is the
        whole batch's for a loss that sums over rows: a mean, a `Weighted` loss over padded
        tokens (`optax.MultiSteps`, a mean of means, is not). A loss that couples the rows
        (contrastive) raises at the first step: see `grad_accum_mode`. BatchNorm sees each
        microbatch; see docs/reference.md.
    grad_accum_mode="losses": how microbatches add up. "losses": each microbatch's loss, as
        above. "outputs": the microbatches' outputs gathered, `loss_fn` taken once over the whole
        batch's and its gradient sent back through each microbatch's forward (GradCache, as
        OpenCLIP's --accum-freq): exact for any loss of the outputs (InfoNCE's in-batch
        negatives), for one more forward per microbatch and all outputs held at once (small for
        embeddings; a language model's logits: use "losses"). `loss_fn` only (`_gathered_forward`).
    hooks=(): functions `hook(event, run)`, called after the built-in ones (see `_Run`).
    verbose=1: 0: warnings only; 1: a bar and epoch lines; 2: the lines (1 too if TQDM_DISABLE=1).
    peak_tflops: a device's peak TFLOP/s, for `perf/mfu` on a chip not in `_PEAK_TFLOPS`.
    tensorboard=True: False: no event files.
    save_frozen=True: False: an nnx model's frozen base (its nnx.Params outside the optimizer's
        `wrt` that the step leaves unchanged, e.g. under LoRA) is left out of checkpoints, its
        fingerprint saved instead; resume and `load_ckpt` then take the base from the model you
        pass, checked against it.
    on_nonfinite="raise": a NaN/Inf loss, metric or parameter raises `FloatingPointError` naming
        the step (no checkpoint after it); "skip" drops such updates (`train/skipped_steps`).
    mesh: a Mesh with the `batch_axes`; None: the state's, jax.set_mesh's, or all devices on "data".
    batch_axes=("data",): the mesh axes a batch's rows are split over, e.g. `("data", "fsdp")`
        (MaxText's) or `("fsdp",)` (a mesh without "data"); devices of another axis hold the same
        rows. With `axis_name`, one axis.
    state_sharding: the state's layout: a tree (or a function) of `PartitionSpec`s or shardings.
    axis_name: for pmap-era models: runs the step per device over the data axis, so named."""
    loss_fn: Callable[[Any, Any], Any] | None = dataclasses.field(default=None, metadata=_TRACED)
    eval_step: Callable[[Any, Any], Any] | None = None
    eval_metrics: dict[str, Callable[[Any, Iterable], float]] | None = None
    train_step: Callable[..., tuple] | None = dataclasses.field(default=None, metadata=_TRACED)
    step_metrics: Callable[[Any], dict] | None = dataclasses.field(default=None, metadata=_TRACED)
    optimizer: Any = None  # (an nnx.Optimizer: flax.nnx is not imported unless yours is)
    nnx_loss_fn: Callable[[Any, Any, Any], Any] | None = None
    num_epochs: int = 1
    max_steps: int | None = None
    steps_per_epoch: int | None = None
    batch_size: int | None = None
    batch_keys: tuple[str, str] | None = None
    eval_freq: int = 1
    eval_every: int | None = None
    eval_steps: int | dict | None = None
    ema_eval: bool = True
    log_every: int = dataclasses.field(default=50, metadata=_TRACED)
    ckpt_interval: float = 300.0
    ckpt_every: int | None = None
    max_to_keep: int = 1
    monitor: str | None = None
    mode: str = "auto"
    log_name: str = "run"
    workdir: str | None = None
    resume: bool | str = False
    hparams: dict | None = None
    seed: int = dataclasses.field(default=0, metadata=_TRACED)
    shuffle: bool = True
    lr_fn: Callable[[Any], Any] | None = dataclasses.field(default=None, metadata=_TRACED)
    steps_per_jit: int | str = "auto"
    grad_accum: int = dataclasses.field(default=1, metadata=_TRACED)
    grad_accum_mode: str = dataclasses.field(default="losses", metadata=_TRACED)
    hooks: Sequence[Callable[[str, Any], Any]] = ()
    verbose: int = 1
    peak_tflops: float | None = None
    tensorboard: bool = True
    save_frozen: bool = True
    on_nonfinite: str = "raise"
    mesh: Mesh | None = None
    batch_axes: tuple[str, ...] = ("data",)
    state_sharding: Any = None  # (a tree like the state, or a function of it)
    axis_name: str | None = dataclasses.field(default=None, metadata=_TRACED)

    # option: (error, is a value valid?, what it must be); None passes if it is the default
    _RULES = {
        **dict.fromkeys(("num_epochs", "eval_freq", "log_every", "max_to_keep",
                         "grad_accum", "ckpt_every", "max_steps", "steps_per_epoch", "eval_every",
                         "batch_size"), (ValueError, _positive_int, "a positive integer")),
        "steps_per_jit": (ValueError, lambda v: v == "auto" or _positive_int(v),
                          "'auto' or a positive integer"),
        "eval_steps": (ValueError, lambda v: _positive_int(v) or isinstance(v, dict) and all(
            map(_positive_int, v.values())), "a positive integer, or a dict {eval set: one}"),
        **dict.fromkeys(("loss_fn", "eval_step", "train_step", "lr_fn", "nnx_loss_fn",
                         "step_metrics"),
                        (TypeError, callable, "a function")),
        "mode": (ValueError, lambda v: v in ("auto", "min", "max"), "'auto', 'min' or 'max'"),
        "seed": (ValueError, lambda v: isinstance(v, (int, np.integer)) and not isinstance(
            v, bool) and v >= 0, "an integer >= 0 (it fills state.rng and orders the data)"),
        "verbose": (ValueError, lambda v: v in (0, 1, 2), "0, 1 or 2"),
        "on_nonfinite": (ValueError, lambda v: v in ("raise", "skip"), "'raise' or 'skip'"),
        "grad_accum_mode": (ValueError, lambda v: v in ("losses", "outputs"),
                            "'losses' or 'outputs'"),
        **dict.fromkeys(("ckpt_interval", "peak_tflops"), (ValueError, lambda v: isinstance(
            v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number")),
        "hooks": (TypeError, lambda v: isinstance(v, (list, tuple)) and all(map(callable, v)),
                  "a list of functions hook(event, run)"),
        "hparams": (TypeError, lambda v: isinstance(v, dict), "a dict of name -> value"),
        "eval_metrics": (TypeError, lambda v: isinstance(v, dict) and all(
            isinstance(k, str) and re.fullmatch(r"[\w.-]+", k) and callable(f) for k, f in
            v.items()), "a dict {name: fn(state, batches) -> float}, names of letters, digits, "
                        "'_', '-' or '.'"),
        "resume": (ValueError, lambda v: isinstance(v, bool) or isinstance(v, str) and v,
                   "True, False or the name of a run"),
        "batch_keys": (ValueError, lambda v: isinstance(v, (tuple, list)) and len(v) == 2,
                       "a pair (inputs_key, targets_key)"),
        "batch_axes": (ValueError, lambda v: isinstance(v, (tuple, list)) and v and all(
            isinstance(a, str) for a in v) and len(set(v)) == len(v), "a tuple of mesh axis names, "
                       "e.g. ('data',) or ('data', 'fsdp')"),
        **dict.fromkeys(("tensorboard", "ema_eval", "save_frozen", "shuffle"), (TypeError, lambda v:
                                                                     isinstance(v, bool),
                                                      "True or False")),
        "workdir": (ValueError, lambda v: isinstance(v, (str, os.PathLike)) and (not _is_url(
            v) or re.fullmatch(r"gs://[\w.-]+(/.*)?", str(v))), "a local directory or a bucket, "
                    "gs://bucket/path (other URLs, s3:// too, are not stores orbax-checkpoint 0.12 "
                    "writes arrays to: mount them)"),
        "log_name": (ValueError, lambda v: isinstance(v, str) and re.fullmatch(r"[\w.-]+", v),
                     "a non-empty name of letters, digits, '_', '-' or '.'"),
    }

    @classmethod
    def of(cls, kwargs: dict) -> "Options":
        names = [f.name for f in dataclasses.fields(cls)]
        for key in (key for key in kwargs if key not in names):
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {near[0]}?" if near else f"the options are {names}"
            raise TypeError(f"fit: unknown option {key}=; {hint}")
        return cls(**kwargs)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, rule = getattr(self, f.name), self._RULES.get(f.name)
            if rule and not (value is None and f.default is None or rule[1](value)):
                raise rule[0](f"fit: {f.name} must be {rule[2]}, got {value!r}.")
        if self.eval_every and self.eval_freq != 1:
            raise ValueError(f"fit: eval_every={self.eval_every} (steps) and eval_freq="
                             f"{self.eval_freq} (epochs) contradict each other; pass one of them.")
        if self.loss_fn and self.nnx_loss_fn:
            raise ValueError("fit: pass loss_fn= or nnx_loss_fn=, not both.")
        if self.axis_name and len(self.batch_axes) != 1:
            raise ValueError(f"fit: axis_name={self.axis_name!r} runs the step per device over one "
                             f"axis, but batch_axes={tuple(self.batch_axes)} names "
                             f"{len(self.batch_axes)}; pass one batch axis.")
        if self.step_metrics and self.train_step:
            raise ValueError("fit: step_metrics is called by fit's own train step; your "
                             "train_step returns its metrics itself (drop step_metrics).")
        if self.grad_accum > 1 and self.train_step is not None:
            raise ValueError(f"fit: grad_accum={self.grad_accum} splits fit's own train step; "
                             f"your train_step accumulates on its own (drop grad_accum).")
        if self.grad_accum_mode == "outputs" and (self.train_step or self.nnx_loss_fn):
            name = "train_step" if self.train_step else "nnx_loss_fn"
            raise ValueError(f"fit: grad_accum_mode='outputs' gathers the model's outputs where "
                             f"fit calls the model, for loss_fn(outputs, targets); your {name} "
                             f"calls it itself. Pass loss_fn= (an nnx model: called as "
                             f"model(inputs)), or drop grad_accum_mode.")

    def __repr__(self):  # (a jitted step's error prints it: not the user's optimizer or model)
        return "<fit options>"

    def hparams_used(self, plan, batch_size, devices):
        """The HParams tab's values: plain-valued options, what the run derived, the `hparams`."""
        derived = {"batch_size": batch_size, "devices": devices, "monitor": plan.monitor,
                   "steps_per_epoch": plan.steps_per_epoch, "mode": plan.mode}
        skip = ("workdir", "log_name", "resume", "verbose", "tensorboard", "hparams")
        plain = (type(None), bool, int, float, str, np.generic)  # what TensorBoard can show
        used = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in skip and isinstance(getattr(self, f.name), plain)}
        return {**used, **derived, **(self.hparams or {})}


def _with_options(fn):
    """`fn` with `Options`' fields as the keyword-only parameters of its signature, with their
    types and defaults: what help(), IDEs and notebooks show for its `**options`."""
    sig = inspect.signature(fn)
    head = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    fn.__signature__ = sig.replace(parameters=head + [inspect.Parameter(
        f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(Options)])
    return fn


@_with_options
def fit(state: Any, train_ds: Any, test_ds: Any = None, **options: Any) -> tuple[Any, "History"]:
    """Trains `state` (a TrainState, or an nnx model with `optimizer=`) on `train_ds`, evaluating on
    `test_ds` (one set, or `{name: set}`); `options`: those of `Options`. Returns `(state,
    history)`: a trained copy of the state (the caller's stays usable), or the nnx model updated in
    place; and a `History`. A second call with the same functions, optimizer, batch shapes and
    placement compiles nothing, so a global your functions read keeps its value at their trace
    (`_cached`). A resume goes on from the run's latest checkpoint exactly as an uninterrupted run
    would; a finished run returns at once. A hook's stop (`run.stop`) is final unless `num_epochs`
    or `max_steps` grew; a signal's is not (`_Signals`). docs/reference.md has the long form."""
    # 1. Check everything that can be checked before touching the disk or compiling.
    opts = Options.of(options)
    _check_state(state, opts)
    mesh = _mesh(opts, state)
    train_data = _Data(train_ds, "train_ds", opts, train=True, mesh=mesh)
    eval_data = _eval_sets(test_ds, "test_ds", opts, mesh)  # {name: _Data}; one set's: None
    _check_data(train_data, eval_data, opts, mesh)
    model = _adapt(state, opts, spec=train_data.spec)  # (nnx: its variables as a TrainState)

    # 2. Place a private copy of the state on the devices (a frozen base: the caller's, if placed).
    state = _place_state(model.state, opts.seed, lambda s: _state_shardings(s, opts, mesh))
    frozen = _place_frozen(model.frozen, mesh)

    # 3. Build the compiled steps (every step's jax.jit is in _build_steps), then plan the run.
    config = _StepConfig.of(opts, model.forward, model.eval_step, mesh, linen=model.linen)
    steps = _build_steps(state, train_data, eval_data, config, mesh, frozen=frozen)
    plan, verbose = _Plan(opts, train_data, eval_data, steps, state), _verbosity(opts.verbose)
    _check_plan(opts, train_data, eval_data, plan.total)

    # 4. Open the run: claim it, restore its checkpoint if it goes on, set up the hooks.
    batching = (train_data.global_batch, plan.steps_per_epoch)
    hparams = opts.hparams_used(plan, batching[0], mesh.size)
    builtin = ([ProgressBar(verbose)] if verbose else []) + (
        [TensorBoard(hparams)] if opts.tensorboard and jax.process_index() == 0 else [])
    start = int(jax.device_get(state.step))  # (a loaded state's: the run counts epochs from it)
    # (filled from the checkpoint if the run goes on; a run with nothing to do claims nothing)
    progress = _Progress(target=(opts.num_epochs, opts.max_steps), seed=opts.seed, start=start,
                         batching=batching, options=_jsonable(hparams))
    fresh_work = not plan.done(0, start)
    ckpts = _Checkpoints(opts, _Best(plan, opts.max_to_keep), progress, fresh_work, frozen)
    # Held from here on (closed on any exit); a resume's steps read its checkpoint's frozen base.
    state, steps = ckpts.restore(state), steps._replace(frozen=ckpts.frozen)
    step, epoch, position = int(jax.device_get(state.step)), progress.epoch, progress.here()
    run = _Run(builtin + list(opts.hooks), plan, ckpts, progress)
    _check_schedule(state, opts, run.total_steps)
    if plan.done(epoch, step) or run.stopping:  # (run.stopping: a hook's stop, for good)
        _say(verbose, f"fit: run {ckpts.run} already finished at step {step}; nothing to do.")
        ckpts.close()
        run.history.timing = _Clock(steps, opts, step).timing(step)  # (no work done)
        return model.finish(run.end(state, step, epoch), ckpts.frozen), run.history
    _say(verbose, f"fit: {'resuming' if ckpts.resumed else 'starting'} run {ckpts.run!r} at step "
                  f"{step} on {mesh.size} device(s), {plan.best}{model.split}; tensorboard "
                  f"--logdir {ckpts.logs}")

    # 5. The loop. Nothing on the per-step path reads a device value: metrics are summed on
    # device and read at log points, one call late, when the device has finished them.
    try:
        with _Signals() as signals:
            ckpts.open()
            run.call("train_start", state, step, epoch)
            clock = run.clock = _Clock(steps, opts, step)  # time and speed: it starts now
            dispatch = _Dispatch(steps, clock, opts, step, run.total_steps)  # the steps' calls
            loop = _Loop(run, _Readings(dispatch, opts, progress.meter, step), ckpts, signals,
                         plan=plan, eval_data=eval_data, verbose=verbose,
                         python=_python_metrics(opts.eval_metrics, model.view))
            due = step  # the step from which the loop checks what is due (here: the first)
            while not (run.stopping or plan.done(epoch, step)):
                calls = train_data.calls(epoch, position, step, dispatch, steps.put)
                for batch, position, k, last in calls:
                    state = dispatch(state, batch, k, epoch=epoch, position=position)
                    step += k
                    stop = signals.reason or ckpts.count_call()  # (several processes: each call)
                    if step < due and not (last or stop):
                        continue  # nothing else to do: the host stays ahead of the device
                    loop.log(state, step, epoch, due=plan.due("log", step, k))  # (read later)
                    if plan.due("eval", step, k):
                        loop.evals(state, step, epoch)
                    run.stopping = run.stopping or stop or signals.reason
                    cut = plan.done(epoch, step) and not (last or run.stopping)  # by max_steps
                    if last or cut:  # the epoch's end comes before the save of its last step
                        loop.end_epoch(state, step, epoch, complete=last)
                    if last:
                        epoch, position = epoch + 1, (0, None)
                    if run.stopping or plan.done(epoch, step):
                        break
                    if run.save or plan.due("ckpt", step, k):
                        loop.checkpoint(state, step, epoch, position)
                    due = plan.next_due(step, now=loop.pending() or run.stopping or run.save)
            loop.checkpoint(state, step, epoch, position)  # always: at the end and on every stop
            with clock.timed("finish"):  # the last save's commit: once a run, not steady work
                ckpts.wait()
            state = run.end(state, step, epoch)
            # A signal after the last step is honoured too, now that the checkpoint is committed.
            late = signals.reason or ckpts.count_call() or signals.asked
    finally:
        ckpts.close()
        run.close()
    run.history.timing = clock.timing(step)
    signals.honour(run.stopping, late)
    return model.finish(state, ckpts.frozen), run.history


# -- The rest of the public API: restoring, evaluating, the history --------------------------------

def load_ckpt(state: Any, ckpt_dir: str | os.PathLike, step: int | str | None = None,
              optimizer: Any = None, weights_only: bool = False, *, ema: bool = False) -> Any:
    """Restores a state saved by `fit` from a run's checkpoint directory (`history.ckpt_dir`) at
    `step`: a number, `"last"`/`None` or `"best"`. `state` gives the structure, shapes and
    shardings, not values; an nnx model (with its `optimizer=`) is restored in place.
    `weights_only=True`: only `params` and `batch_stats`, into a state with another optimizer or
    none. `ema=True`: the params are the run's `ema` average at that step. Checkpoints are plain
    orbax ones, with items `state` and `meta` (JSON)."""
    if _is_nnx(state):
        who = "load_ckpt" if optimizer or not weights_only else "evaluate"  # (no optimizer)
        model = _adapt(state, Options(optimizer=optimizer), who)
        return model.finish(*_load(model.state, ckpt_dir, step, weights_only=weights_only,
                                   ema=ema, frozen=model.frozen))
    if optimizer is not None:
        raise ValueError("load_ckpt: optimizer= is for nnx models; a TrainState carries its tx.")
    return _load(state, ckpt_dir, step, weights_only=weights_only, ema=ema)[0]


def _load(state, ckpt_dir, step, *, weights_only, ema, frozen=None):
    """`load_ckpt`'s restore: `(state, frozen)`, an nnx model's frozen base (`_restore_all`)."""
    for name, value in (("weights_only", weights_only), ("ema", ema)):
        if not isinstance(value, bool):
            raise TypeError(f"load_ckpt: {name} must be True or False, got {value!r}.")
    if ema and not weights_only and _ema_params(getattr(state, "opt_state", None)) is None:
        raise ValueError("load_ckpt: ema=True restores the whole state, so its optimizer must be "
                         "the run's, with fit.ema(tx); to load the average into a state with "
                         "another optimizer or none, pass weights_only=True.")
    url = _is_url(ckpt_dir)  # (a bucket's: as given; its client is checked first)
    ckpt_dir = str(ckpt_dir).rstrip("/") if url else os.path.abspath(os.path.expanduser(ckpt_dir))
    if not (_Bucket(ckpt_dir, "load_ckpt").isdir(ckpt_dir) if url else os.path.isdir(ckpt_dir)):
        raise FileNotFoundError(f"load_ckpt: no checkpoint directory at {ckpt_dir}.")
    mgr = _open(ckpt_dir, ocp.CheckpointManagerOptions(create=False))
    try:
        saved = mgr.all_steps()
        if not saved:
            raise FileNotFoundError(f"load_ckpt: {ckpt_dir} holds no complete checkpoint.")
        if step == "best":  # the best step that the latest checkpoint knows of
            step = _meta(mgr, max(saved), "load_ckpt")["best_step"]
            if step is None:
                raise ValueError(f"load_ckpt: {ckpt_dir} has no best checkpoint: its run kept "
                                 f"none (no eval set and no monitor=, or no value yet); pass "
                                 f"'last' or a step, or keep a best with fit(..., monitor="
                                 f"'train/loss').")
        step = max(saved) if step in (None, "last") else step
        if step not in saved:
            raise ValueError(f"load_ckpt: step {step!r} is not in {ckpt_dir}; it holds steps "
                             f"{sorted(saved)}: pass one of those, 'last' or 'best'.")
        sharding = jax.tree.map(lambda x: getattr(x, "sharding", None), state)
        placed = _place_state(state, 0, _replicated(_default_mesh()))
        if all(isinstance(s, jax.sharding.Sharding) for s in jax.tree.leaves(sharding)):
            placed = jax.device_put(placed, sharding)  # keep the caller's placement
        restored, _, frozen = _restore_all(mgr, step, placed, "load_ckpt", frozen=frozen,
                                           weights_only=weights_only, ema=ema)
        if weights_only and hasattr(state, "rng"):  # (placing filled a None rng, from seed 0)
            restored = restored.replace(rng=state.rng)
        return restored, frozen
    finally:
        mgr.close()


def _meta(mgr, step, who):
    """A checkpoint's `meta` item alone (JSON: `_Progress`)."""
    with _restoring(mgr, step, who):
        return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def evaluate(state: Any, ds: Any, eval_step: Callable | None = None,
             **options: Any) -> dict[str, Any]:
    """The metrics of `state` (a TrainState, or an nnx model) over all of `ds`, `{name: value}`
    (a dict of named sets: `{set: {name: value}}`): fit's exact, sharded, weighted eval, e.g.
    `evaluate(state, (x, y), eval_step, batch_size=256)`. `options`: fit's about the data and the
    placement; without `eval_step`, `loss_fn` or `nnx_loss_fn` gives the loss."""
    opts = Options.of({**options, "eval_step": eval_step})
    model = _adapt(state, opts, "evaluate")
    lean = lambda s: s.replace(opt_state=None) if hasattr(s, "opt_state") else s
    if hasattr(opts.state_sharding, "opt_state"):  # (a tree like the state: the same, lean)
        opts = dataclasses.replace(opts, state_sharding=lean(opts.state_sharding))
    mesh, state = _mesh(opts, model.state), lean(model.state)
    if ds is None:
        raise ValueError("evaluate: ds is None; pass the data (any form of fit's test_ds).")
    eval_data = _eval_sets(ds, "ds", opts, mesh)
    state = _place_state(state, opts.seed, lambda s: _state_shardings(s, opts, mesh))
    config = _StepConfig.of(opts, model.forward, model.eval_step, mesh, linen=model.linen)
    steps = _build_steps(state, None, eval_data, config, mesh,
                         frozen=_place_frozen(model.frozen, mesh))
    python = _python_metrics(opts.eval_metrics, model.view)
    out = {name: _eval_set(steps, test, state, name, python=python)
           for name, test in eval_data.items()}
    return out if isinstance(ds, dict) else out[None]


class History(dict):
    """`fit`'s history of the whole run, resumes too: lists of `epoch`, `step`, `train/<metric>`
    (epoch means) per epoch, `eval/epoch`, `eval/step`, `eval/...` (and `eval_ema/...`) per eval,
    and `stopped` (why a run stopped early); attributes `run`, `log_dir`, `ckpt_dir` and `timing`
    (`_Clock.timing`: seconds apart from the steady rate, e.g. `compile_s`, `eval_s`, `hooks_s`,
    `steady_steps_per_s`, the `perf/` speeds, XLA's memory estimate of the step, `steps_per_jit`:
    the k used, and "auto"'s times, us a step by k, `steps_per_jit_us`)."""
    run = log_dir = ckpt_dir = timing = None


# -- Hooks: hook(event, run); the progress bar and TensorBoard are hooks too -----------------------

class EarlyStopping:
    """A hook that stops when fit's `monitor` has not improved by more than `min_delta` for
    `patience` evals (epochs, for a train metric), and (`restore_best`) returns the best
    checkpoint's state. A value equal to the best (within `min_delta`) is no improvement: the count
    rises (as in Keras and Lightning). Its stop is final (see fit); its count is checkpointed.
    Another `monitor` than fit's raises: pass it to fit."""

    def __init__(self, patience: int = 3, min_delta: float = 0.0, restore_best: bool = True,
                 monitor: str | None = None) -> None:
        if not _positive_int(patience):
            raise ValueError(f"EarlyStopping: patience must be a positive int, got {patience!r}.")
        self.patience, self.min_delta = patience, min_delta
        self.restore_best, self.monitor = restore_best, monitor
        self.best, self.bad = None, 0

    def get_state(self) -> dict:
        return {"best": self.best, "bad": self.bad}

    def set_state(self, state: dict) -> None:
        self.best, self.bad = state["best"], state["bad"]

    def __call__(self, event: str, run: "_Run") -> None:
        if event == "train_start":
            if run.monitor is None:
                raise ValueError(f"EarlyStopping: this run follows no metric: it has no eval set "
                                 f"and fit was given no monitor=; pass fit monitor="
                                 f"{self.monitor or 'train/loss'!r} (a train metric is judged on "
                                 f"epochs' means), or an eval set.")
            if self.monitor not in (None, run.monitor):
                raise ValueError(f"EarlyStopping: monitor={self.monitor!r} differs from fit's "
                                 f"monitor={run.monitor!r}, which picks the checkpoint to "
                                 f"restore; pass monitor={self.monitor!r} to fit instead.")
            self.best, self.bad = None, 0  # (fit then restores the count of a resumed run)
        elif event in ("eval", "epoch_end") and run.monitor in run.metrics:
            value = run.metrics[run.monitor] * (1 if run.mode == "max" else -1)
            if self.best is None or value > self.best + self.min_delta:
                self.best, self.bad = value, 0
            else:
                self.bad += 1
                run.stop = self.bad >= self.patience
        elif event == "train_end" and self.restore_best and run.stopped_early:
            # (an nnx model's state leaves its frozen base out: the checkpoint holds it too)
            run.state = _load(run.state, run.ckpt_dir, "best", weights_only=False, ema=False,
                              frozen=run.frozen)[0]


class Profiler:
    """A hook tracing steps `start_step` to `start_step + num_steps`, rounded out to log points,
    into the run's TensorBoard directory (Profile tab: `pip install tensorboard-plugin-profile`)."""

    def __init__(self, start_step: int = 10, num_steps: int = 20) -> None:
        self.start_step, self.stop_step, self.running = start_step, start_step + num_steps, False

    def __call__(self, event: str, run: "_Run") -> None:
        inside = self.start_step <= run.step < self.stop_step
        if not self.running and inside and event != "train_end":
            jax.profiler.start_trace(run.log_dir)
            self.running = True
        elif self.running and (run.step >= self.stop_step or event == "train_end"):
            jax.block_until_ready(run.state)  # include the queued steps in the trace
            jax.profiler.stop_trace()
            self.running = False


class ProgressBar:
    """The built-in progress bar, a hook (process 0 only). `verbose=1`: a bar with the loss, the
    monitor, speed and an ETA without compiles, and a line per epoch; `verbose=2`: the lines."""

    def __init__(self, verbose: int = 1) -> None:
        self.verbose, self.bar, self.line, self.shown, self.drawn = verbose, None, None, {}, 0.0

    def __call__(self, event: str, run: "_Run") -> None:
        if self.line:  # an epoch's line waits for an eval of its step, if one follows
            step, head, metrics = self.line
            self.line = None
            if event == "eval" and run.step == step:
                metrics = {**metrics, **run.metrics}
            shown = [f"{k} {v:.4g}" for k, v in metrics.items() if not k.startswith("perf/")]
            tqdm.write(f"{head}: {', '.join(shown)}")  # (above an open bar, which it redraws)
        if event == "epoch_end":
            self.line = (run.step, f"epoch {run.epoch + 1}/{run.num_epochs}, step {run.step}",
                         dict(run.metrics))
        if event in ("log", "eval"):
            self.shown.update(run.metrics)
        if event == "train_start" and self.verbose == 1:
            self.bar = _Bar(total=run.total_steps, initial=run.step, unit="step", disable=False,
                            dynamic_ncols=True, bar_format="{desc}{percentage:3.0f}%|{bar}| "
                            "{n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        elif event == "train_end" and self.bar is not None:
            self._show_bar(run)  # (the last log point may not have been drawn)
            self.bar.close()
        # (a log point within tqdm's 0.1 s of the last drawing would not be drawn: skip its work)
        if self.bar is not None and (event in ("train_start", "eval") or event == "log" and
                                     time.monotonic() > self.drawn + 0.1):
            self._show_bar(run)

    def _show_bar(self, run):
        self.drawn = time.monotonic()
        epoch = min(run.epoch + 1, run.num_epochs)  # (at train_end, a finished run's last)
        self.bar.set_description(f"epoch {epoch}/{run.num_epochs}", refresh=False)
        names = ["train/loss"] + ([run.monitor] if run.monitor != "train/loss" else [])
        parts = [f"{n.split('/', 1)[-1]}={self.shown[n]:.4g}" for n in names if n in self.shown]
        if rate := self.shown.get("perf/steps_per_s"):
            parts.append(f"{rate:.3g} steps/s")
            if run.total_steps:
                parts.append(f"ETA {tqdm.format_interval((run.total_steps - run.step) / rate)}")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
        self.bar.update(run.step - self.bar.n)


class _Bar(tqdm):
    monitor_interval = 0  # tqdm's monitor thread would outlive fit; fit updates the bar itself


class TensorBoard:
    """The built-in TensorBoard writer, a hook like any other (process 0 only): `train/` and
    `perf/` scalars at log points, `eval/` and `best/<monitor>` at evals (array metrics as text
    tables), and the run's hparams for the HParams tab, all in `history.log_dir`. `run.writer` is
    its SummaryWriter."""

    def __init__(self, hparams: dict) -> None:
        # TensorBoard takes numbers, strings, booleans: numpy scalars via JSON, the rest as text.
        self.hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                        for k, v in _jsonable(hparams).items()}
        self.writer = None  # a metric's tag, cleaned as tensorboardX's add_scalar does, once:
        self._tag = functools.cache(lambda name: scalar_summary(name, 0.0).value[0].tag)

    def __call__(self, event: str, run: "_Run") -> None:
        if event == "train_start":
            purge = run.step + 1 if run.step else 0  # (a resume logs those steps again)
            run.writer = self.writer = SummaryWriter(run.log_dir)
            self.flushed = time.monotonic()
            # tensorboardX 2.6's flush() skips its writer thread's queue (only close() drains it),
            # so a killed run could lose logs its resume skips: events are written directly, the
            # purge records first (purge_step would queue them behind those).
            events = self.writer.file_writer.event_writer
            events.add_event = events._ev_writer.write_event
            events.add_event(Event(step=purge, file_version="brain.Event:2"))
            events.add_event(Event(step=purge, session_log=SessionLog(status=SessionLog.START)))
            # Once a run, so a crashed run shows them too; no experiment summary: with one per
            # run, TensorBoard hides the other runs' columns.
            if not run.resumed:
                self.writer.file_writer.add_summary(hparams_summaries(self.hparams, {})[1])
            if run.changed:  # (the HParams tab keeps the first call's values)
                self.writer.add_text("options_changed", "\n".join(
                    f"- {k}: {a!r} -> {b!r}" for k, (a, b) in run.changed.items()), run.step)
        elif self.writer is None:
            return
        elif event in ("log", "eval", "epoch_end", "save"):
            if run.metrics and event != "epoch_end":  # one event for all: ~4x cheaper than one each
                values = [Summary.Value(tag=self._tag(k), simple_value=float(v))
                          for k, v in run.metrics.items()]
                self.writer.file_writer.add_summary(Summary(value=values), run.step)
            for tag, array in run.arrays.items():  # (TensorBoard's Text tab)
                self.writer.add_text(tag, _table(array), run.step)
            tracked = "eval" if _is_eval(run.monitor) else "epoch_end"
            if event == tracked and run.best is not None:
                self.writer.add_scalar(f"best/{run.monitor}", run.best, run.step)
            # On disk before each checkpoint, and every 10 s: an fsync a log point cost ~8%.
            if event == "save" or time.monotonic() > self.flushed + 10:
                self.writer.flush()
                self.flushed = time.monotonic()
        elif event == "train_end":
            if not run.interrupted:  # the HParams session ended well
                self.writer.file_writer.add_summary(hparams_summaries({}, {})[2])
            self.writer.close()
            run.writer = self.writer = None


def _builtin(hook):
    """Whether a hook is one fit adds itself (a subclass too): its time counts as fit's, and it
    closes its bar and files after an error."""
    return isinstance(hook, (ProgressBar, TensorBoard))


def _table(array):
    """An array as a markdown table (1-D: one row; 2-D: a row each), else as text."""
    if array.ndim not in (1, 2):
        return f"<pre>{array}</pre>"
    rows = np.atleast_2d(array)
    cells = lambda values: "| " + " | ".join(map(str, values)) + " |"
    head = [cells(["", *range(rows.shape[1])]), cells(["---"] * (rows.shape[1] + 1))]
    return "\n".join(head + [cells([i, *row]) for i, row in enumerate(rows.tolist())])


# -- The model: a TrainState called as linen's, an nnx model as a TrainState of its variables ------

_Model = collections.namedtuple("_Model", "state forward eval_step view finish linen frozen "
                                           "split")


def _adapt(model, opts, who="fit", spec=None):
    """A `_Model`: a TrainState as it is; an nnx model as a TrainState of plain dicts: `params`
    what the optimizer trains (`wrt`), `batch_stats` every other variable (the Rngs' state too)
    but the frozen base, merged in each step in plain jax.jit. `frozen`: the nnx.Params outside
    `wrt` that the step leaves unchanged (a LoRA fine-tune's base; None if none), passed to each
    step apart, neither donated nor returned (`_joined`); those the loss changes (an nnx.EMA's
    averages) are state, carried in `batch_stats` (`_frozen_base`, traced on `spec`, the train
    batch's shapes; without it, `evaluate` and `load_ckpt`, all are the base). `view(state)`: what
    `eval_step` and `eval_metrics` are given (an nnx model in eval mode); `finish(state, frozen)`
    writes the state back (into the nnx model); `split`: the base's size, said at the start."""
    if not _is_nnx(model):
        return _Model(model, _linen_forward, opts.eval_step, _itself, _itself, True, None, "")
    from flax import nnx
    optimizer, loss_fns = _nnx_optimizer(opts.optimizer, who), (opts.loss_fn, opts.nnx_loss_fn)
    nnx.pop(model, nnx.Intermediate)  # sow()n values are per call outputs, not state to carry
    base, split = _frozen_base(model, optimizer.wrt, loss_fns, spec)
    graphdef, params, frozen, rest = nnx.split(model, optimizer.wrt, base, ...)
    frozen = _pure(frozen) or None
    state = TrainState(step=optimizer.step[...], apply_fn=None, params=_pure(params),
                       tx=optimizer.tx, opt_state=_pure(optimizer.opt_state),
                       batch_stats=_pure(rest))
    _nnx_fits(state, who)
    carried = nnx.Not(nnx.Any(optimizer.wrt, base) if frozen else optimizer.wrt)

    def merged(params, stats, train):  # (stats: the other variables, or a _WithBase)
        model = nnx.merge(graphdef, params, *(stats if isinstance(stats, _WithBase) else [stats]))
        model.train() if train else model.eval()  # Dropout and BatchNorm read these flags
        return model

    def forward(loss_fn, state, params, batch, rng, *, train):
        model = merged(params, state.batch_stats, train)
        out = _nnx_loss(model, batch, rng, loss_fn, loss_fns[1])
        nnx.pop(model, nnx.Intermediate)
        stats = _pure(nnx.state(model, carried))
        if isinstance(state.batch_stats, _WithBase):  # the base goes back as it came, unchanged
            _check_frozen(_pure(nnx.state(model, base)), state.batch_stats.base)
            stats = _WithBase(stats, state.batch_stats.base)
        return out, stats

    view = lambda state: merged(state.params, state.batch_stats, False)
    eval_fn = lambda state, batch: opts.eval_step(view(state), batch)

    def finish(state, frozen=None):
        nnx.update(model, state.params, state.batch_stats, *([frozen] if frozen else []))
        if state.tx is not None:
            nnx.update(optimizer.opt_state, nnx.state(state.opt_state))
            optimizer.step.set_value(state.step.astype(optimizer.step[...].dtype))  # (any mesh)
        return model

    return _Model(state, forward, opts.eval_step and eval_fn, view, finish, False, frozen, split)


def _frozen_base(model, wrt, loss_fns, spec):
    """`(filter, said)`: the frozen base, the Params outside `wrt` that the train loss leaves
    unchanged, found by tracing it once on the batch's shapes `spec`; those it changes (an nnx.EMA
    that `nnx_loss_fn` updates) are state to carry from step to step. A loss that fails here
    changes nothing: the step's own trace (`_trace`) reports it, with advice. `said`: the split,
    for the run's first line."""
    from flax import nnx
    outside, changed = nnx.All(nnx.Param, nnx.Not(wrt)), set()
    count = len(jax.tree.leaves(nnx.state(model, outside)))
    graphdef, variables = nnx.split(model)

    def probe(variables, batch):
        model = nnx.merge(graphdef, variables)
        model.train()
        before = _pure(nnx.state(model, outside))
        _nnx_loss(model, batch, jax.random.key(0), *loss_fns)
        after = jax.tree_util.tree_leaves_with_path(_pure(nnx.state(model, outside)))
        changed.update(_path_name(p) for (p, a), b in zip(after, jax.tree.leaves(before))
                       if a is not b)
    if count and spec is not None:
        with contextlib.suppress(Exception):
            jax.eval_shape(probe, variables, spec)
    said = f", of the Params outside wrt {count - len(changed)} frozen and {len(changed)} " \
           f"carried as state (the step changes them)" if count else ""
    return nnx.All(outside, nnx.Not(lambda path, _: "/".join(map(str, path)) in changed)), said


def _pure(tree):
    """nnx States as plain dicts: jit flattens the state each call, an nnx.State twice as slowly."""
    from flax import nnx
    is_state = lambda x: isinstance(x, nnx.State)
    return jax.tree.map(lambda x: nnx.to_pure_dict(x) if is_state(x) else x, nnx.as_pure(tree),
                        is_leaf=is_state)


# Inside a step of an nnx model with a frozen base, its `batch_stats`: the model's other variables
# (`rest`) and the base (`base`, an argument of the step's own, neither donated nor returned).
_WithBase = collections.namedtuple("_WithBase", "rest base")


def _joined(state, frozen):
    """Traced: the state as the model's forward reads it, its `batch_stats` a `_WithBase` where
    there is a frozen base."""
    return state if frozen is None else state.replace(batch_stats=_WithBase(state.batch_stats,
                                                                            frozen))


def _parted(state):
    """Traced: the state without the frozen base, as the step returns it."""
    stats = getattr(state, "batch_stats", None)
    return state.replace(batch_stats=stats.rest) if isinstance(stats, _WithBase) else state


def _linen_forward(loss_fn, state, params, batch, rng, *, train):
    """A linen model's `(loss_fn(outputs, targets), new batch_stats)`; dropout draws from `rng`."""
    inputs, targets = batch
    stats = getattr(state, "batch_stats", {})  # (a class without the field: a model without)
    has_stats = bool(jax.tree.leaves(stats))
    variables = {"params": params, **({"batch_stats": stats} if has_stats else {})}
    kwargs = {"rngs": {"dropout": rng}, "mutable": ["batch_stats"] if has_stats else False}
    out = state.apply_fn(variables, inputs, train=train, **(kwargs if train else {}))
    if train and has_stats:  # (with mutable collections, apply returns them beside the outputs)
        out, stats = out[0], out[1]["batch_stats"]
    return loss_fn(out, targets), stats


def _nnx_loss(model, batch, rng, loss_fn, nnx_loss_fn):
    """An nnx model's loss on a batch: `nnx_loss_fn(model, batch, rngs)` with `rngs` of the step's
    key (fit's rng, not the model's), or by name where it names them so (the NNX tutorial's loss_fn
    takes `(model, rngs, batch)`); else `loss_fn(model(inputs), targets)`, Dropout drawing from the
    model's own Rngs, carried in batch_stats. (At trace time only: no cost a step.)"""
    if not nnx_loss_fn:
        return loss_fn(model(batch[0]), batch[1])
    from flax import nnx
    try:
        p = inspect.signature(nnx_loss_fn).parameters
    except (TypeError, ValueError):  # (a signature Python cannot read: called positionally)
        p = {}
    if all(k in p and p[k].kind != p[k].POSITIONAL_ONLY for k in ("batch", "rngs")):
        return nnx_loss_fn(model, batch=batch, rngs=nnx.Rngs(rng))
    return nnx_loss_fn(model, batch, nnx.Rngs(rng))


# -- Placement: the mesh, the state's shardings and its private copy, batches on the devices -------

def _mesh(opts, state):
    """`mesh=`; else the mesh the state's arrays are sharded over (they keep their shardings); else
    the one set with `jax.set_mesh` around the call; else every device along one 'data' axis. It
    must have the `batch_axes`; an 'fsdp' axis outside them is said once (its devices would repeat
    each other's rows)."""
    own = {x.sharding.mesh for x in jax.tree.leaves(state) if _split(x)}
    mesh = opts.mesh or _default_mesh()
    if opts.mesh is None and opts.state_sharding is None and len(own) == 1:
        mesh = own.pop()
    axes = tuple(opts.batch_axes)
    if not set(axes) <= set(mesh.axis_names):
        where = "mesh=" if opts.mesh else "the state's mesh (or the one set with jax.set_mesh)"
        raise ValueError(f"fit: {where} has axes {mesh.axis_names}, without the batch_axes "
                         f"{axes} to shard batches over; pass batch_axes= naming its axes (e.g. "
                         f"batch_axes=('fsdp',)), or a mesh with them.")
    if "fsdp" in mesh.axis_names and "fsdp" not in axes and mesh.shape["fsdp"] > 1:
        warnings.warn(f"fit: the mesh's 'fsdp' axis ({mesh.shape['fsdp']} devices) is not among "
                      f"batch_axes={axes}, so its devices compute the same rows; pass batch_axes="
                      f"{axes + ('fsdp',)} to split the batch over them too.", stacklevel=3)
    if not opts.axis_name:
        return mesh  # as given: the mesh that the state's shardings name, axis types and all
    # A model written for pmap calls lax.pmean(..., axis_name): the batch axis takes that name.
    names = tuple(opts.axis_name if axis == axes[0] else axis for axis in mesh.axis_names)
    return Mesh(mesh.devices, names, axis_types=mesh.axis_types)


def _batch_axes(opts):
    """The mesh axes a batch's rows are split over (with axis_name: that one, renamed)."""
    return (opts.axis_name,) if opts.axis_name else tuple(opts.batch_axes)


def _default_mesh():
    """The mesh set with `jax.set_mesh` around the call, else every device on one 'data' axis."""
    context = jax.sharding.get_mesh()
    return Mesh(np.array(jax.devices()), ("data",)) if context.empty else context


def _local_shards(mesh, axes):
    """Over how many slices of the batch `axes` this process's devices split its rows."""
    return len(_slices(mesh, tuple(axes)))


@functools.lru_cache(maxsize=None)
def _slices(mesh, axes):
    """The slices of a batch's rows (over the batch `axes`, in order) this process's devices
    hold."""
    at = [mesh.axis_names.index(axis) for axis in axes]
    shape = [mesh.devices.shape[i] for i in at]
    return sorted({int(np.ravel_multi_index([idx[i] for i in at], shape))
                   for idx in np.ndindex(mesh.devices.shape)
                   if mesh.devices[idx].process_index == jax.process_index()})


def _share(mesh, axes):
    """`(i, n)`: this process feeds the i-th of n equal shares of every global batch's rows, the
    slices its devices hold (n = 1 where every process holds all: the batch axes within each)."""
    mine = _slices(mesh, tuple(axes))
    if mine != list(range(mine[0], mine[0] + len(mine))) or mine[0] % len(mine):
        raise ValueError(f"fit: the mesh gives process {jax.process_index()} the batch slices "
                         f"{mine} (over batch_axes {tuple(axes)}), not one block of them; order "
                         f"the mesh's devices by process.")
    return mine[0] // len(mine), math.prod(mesh.shape[a] for a in axes) // len(mine)


def _split(x):
    """Whether `x` is an array split over the devices of a mesh."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated


def _state_shardings(state, opts, mesh):
    """Where each leaf of the state lives: `state_sharding` (a tree like the state, or a function of
    it, of PartitionSpecs or shardings, as your own jax.jit takes, e.g. from
    `flax.linen.get_partition_spec`) over `mesh`; else a leaf's own over `mesh`; else replicated."""
    if opts.state_sharding is None:
        return _ema_as_params(jax.tree.map(lambda x: x.sharding if _split(x) and
                                           x.sharding.mesh == mesh else _replicated(mesh),
                                           state))
    tree = opts.state_sharding(state) if callable(opts.state_sharding) else opts.state_sharding
    is_leaf = lambda x: x is None or isinstance(x, (P, jax.sharding.Sharding))
    to_sharding = lambda s: s if isinstance(s, jax.sharding.Sharding) else NamedSharding(
        mesh, s or P())
    try:
        shardings = jax.tree.map(to_sharding, tree, is_leaf=is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(f"fit: state_sharding must be a tree like the state (or a function of "
                         f"it) of PartitionSpecs or shardings: {e}") from None
    if jax.tree.structure(shardings) != jax.tree.structure(state):  # (a prefix of the state)
        return shardings
    return _ema_as_params(jax.tree_util.tree_map_with_path(functools.partial(_on_mesh, mesh),
                                                           state, shardings))


def _ema_as_params(shardings):
    """The state's shardings with an `ema` average's leaves placed as the params are."""
    if not hasattr(shardings, "opt_state") or not hasattr(shardings, "params"):
        return shardings
    like = lambda x: x._replace(fit_ema_params=shardings.params) if _is_ema(x) else x
    return shardings.replace(opt_state=jax.tree.map(like, shardings.opt_state, is_leaf=_is_ema))


def _on_mesh(mesh, path, x, sharding):
    """A leaf `state_sharding` leaves on one device of a larger mesh (made there, as fit's `rng`) is
    replicated if a scalar or `rng`; a larger one would fail every step ("incompatible devices")."""
    if len(sharding.device_set) != 1 or mesh.size == 1:
        return sharding
    name = _path_name(path)
    if np.ndim(x) == 0 or name == "rng":
        return _replicated(mesh)
    raise ValueError(f"fit: state_sharding puts {name} (shape {np.shape(x)}) on one device, "
                     f"{next(iter(sharding.device_set))}, but the mesh has {mesh.size}; give it "
                     f"a PartitionSpec (P() to replicate it) or a sharding over the mesh.")


def _place_state(state, seed, sharding):
    """A private, placed copy of the caller's state (the step donates its input) with strong
    dtypes (`TrainState.create` makes a weakly-typed step, orbax restores a strong one), so a fresh
    and a restored state hit one compilation. `sharding`: a Sharding, or a function of the state."""
    if getattr(state, "rng", False) is None:  # (fit's TrainState: raw key data, for orbax)
        state = state.replace(rng=jax.random.key_data(jax.random.key(seed)))
    if getattr(state, "batch_stats", False) is None:
        state = state.replace(batch_stats={})
    # Weak types and non-jax leaves (Python and numpy scalars) become strong numpy values.
    state = jax.tree.map(lambda x: x if isinstance(x, jax.Array) and not getattr(
        x, "weak_type", False) else np.asarray(x), state)  # (typed keys have no weak_type)
    sharding = sharding(state) if callable(sharding) else sharding
    # The transfer makes the copy (jnp's compiles an op per shape); onto several devices it reuses
    # the caller's buffer as one shard (jax 0.10), which donation would delete: copied then.
    placed = jax.device_put(state, sharding, may_alias=False)
    # (addressable_data: addressable_shards may list shards another process holds, jax 0.10)
    buffers = lambda x: {x.addressable_data(i).unsafe_buffer_pointer()
                         for i in range(len(x.sharding.addressable_devices))}
    aliases = lambda p, x: isinstance(x, jax.Array) and (_is_key(x) or buffers(p) & buffers(x))
    return jax.tree.map(lambda p, x: jnp.array(p, copy=True) if aliases(p, x) else p, placed, state)


def _place_frozen(frozen, mesh):
    """An nnx model's frozen base on the mesh: the caller's arrays where they have their sharding
    on it already (no copy: the base is never donated), else one copy (replicated)."""
    if frozen is None:
        return None
    return jax.device_put(frozen, jax.tree.map(lambda x: x.sharding if _split(x) and
                                               x.sharding.mesh == mesh else _replicated(mesh),
                                               frozen))


def _putter(mesh, axes):
    """`put(batch, stacked=False)`: a batch (this process's rows) sharded along its leading axis
    (`stacked`: each of k batches'); one that does not split evenly (a small last batch) goes whole
    to every device. Shardings are made here, once (~1-5 us a batch). On one device numpy goes to
    the step as it is: jit's C++ path places it faster than device_put (H100: +10% steps/s); and
    so does an array on that device already (device_put cost ~0.1 ms a batch on a CPU, #49)."""
    if mesh.size == 1 and jax.process_count() == 1:
        one = _replicated(mesh)
        there = lambda a: isinstance(a, np.ndarray) or a.sharding.device_set == one.device_set
        put = lambda batch, stacked=False: batch if all(map(there, jax.tree.leaves(
            batch))) else jax.device_put(batch, one)
        put.keeps_numpy = True  # (`_Data.calls` skips it for data all numpy)
        return put
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards, shares, processes = _local_shards(mesh, axes), _share(mesh, axes)[1], \
        jax.process_count()
    rows = axes[0] if len(axes) == 1 else axes  # (the rows split over the batch axes)
    split = [NamedSharding(mesh, P(rows)), NamedSharding(mesh, P(None, rows))]
    whole = _replicated(mesh)

    def put(batch, stacked=False):
        whole_here = isinstance(batch, _Whole)  # (arrays' last batch, on every process)
        held = whole_here or shares == 1  # (every process holds all its rows: no gather)
        batch = tuple(batch) if whole_here else batch
        splits = not whole_here and jax.tree.leaves(batch)[0].shape[stacked] % shards == 0
        sharding = split[stacked] if splits else whole
        if processes == 1:
            return jax.device_put(batch, sharding)
        if not (splits or held):  # every device needs the whole global batch: gather all rows
            # (a host round trip, once an epoch)
            batch = jax.tree.map(lambda a: np.concatenate(a, axis=int(stacked)),
                                 multihost_utils.process_allgather(batch))
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), batch)
    return put


_replicated = lambda mesh: NamedSharding(mesh, P())


# -- Data: batches and their positions for a resume; steps_per_jit's groups; put ahead -------------

def _eval_sets(ds, who, opts, mesh=None):
    """The eval data as `{name: _Data}`: a dict's named sets, or one set named None; each capped
    by `eval_steps` (an int for all, a dict by name)."""
    if ds is None:
        return {}
    caps = opts.eval_steps
    if not isinstance(ds, dict):
        if isinstance(caps, dict):
            raise ValueError(f"fit: eval_steps is a dict by eval set, but {who} is one set, not a "
                             f"dict of named sets; pass eval_steps=<int>.")
        return {None: _Data(ds, who, opts, train=False, eval_steps=caps, mesh=mesh)}
    if not ds or all(hasattr(v, "__array__") for v in ds.values()):
        raise ValueError(f"fit: a dict {who} is named eval sets {{name: data}}, each value any "
                         f"form of one set (arrays (x, y), batches), got "
                         f"{'an empty dict' if not ds else f'a dict of arrays {list(ds)}'}."
                         f"{'' if not ds else ' For one set of arrays, pass (x, y).'}")
    bad = [n for n in ds if not (isinstance(n, str) and re.fullmatch(r"[\w.-]+", n))]
    unknown = set(caps) - set(ds) if isinstance(caps, dict) else ()
    if bad or unknown:
        raise ValueError(f"fit: {who}'s eval sets are named by strings of letters, digits, '_',"
                         f" '-' or '.' (eval/<name>/<metric>), and eval_steps by those names; got "
                         f"{bad or sorted(map(str, unknown))}.")
    if not isinstance(caps, dict):
        caps = dict.fromkeys(ds, caps)
    return {name: _Data(data, f"{who}[{name!r}]", opts, train=False, eval_steps=caps.get(name),
                        mesh=mesh)
            for name, data in ds.items()}


class _Data:
    """A data argument as per-epoch iterators of `(batch, position)` (numpy arrays, or jax.Arrays
    on their devices); `position` (batches done, iterator state) is where a checkpoint resumes,
    exactly for arrays, re-iterables, grain-style iterators and deterministic one-shot streams."""

    def __init__(self, ds, name, opts, train, eval_steps=None, *, mesh=None):
        self.name, self.train_set, self.seed = name, train, opts.seed if opts.shuffle else None
        # (this process's share of a global batch: `_share`; all of it without a mesh)
        self.share = _share(mesh, _batch_axes(opts)) if mesh else (0, 1)
        self.keys = opts.batch_keys  # (custom functions take batches as they come)
        self.custom = (opts.train_step if train else opts.eval_step) or opts.nnx_loss_fn
        self.cap = opts.steps_per_epoch if train else eval_steps  # (batches an epoch, at most)
        # A tuple (x, y) of two arrays (or anything np.asarray takes that has a shape: torch, tf
        # tensors) is arrays; a list is batches, whatever its length.
        self.arrays = isinstance(ds, tuple) and len(ds) == 2 and all(
            hasattr(a, "__array__") and len(getattr(a, "shape", ())) > 0 for a in ds)
        self.stream, self.sizes, self.spec, self.kinds = False, None, None, None
        first = self._arrays(ds, opts.batch_size) if self.arrays else self._iterable(ds)
        self.spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), first)
        self.kinds = _kinds(first)  # what every later batch is compared with (_convert)
        if any(isinstance(a, jax.Array) and not a.is_fully_addressable
               for a in jax.tree.leaves(first)):
            raise ValueError(f"fit: {name} holds jax.Arrays spread over several processes; "
                             f"give each process its own rows (numpy arrays, or jax.Arrays on "
                             f"its own devices): fit makes the global batches.")
        self.batch_size, self.ready = jax.tree.leaves(first)[0].shape[0], None  # (this process's)
        if not self.arrays:  # (each process yields its share of every global batch)
            self.global_batch = self.batch_size * self.share[1]
        if self.sizes is None and isinstance(ds, (list, tuple)):  # in memory: check every batch
            checked = [self._convert(raw, i) for i, raw in enumerate(ds)]
            self.sizes = [len(jax.tree.leaves(batch)[0]) for batch in checked]
            if type(ds) in (list, tuple):  # (a subclass may iterate its own way)
                self.ready = checked  # its batches as they will be fed, checked once
        # Whether every batch is numpy (arrays, or a list's checked batches): no placing on one
        # device (`_putter`), where jit takes numpy as it is.
        held = (self.x, self.y) if self.arrays else self.ready
        self.numpy = held is not None and all(isinstance(a, np.ndarray)
                                              for a in jax.tree.leaves(held))

    def _arrays(self, ds, batch_size):
        """Arrays (x, y): every process passes the same ones, and `batch_size` is the global
        batch, of which each process takes its share: the same batches on any process count."""
        if batch_size is None:
            raise ValueError(f"fit: {self.name} is a pair of arrays (x, y); pass batch_size= so "
                             f"fit can batch them.")
        if batch_size % self.share[1]:
            raise ValueError(f"fit: batch_size={batch_size} is the global batch of {self.name} "
                             f"(every process passes the same arrays and takes its share of each "
                             f"batch), so it must divide by the {self.share[1]} processes' shares.")
        # jax.Arrays stay on their devices: their batches are gathered there, not on the host.
        x, y = (a if isinstance(a, jax.Array) else np.asarray(a) for a in ds)
        self.x, self.y, n = x, y, len(x)
        if n != len(self.y) or n == 0:
            raise ValueError(f"fit: {self.name} must be two non-empty arrays with the same "
                             f"number of examples, got {n} inputs and {len(self.y)} targets.")
        self.length = min(math.ceil(n / batch_size), self.cap or math.inf)
        self.sizes = [min(batch_size, n - i * batch_size) for i in range(self.length)]
        self.global_batch = batch_size
        # Rows `idx` of x and y, one gather each (`take`: ~3x faster than x[idx] for a few rows):
        # `idx` a batch's rows, or k batches' (k, rows).
        self.rows = lambda idx: (x.take(idx, 0), y.take(idx, 0))
        if isinstance(x, jax.Array) or isinstance(y, jax.Array):
            self.rows = self._device_rows
        return self._convert(tuple(next(self._array_calls(0, 0))[0]), 0)

    def _array_calls(self, epoch, skip, step=0, group=None):
        """Arrays' calls from batch `skip` on (see `calls`): a batch's rows, or k batches' at once
        (a group's), sorted within each batch (a memory-mapped file is read in order); the last
        batch, if smaller and not split evenly over the processes, whole (`_Whole`)."""
        order = np.arange(len(self.x))
        if self.train_set and self.seed is not None:  # (shuffled each epoch: alike everywhere)
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        (p, processes), n = self.share, self.global_batch
        full = min(len(order) // n, self.length)  # (full batches: one sort of all, an epoch)
        rows = np.sort(order[:full * n].reshape(full, n), axis=1)
        rows = np.ascontiguousarray(rows[:, p * n // processes:(p + 1) * n // processes])
        while skip < full:
            k = group.steps_at(step) if group else 1
            k = k if skip + k <= full else 1
            yield self.rows(rows[skip] if k == 1 else rows[skip:skip + k]), (skip + k, None), k
            skip, step = skip + k, step + k
        if skip < self.length:  # the smaller last batch
            last = np.sort(order[full * n:])
            share = len(last) // processes
            yield (_Whole(self.rows(last)) if len(last) % processes else
                   self.rows(last[p * share:(p + 1) * share])), (skip + 1, None), 1

    def _device_rows(self, idx):
        """Rows `idx` of x and y where each is: device arrays' in one call, numpy's on the host."""
        on_device = [a for a in (self.x, self.y) if isinstance(a, jax.Array)]
        rows = iter(_take(on_device, idx))
        return tuple(next(rows) if isinstance(a, jax.Array) else a.take(idx, 0)
                     for a in (self.x, self.y))

    def _iterable(self, ds):
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(0)
        try:
            iterator = iter(ds)
        except TypeError:
            raise TypeError(f"fit: {self.name} must be arrays (x, y) or an iterable of batches, "
                            f"got {type(ds).__name__}.") from None
        self.stream = iterator is ds  # a one-shot iterator: generators, tfds.as_numpy, ...
        raw = next(iterator, None)
        if raw is None:
            raise ValueError(f"fit: {self.name} is empty: it yielded no batches.")
        # Epoch 0 goes on from this iterator: loaders start workers at each iter(), for seconds.
        self.peeked = None if self.stream else (iterator, raw, _position(iterator))
        self.ds, self.fresh = (itertools.chain([raw], iterator) if self.stream else ds), True
        self.length = len(ds) if hasattr(ds, "__len__") and not self.stream else None
        return self._convert(raw, 0)

    def __iter__(self):
        """One pass of the batches, as `eval_metrics` functions get an eval set: every global
        batch of arrays (each process has them all), this process's own batches of the rest."""
        if self.arrays:
            n = self.global_batch
            return (self.rows(np.arange(i * n, min((i + 1) * n, len(self.x))))
                    for i in range(self.length))
        return (batch for batch, _ in self.epoch(0))

    def describe(self):
        """What processes must agree on: batch count ('?': unknown), sizes, first batch's shapes."""
        if self.arrays:  # the same arrays on every process: their size and 16 rows' hash
            rows = np.unique(np.linspace(0, len(self.x) - 1, 16).astype(np.int64))
            sample = [np.asarray(a[rows]).tobytes() for a in (self.x, self.y)]
            digest = hashlib.sha256(b"".join(sample)).hexdigest()[:12]
            return (f"{self.name}: arrays of {len(self.x)} rows (hash {digest}), batch_size="
                    f"{self.global_batch}")
        counts = sorted(collections.Counter(self.sizes or []).items())
        sizes = ", ".join(f"{k} of {n}" for n, k in counts)
        shapes = ", ".join(f"{s.shape} {s.dtype}" for s in jax.tree.leaves(self.spec))
        return (f"{self.name}: {'?' if self.length is None else self.length} batches"
                f"{f' ({sizes} rows)' if sizes else ''} shaped {shapes}")

    def _convert(self, batch, index):
        """A batch as arrays (numpy or jax.Array as they are, anything np.asarray takes as numpy),
        checked against the first: per batch, a flatten and a comparison of dtype objects and ranks
        (not `str(dtype)`, ~7 us a leaf)."""
        if isinstance(batch, dict) and (self.keys or not self.custom):
            if not self.keys or not set(self.keys) <= set(batch):
                raise TypeError(f"fit: {self.name} yields dicts with keys {sorted(batch)}; name "
                                f"the inputs and targets with batch_keys=(inputs_key, targets_"
                                f"key) (got {self.keys}), or pass your own train/eval_step "
                                f"(nnx_loss_fn for an nnx model).")
            batch = (batch[self.keys[0]], batch[self.keys[1]])
        if not self.custom and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            length = f" of length {len(batch)}" if hasattr(batch, "__len__") else ""
            raise TypeError(f"fit: {self.name} must yield (inputs, targets) pairs, but batch "
                            f"{index} is a {type(batch).__name__}{length}.")
        batch = tuple(batch) if isinstance(batch, list) else batch
        leaves, treedef = jax.tree.flatten(batch)
        if not all(isinstance(a, (np.ndarray, jax.Array)) for a in leaves):
            leaves = [a if isinstance(a, (np.ndarray, jax.Array)) else np.asarray(a)
                      for a in leaves]
            batch = jax.tree.unflatten(treedef, leaves)
        kinds = (treedef, tuple((a.dtype, a.ndim) for a in leaves))  # (as _kinds, inline)
        if kinds != self.kinds or len({a.shape[0] if a.ndim else None for a in leaves}) != 1:
            self._refuse(leaves, index)
        return batch

    def _refuse(self, leaves, index):
        """The error for a batch unlike the first (a first batch passes if it can be one)."""
        if not leaves or any(a.ndim == 0 for a in leaves) or len({len(a) for a in leaves}) != 1:
            raise ValueError(f"fit: every array in a batch of {self.name} needs the same "
                             f"leading (batch) dimension; batch {index} has shapes "
                             f"{[a.shape for a in leaves]}.")
        if self.kinds is not None:
            given = [(a.shape, str(a.dtype)) for a in leaves]
            first = [(s.shape, str(s.dtype)) for s in jax.tree.leaves(self.spec)]
            raise ValueError(f"fit: batch {index} of {self.name} has shapes/dtypes {given}, "
                             f"unlike the first batch's {first}; batches may differ in their "
                             f"sizes and lengths (each new shape compiles once), not in their "
                             f"structure, dtypes or number of dimensions.")

    def calls(self, epoch, position=(0, None), step=0, group=None, put=None):
        """One epoch's calls `(batch, position, k, last)` from `position` on (batches trained
        before a resume, a loader's state): k batches of one shape stacked where
        `group.steps_at(step)` says k (steps_per_jit; arrays: gathered at once), every other batch
        alone, each `put` on its devices two calls ahead (asynchronously, while steps run: the
        look-ahead tells the epoch's `last`); `position`: where a checkpoint after it resumes."""
        calls = (self._array_calls(epoch, position[0], step, group) if self.arrays else
                 _grouped(self.epoch(epoch, *position), step, group))
        numpy = self.numpy and getattr(put, "keeps_numpy", False)
        queue, put = collections.deque(), _itself if numpy or put is None else put
        for batch, position, k in calls:
            queue.append((put(batch, k > 1), position, k))
            if len(queue) > 2:
                yield *queue.popleft(), False
        while queue:
            yield *queue.popleft(), not queue

    def epoch(self, epoch, skip=0, data_state=None):
        """One epoch's `(batch, position)` of an iterable, skipping `skip` batches."""
        if self.ready is not None:  # a list: nothing to check again
            for i in range(skip, min(len(self.ready), self.cap or math.inf)):
                yield self.ready[i], (i + 1, None)
            return
        if self.stream:
            # A resumed stream restarts: drop what was consumed (exact if it is deterministic).
            drop = skip + epoch * (self.cap or 0) if self.fresh else skip
            self.fresh = False
            pairs = ((raw, None) for raw in itertools.islice(self.ds, drop, None))
        else:
            pairs = self._positioned(epoch, skip, data_state)
        limit, done = self.cap - skip if self.cap else None, skip
        for done, (raw, position) in enumerate(itertools.islice(pairs, limit), skip + 1):
            yield self._convert(raw, done - 1), (done, position)
        if done == skip and self.train_set:  # (an empty eval set says so itself)
            raise ValueError(f"fit: {self.name} yielded no batches in epoch {epoch + 1}; pass a "
                             f"re-iterable (a list, a loader) or steps_per_epoch=.")

    def _positioned(self, epoch, skip, data_state):
        """A re-iterable's batches, each with the iterator's state after it (its position)."""
        peeked, self.peeked = self.peeked, None
        if peeked and not (epoch or skip):
            iterator, raw, position = peeked
            yield raw, position
        else:
            if hasattr(self.ds, "set_epoch"):
                self.ds.set_epoch(epoch)
            iterator = iter(self.ds)
            if data_state is not None and skip and hasattr(iterator, "set_state"):
                saved = data_state.get("bytes")
                iterator.set_state(saved.encode() if saved else data_state["state"])
            else:
                for _ in range(skip):  # (not islice: that would hide get_state)
                    next(iterator, None)
        end = object()  # (not iter(next, None): a numpy batch would be compared elementwise)
        resumable = hasattr(iterator, "get_state") and hasattr(iterator, "set_state")
        while (raw := next(iterator, end)) is not end:
            yield raw, _position(iterator) if resumable else None


_take = jax.jit(lambda arrays, idx: [a[idx] for a in arrays])  # (jnp's indexing: ~30 us more)


class _Whole(tuple):
    """A batch that every process holds all of (arrays' last batch where it does not split over
    the processes): placed whole on every device, with no gather."""


def _position(iterator):
    """A resumable (grain) iterator's state as JSON (DataLoader's bytes as text), else None."""
    if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
        return None
    state = iterator.get_state()
    return {"bytes": state.decode()} if isinstance(state, bytes) else {"state": _jsonable(state)}


def _kinds(batch):
    """What all batches of a data set share: structure, dtypes, ranks (a key of the step cache)."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((np.dtype(a.dtype), len(a.shape)) for a in leaves)


def _grouped(batches, step, group=None):
    """An iterable's calls `(batch, position, k)` (see `_Data.calls`): a run of k batches is stacked
    if their shapes agree (`_convert` checked their structure and dtypes), else (`group.broken`)
    they run alone."""
    run, k, shapes = [], 1, lambda batch: [a.shape for a in jax.tree.leaves(batch)]
    for batch, position in batches:  # (run: the batches of a group so far, of the k it takes)
        if run and shapes(batch) != shapes(run[0][0]):  # another shape ends the run:
            group.broken(step + len(run))
            yield from ((b, p, 1) for b, p in run)  # its batches run alone
            step, run = step + len(run), []
        if not run:
            k = group.steps_at(step) if group else 1
        if k == 1:
            yield batch, position, 1
            step += 1
            continue
        run.append((batch, position))
        if len(run) == k:
            stack = lambda *a: (jnp.stack if isinstance(a[0], jax.Array) else np.stack)(a)
            yield jax.tree.map(stack, *[b for b, _ in run]), position, k
            step, run = step + k, []
    yield from ((b, p, 1) for b, p in run)


# -- The train step: its math, pure (the function to edit), then fit's bookkeeping around it -------

def _default_train_step(config):
    """fit's own train step: the step's key (each device its own with `axis_name`, where the step
    runs per device under shard_map), `_gradient_step`, and the gradients' norm at log steps.
    With `grad_accum`, the gradients by microbatches (`_accumulate`), or the whole batch's through
    a forward by microbatches (grad_accum_mode="outputs": `_gathered_forward`)."""
    grads_of = _accumulate if config.grad_accum > 1 else _value_and_grad
    if config.grad_accum > 1 and config.grad_accum_mode == "outputs":  # the loss taken once
        grads_of, config = _value_and_grad, dataclasses.replace(config, forward=_gathered_forward(
            config))

    def train_step(state, batch):
        rng = _step_key(state, config.seed)
        if config.axis_name:  # each device draws its own dropout masks
            rng = jax.random.fold_in(rng, jax.lax.axis_index(config.axis_name))
        new_state, metrics, grads = _gradient_step(state, batch, rng, config, grads_of)
        if config.step_metrics:  # (the user's own quantities: what the step has)
            updates = jax.tree.map(jnp.subtract, new_state.params, state.params)
            view = _StepView(grads, updates, _parted(new_state), batch)
            extra = _as_dict(config.step_metrics(view), "step_metrics")
            if config.axis_name:  # (each device sees its rows: a Total's sum, others' mean)
                extra = {k: Total(jax.lax.psum(v.value, config.axis_name)) if isinstance(
                    v, Total) else jax.lax.pmean(v, config.axis_name) for k, v in extra.items()}
            metrics = {**metrics, **extra}
        return new_state, {**metrics, "grad_norm": _log_norm(state, config, grads)}
    return train_step


# What `step_metrics` is given: the update (params after minus before) by XLA's subtraction, which
# it leaves out of the step where `fn` does not read it.
_StepView = collections.namedtuple("_StepView", "grads updates state batch")


def _gradient_step(state, batch, rng, config, grads_of):
    """One gradient step, the math alone, pure (edit it here: bf16 compute, a gradient transform):
    the model's forward and loss (`config.forward`: linen's `apply_fn`, or an nnx model's call),
    their gradients by `grads_of` (`_value_and_grad`, or `_accumulate`'s scan of microbatches),
    the optimizer's update. Returns `(state, metrics, grads)`; fit's bookkeeping (the sums,
    non-finite steps, the lr, the norms) is around it, in `_train_and_accumulate`."""
    has_stats = hasattr(state, "batch_stats")

    def loss_of(params, stats, batch, rng):  # -> (the loss to differentiate, aux)
        here = state.replace(batch_stats=stats) if has_stats else state
        out, stats = config.forward(config.loss_fn, here, params, batch, rng, train=True)
        loss, metrics = _split_loss(out, config.loss_name)
        return loss.total if isinstance(loss, Weighted) else loss, (loss, metrics, stats)

    grads, loss, metrics, stats = grads_of(loss_of, state.params, getattr(
        state, "batch_stats", {}), batch, rng, config=config)
    state = state.apply_gradients(grads=grads, **({"batch_stats": stats} if has_stats else {}))
    return state, {"loss": loss, **metrics}, grads


def _value_and_grad(loss_of, params, stats, batch, rng, *, config):
    """`(grads, loss, metrics, stats)` of a batch in one pass: with `axis_name`, averaged over the
    devices (as pmap); a `Weighted` loss's gradient is its total's over its weight."""
    axis = config.axis_name
    (_, (loss, metrics, stats)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        params, stats, batch, rng)
    if axis:  # (a Weighted's total and weight alike: their ratio stays)
        grads, loss, metrics = jax.lax.pmean((grads, loss, metrics), axis)
    if isinstance(loss, Weighted):
        grads = jax.tree.map(lambda g: g / loss.weight, grads)
        if axis:  # logged as all devices' total and weight (tokens/s), not their mean
            loss = Weighted(*(x * jax.lax.psum(1, axis) for x in loss))
    return grads, loss, metrics, stats


def _accumulate(loss_of, params, stats, batch, rng, *, config):
    """`(grads, loss, metrics, stats)` of a batch as `grad_accum` microbatches in a rolled scan (the
    j-th slice of each device's rows): the gradients of the losses' totals (a mean loss: mean x
    rows) and the weights summed, divided once; the stats carried from one to the next."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    d = config.shards if rows % config.shards == 0 else 1  # (a batch placed whole on each device)
    k = max(j for j in range(1, config.grad_accum + 1) if rows % (d * j) == 0)
    split = lambda a: jnp.swapaxes(a.reshape(d, k, rows // (d * k), *a.shape[1:]), 0, 1)
    is_weighted = lambda m: isinstance(m, Weighted)
    pair = lambda m: (m.total, m.weight) if is_weighted(m) else (m * (rows // k), rows // k)
    zero = lambda x: jnp.zeros(x.shape, x.dtype)
    shapes = jax.eval_shape(loss_of, params, stats, jax.tree.map(lambda a: a[:rows // k], batch),
                            rng)[1][:2]  # (the loss and metrics: which are Weighted)
    scale = 1 if is_weighted(shapes[0]) else rows // k  # (a mean loss's total: mean x rows)

    def micro(carry, xs):
        grads, stats, sums = carry
        part, j = xs
        part = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), part)
        key = rng if k == 1 else jax.random.fold_in(rng, j)

        def total(params):
            value, aux = loss_of(params, stats, part, key)
            return value * scale, aux
        (_, (loss, metrics, stats)), g = jax.value_and_grad(total, has_aux=True)(params)
        now = jax.tree.map(pair, (loss, metrics), is_leaf=is_weighted)
        return (jax.tree.map(jnp.add, grads, g), stats, jax.tree.map(jnp.add, sums, now)), None

    sums0 = jax.tree.map(lambda m: (zero(m.total), zero(m.weight)) if is_weighted(m) else
                         (zero(m), jnp.int32(0)), shapes, is_leaf=is_weighted)
    (grads, stats, (loss, metrics)), _ = jax.lax.scan(
        micro, (jax.tree.map(zero, params), stats, sums0),
        (jax.tree.map(split, batch), jnp.arange(k)))
    if config.axis_name:  # every device's totals and weights, then one division
        grads, loss, metrics = jax.lax.psum((grads, loss, metrics), config.axis_name)
    grads = jax.tree.map(lambda g: g / loss[1], grads)
    back = lambda shape, pair: Weighted(*pair) if is_weighted(shape) else pair[0] / pair[1]
    return grads, back(shapes[0], loss), {n: back(shapes[1][n], metrics[n]) for n in metrics}, \
        stats


def _gathered_forward(config):
    """`config.forward` for grad_accum_mode="outputs" (GradCache; OpenCLIP's --accum-freq):
    `loss_fn` once, on the whole batch's outputs, so that a loss that couples the rows (InfoNCE:
    each row's negatives are the others) is the whole batch's. 1. Each microbatch's forward (the
    j-th slice of each device's rows, key `fold_in(key, j)`, BatchNorm's stats carried, as in
    `_accumulate`), in a rolled scan under `jax.checkpoint`, so that jax.grad keeps only its
    inputs. 2. Their outputs joined in the batch's row order (a leaf without rows, a logit
    scale: their mean, exact for a leaf of the parameters or a mean over rows). 3. `loss_fn`
    on them. jax.grad's backward (`_gradient_step`) then takes the loss's gradient with respect
    to the outputs once and runs each microbatch's forward again, with the same key (dropout
    masks), under jax.vjp with its slice of that gradient, summing the parameters' gradients.
    With `axis_name` each device joins its own rows, as its whole batch's loss sees them there
    (a loss that all_gathers over the axis sees them all). Costs one more forward per
    microbatch, and every microbatch's outputs at once."""
    forward = config.forward

    def gathered(loss_fn, state, params, batch, rng, *, train):
        rows = jax.tree.leaves(batch)[0].shape[0]
        d = config.shards if rows % config.shards == 0 else 1  # (as _accumulate's microbatches)
        k = max(j for j in range(1, config.grad_accum + 1) if rows % (d * j) == 0)
        split = lambda a: jnp.swapaxes(a.reshape(d, k, rows // (d * k), *a.shape[1:]), 0, 1)
        has_stats, stats = hasattr(state, "batch_stats"), getattr(state, "batch_stats", {})
        # A frozen base is closed over, not carried: the backward would keep a copy a microbatch.
        base = stats.base if isinstance(stats, _WithBase) else None
        joined = lambda stats: stats if base is None else _WithBase(stats, base)

        @jax.checkpoint  # (kept for the backward: the inputs; the activations are recomputed)
        def outputs_of(params, stats, part, j):  # -> (outputs, stats) of microbatch j
            part = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), part)
            key = rng if k == 1 else jax.random.fold_in(rng, j)
            here = state.replace(batch_stats=joined(stats)) if has_stats else state
            outputs, stats = forward(_itself, here, params, part, key, train=True)
            return outputs, stats if base is None else stats.rest

        def micro(stats, xs):
            outputs, stats = outputs_of(params, stats, *xs)
            return stats, outputs
        stats, outputs = jax.lax.scan(micro, stats if base is None else stats.rest, (
            jax.tree.map(split, batch), jnp.arange(k)))
        whole = jax.eval_shape(lambda: forward(_itself, state, params, batch, rng, train=True)[0])
        _check_outputs(outputs, whole, rows // k)
        join = lambda a, w: a.mean(0).astype(a.dtype) if a.shape[1:] == w.shape else \
            jnp.swapaxes(a.reshape(k, d, -1, *a.shape[2:]), 0, 1).reshape(w.shape)
        return loss_fn(jax.tree.map(join, outputs, whole), batch[1]), joined(stats)
    return gathered


def _accum_gap(config, replicated, state, batch):
    """grad_accum's default mode, checked (traced; run once, at the first step, apart from the
    train step: `_check_accum`) on a microbatch's worth of `batch`'s rows, so in a microbatch's
    memory: the first and the last half-microbatch of the first device's rows (with `axis_name`,
    each device's own), placed whole on every device (`replicated`), taken together and as two
    microbatches (`_value_and_grad` against `_accumulate`), the model in eval mode (so that
    BatchNorm and Dropout do not count). Returns `(|difference| / |together| of the gradients,
    the loss together, the loss as microbatches)`: rounding for a loss that sums over rows, large
    for one that couples them (a batch's first rows and last differ: a token mean's counts)."""
    def loss_of(params, stats, batch, rng):
        out, _ = config.forward(config.loss_fn, state, params, batch, rng, train=False)
        loss = _split_loss(out, config.loss_name)[0]
        return loss.total if isinstance(loss, Weighted) else loss, (loss, {}, stats)

    rows = jax.tree.leaves(batch)[0].shape[0]
    d = config.shards if rows % config.shards == 0 else 1  # (as _accumulate's microbatches)
    h = max(rows // (d * config.grad_accum) // 2, 1)

    def ends(a):  # (whole on each device: the check splits no rows over them)
        a = jnp.concatenate([a[:h], a[rows // d - h:rows // d]])
        return a if replicated is None else jax.lax.with_sharding_constraint(a, replicated)
    two = dataclasses.replace(config, shards=1, options=tuple(
        (n, 2 if n == "grad_accum" else v) for n, v in config.options))
    args = (state.params, getattr(state, "batch_stats", {}), jax.tree.map(ends, batch),
            _step_key(state, config.seed))
    (whole, loss, *_), (parts, acc, *_) = (f(loss_of, *args, config=c) for f, c in (
        (_value_and_grad, config), (_accumulate, two)))
    mean = lambda loss: loss.total / loss.weight if isinstance(loss, Weighted) else loss
    gap = optax.tree.norm(jax.tree.map(jnp.subtract, whole, parts)) / optax.tree.norm(whole)
    return jnp.stack([gap, mean(loss), mean(acc)]).astype(jnp.float32)


def _step_key(state, seed):
    """This step's key, a pure function of the base key (the state's `rng`, else the seed's) and
    the step, so that a resumed run draws what an uninterrupted one would."""
    rng = getattr(state, "rng", None)
    rng = jax.random.key(seed) if rng is None else rng
    return jax.random.fold_in(rng if _is_key(rng) else jax.random.wrap_key_data(rng), state.step)


def _split_loss(out, who):
    """`(loss, metrics)` of a loss, or of a loss and a dict of metrics; an aux that is an array of
    logits (the NNX tutorial's loss_fn returns them) is left out."""
    loss, metrics = out if isinstance(out, tuple) and not isinstance(out, Weighted) else (out, {})
    if isinstance(loss, Weighted):
        loss = Weighted(jnp.asarray(loss.total), jnp.asarray(loss.weight))
        if loss.total.shape != () or loss.weight.shape != () or not jnp.issubdtype(
                loss.total.dtype, jnp.floating):
            raise TypeError(f"fit: {who} must return Weighted(total, weight) of two scalars, a "
                            f"float total and its weight, e.g. Weighted((losses * weights).sum(), "
                            f"weights.sum()); got shapes {loss.total.shape} and "
                            f"{loss.weight.shape}, dtype {loss.total.dtype} for the total.")
    else:
        if not hasattr(loss, "dtype") and not isinstance(loss, float):  # (a dict, a list, None)
            raise TypeError(f"fit: {who} must return a scalar float loss, or a pair (loss, "
                            f"{{name: metric}}), got {type(loss).__name__}"
                            f"{f' with keys {sorted(loss)}' if isinstance(loss, dict) else ''}; "
                            f"e.g. return loss, {{'loss': loss}}.")
        loss = jnp.asarray(loss)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(f"fit: {who} must return a scalar float loss (or (loss, metrics)), "
                            f"got an array of shape {loss.shape} and dtype {loss.dtype}; reduce "
                            f"it with .mean().")
    if isinstance(metrics, collections.abc.Mapping):
        if totals := [k for k, m in metrics.items() if isinstance(m, Total)]:
            raise TypeError(f"fit: {who}'s metric {totals[0]!r} is a fit.Total; a Total comes "
                            f"from step_metrics=fn(step), which sees the whole step's batch "
                            f"(step.batch) once, not each microbatch's or device's share.")
        return loss, dict(metrics)
    if getattr(metrics, "ndim", 0) < 1:  # (a scalar: a metric that wants a name)
        got = f"a scalar {metrics.dtype}" if hasattr(metrics, "dtype") else type(metrics).__name__
        raise TypeError(f"fit: {who}'s second output must be a dict of scalar metrics, e.g. "
                        f"(loss, {{'accuracy': accuracy}}), or an array of logits, which fit "
                        f"leaves out; got {got}.")
    return loss, {}


def _takes_three(fn):
    try:
        inspect.signature(fn).bind(None, None, None)
        return True
    except (TypeError, ValueError):  # (ValueError: a signature Python cannot read)
        return False


def _as_dict(metrics, default):
    return metrics if isinstance(metrics, dict) else {default: metrics}


_StepParts = collections.namedtuple("_StepParts", "step_fn sums lr_of config")  # (of one step)


def _step_values(step_fn, state, batch):
    """One step, and the values the train sums add up for it, `{name: a mean, Weighted or Total}`,
    each logged as its interval's mean, `train/<name>` (a Total: the run's sum): a quantity added
    here is summed and logged with them (one that needs the gradients: `step_metrics`). One named
    `grad_norm/...` or `param_norm/...` (`_is_norm`) is logged as its log step's value instead."""
    new_state, metrics = step_fn(state, batch)
    return new_state, _as_dict(metrics, "loss")


def _train_and_accumulate(parts, state, acc, batch, frozen=None):
    """One train step plus the on-device bookkeeping: the sums (`_TrainSums`), non-finite steps
    (dropped with `on_nonfinite="skip"`), the lr, a log step's norms. `frozen`: an nnx model's
    frozen base, passed beside the state, neither donated nor returned."""
    config, skip, state = parts.config, parts.config.skip, _joined(state, frozen)
    new_state, metrics = parts.step_fn(state, batch)
    _warn_dtypes(new_state, state)
    # "skip" checks the whole state every step, to drop an update that makes it non-finite.
    norm = _param_norm(new_state) if skip else _log_norm(state, config, new_state.params)
    norms = jnp.array([metrics.get(k, norm if k == "param_norm" else 0.0)
                       for k in parts.sums.norms], jnp.float32)
    values = _totals_and_weights([metrics[k] for k in parts.sums.names], 1)
    finite = jnp.all(jnp.isfinite(values[0])) & (jnp.isfinite(norm) | (not skip))
    if skip:  # keep the old state on device, no host round trip; the step counts on
        new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, state)
        new_state = new_state.replace(step=state.step + 1)
        values = jnp.where(finite, values, 0.0)  # (its weights too)
    # Outputs keep the inputs' dtypes and weak types, so the next call hits the same compilation.
    new_state = jax.tree.map(lambda n, o: jnp.asarray(n, o.dtype), new_state, state)
    lr = None if parts.lr_of is None else parts.lr_of(new_state)
    return _parted(new_state), parts.sums.add(acc, values, norms, lr, finite=finite,
                                              kept=finite | (not skip),
                                              at_log=_at_log(state, config), step=state.step)


_NORMS = ("grad_norm", "param_norm")  # logged as their values at log steps, not as means


def _is_norm(name):
    """Whether a train metric is logged as its log step's value, not a mean: `grad_norm`,
    `param_norm`, and any `grad_norm/...` or `param_norm/...` (a layer's, `_log_norm`'s)."""
    return name.split("/")[0] in _NORMS


class _TrainSums:
    """The train steps' sums, one layout: made from the step's metric names, its log-step values'
    (the norms) and its learning rates' labels, added to in the compiled step (`add`), read on the
    host at log points (`read`). Two arrays, as on XLA's CPU every small op and output costs
    microseconds: `sums` (float32) [each metric's total, each one's weight (a mean: 1 a step), a
    log step's norms and 1 once set, the lrs]; `count` (int32) [steps summed, non-finite steps,
    the first of them]."""

    def __init__(self, names, lrs=(), norms=_NORMS, totals=()):
        # (lrs: "" for one rate, else by label; norms: grad_norm, param_norm, then a layer's;
        # totals: the names of `Total`s, summed over the run on the host)
        self.names, self.lrs, self.norms = tuple(names), tuple(lrs), tuple(norms)
        self.totals = tuple(totals)
        n, m = len(self.names), len(self.norms)
        # The parts of `sums`, where each starts and ends: its one layout.
        self.parts = dict(zip(("totals", "weights", "norms", "lrs"), (
            slice(0, n), slice(n, 2 * n), slice(2 * n, 2 * n + m + 1), slice(2 * n + m + 1, None))))
        self.size = 2 * n + m + 1 + max(len(self.lrs), 1)

    def zeros(self):
        return {"sums": np.zeros(self.size, np.float32), "count": np.zeros(3, np.int32)}

    def add(self, acc, values, norms, lr, *, finite, kept, at_log, step):
        """Traced: a step's [2, n] totals and weights `values`, its norms (kept at a log step),
        its lrs (None: none known), whether it was `finite` and `kept` (summed)."""
        (counted, n_bad, first_bad), sums = acc["count"], acc["sums"]
        totals, weights, old_norms, old_lr = (sums[self.parts[k]] for k in self.parts)
        lr = old_lr if lr is None else jnp.reshape(lr, -1).astype(jnp.float32)
        first_bad = jnp.where((n_bad == 0) & ~finite, step.astype(jnp.int32), first_bad)
        count = jnp.stack([counted + kept, n_bad + ~finite, first_bad])
        # (1: set; not by a dropped step, whose norms are not those of the parameters kept)
        norms = jnp.where(at_log & kept, jnp.append(norms, 1.0), old_norms)
        sums = jnp.concatenate([totals + values[0], weights + values[1], norms, lr])
        return {"sums": sums, "count": count.astype(jnp.int32)}

    def read(self, acc):
        """On the host: `(steps summed, non-finite steps, the first, {name: [total, weight]}, the
        log step's {norm: value} or None, {train/lr tag: value})`."""
        sums = {k: acc["sums"][part].tolist() for k, part in self.parts.items()}
        counted, n_bad, first_bad = (int(v) for v in acc["count"])
        values = {k: [t, w] for k, t, w in zip(self.names, sums["totals"], sums["weights"])}
        lrs = {f"train/lr/{k}".rstrip("/"): v for k, v in zip(self.lrs, sums["lrs"])}
        norms = dict(zip(self.norms, sums["norms"]))  # (its last: 1 once set)
        return counted, n_bad, first_bad, values, sums["norms"][-1] and norms, lrs


def _at_log(state, config):
    """Whether the step that `state` goes into ends at a multiple of `log_every`."""
    return (state.step + 1) % config.log_every == 0


def _param_norm(state):
    """The parameters' norm, or NaN if any floating leaf of the state is NaN (a nested TrainState,
    the optimizer's moments): finite means fit may save the state. (+-inf stays legitimate outside
    the params: optax's reduce_on_plateau starts at inf.)"""
    nan = [jnp.isnan(x).any() for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype,
                                                                               jnp.inexact)]
    return jnp.where(functools.reduce(jnp.logical_or, nan, False), jnp.nan,
                     optax.tree.norm(state.params))


def _log_norm(state, config, tree):
    """The norm of `tree` at log steps, else 0 (or computed anyway): a pass over every parameter
    and gradient each step cost a tiny MLP 3-10% of its speed on a CPU."""
    norm = lambda tree: jnp.asarray(optax.tree.norm(tree), jnp.float32)
    if config.norms_every_step:
        return norm(tree)
    return jax.lax.cond(_at_log(state, config), norm, lambda tree: jnp.float32(0), tree)


def _totals_and_weights(metrics, rows):
    """Metrics as one [2, n] array of totals and weights: a `Weighted` as given (a negative
    weight becomes NaN, which the host reports), a plain mean `m` as `(rows * m, rows)`, a
    `Total` as `(value, 1)` (its sums are run totals: `_Readings`)."""
    pairs = [(m.total, jnp.where(m.weight >= 0, m.weight, jnp.nan)) if isinstance(m, Weighted)
             else (m.value, 1) if isinstance(m, Total) else (rows * m, rows) for m in metrics]
    return jnp.array(pairs, jnp.float32).T.reshape(2, len(pairs))


# -- The compiled steps, built from _StepConfig and cached -----------------------------------------

@dataclasses.dataclass(frozen=True)
class _StepConfig:
    """Exactly what traced code reads, and the compile cache's key: steps are built from it and your
    functions, never from `Options`. An option marked `_TRACED` comes in `options`, read as an
    attribute (`config.seed`): an option that traced code comes to read needs its mark alone."""
    forward: Any          # how fit calls the model: _linen_forward (edit it here), nnx's own
    linen: bool           # a linen model (else nnx): its advice, and whether steps are kept
    loss_name: str        # "loss_fn" or "nnx_loss_fn", for messages
    eval_step: Any        # (an nnx model's, adapted)
    skip: bool            # on_nonfinite="skip"
    norms_every_step: bool  # the log steps' norms computed at every step, without a lax.cond
    shards: int           # over how many devices the step's batch rows are split (shard_map: 1)
    batch_axes: tuple     # the mesh axes they are split over
    options: tuple        # ((name, value), ...) of the options marked _TRACED

    def __getattr__(self, name):  # (called only for a name that is not a field)
        for key, value in self.__dict__.get("options", ()):
            if key == name:
                return value
        raise AttributeError(f"_StepConfig has no {name!r}: mark the option _TRACED")

    @classmethod
    def of(cls, opts, forward, eval_step, mesh, *, linen):
        shards = 1 if opts.axis_name else math.prod(mesh.shape[a] for a in opts.batch_axes)
        traced = tuple((f.name, getattr(opts, f.name)) for f in dataclasses.fields(opts)
                       if f.metadata.get("traced"))
        loss_name = "nnx_loss_fn" if opts.nnx_loss_fn else "loss_fn"
        return cls(forward, linen, loss_name, eval_step, opts.on_nonfinite == "skip",
                   _platform(mesh) in _NO_COND, shards, _batch_axes(opts), traced)


# Where the norms are computed at every step, not under a lax.cond (#28): a GPU runtime may block
# the host on a conditional's predicate. On an H100 (jax 0.11.2) it did not, and the norms at
# every step cost 2-10% (benchmarks/README.md): kept as the safe side, pending a decision.
_NO_COND = ("gpu",)


def _platform(mesh):
    return mesh.devices.flat[0].platform  # "cpu", "gpu" or "tpu"


_Steps = collections.namedtuple("_Steps", "train train_k evals param_norm acc0 eval0 put frozen "
                                          "train_sums train_names eval_sums weighted_loss "
                                          "accum_check")
_Steps.__new__.__defaults__ = (None,) * len(_Steps._fields)  # (built by name, each None at first)


def _build_steps(state, train_data, eval_data, config, mesh, *, frozen=None):
    """The steps of an earlier call with the same `_StepConfig`, optimizer (in the state's treedef),
    placement and kinds of batches (a notebook cell run again compiles nothing), else new ones;
    `train=None`: the eval steps alone (`evaluate`). Each step takes the `frozen` base last."""
    eval_data = eval_data or {}
    key = (config, mesh, train_data and _kinds(train_data.spec),
           tuple((n, _kinds(t.spec)) for n, t in eval_data.items()), jax.tree.structure(state),
           tuple(x.sharding for x in jax.tree.leaves(state)), jax.tree.structure(frozen),
           _own_code())
    reuse = config.linen  # (nnx closures hold the model: never kept)
    steps = _cached(key, reuse, lambda: _new_steps(state, train_data, eval_data, config, mesh,
                                                   frozen=frozen))
    # Made at each call, not kept with the steps: the sums' zeros (a finished run leaves no
    # array) and the batches' placement.
    acc0 = train_data and jax.device_put(steps.train_sums.zeros(), _replicated(mesh))
    eval0 = {name: sums.zeros() for name, sums in steps.eval_sums.items()}
    return steps._replace(acc0=acc0, eval0=jax.device_put(eval0, _replicated(mesh)),
                          put=_putter(mesh, config.batch_axes), frozen=frozen)


_STEPS = collections.OrderedDict()  # the compiled steps of the last few calls (_cached)


def _own_code():
    """fit's own functions and classes' methods as they are now (~0.1 ms): part of the steps' key,
    so that one replaced after a first call (`fit._gradient_step = patched`) is traced anew."""
    mine = [v for v in globals().values() if getattr(v, "__module__", None) == __name__]
    return tuple(f for v in mine for f in [v, *(vars(v).values() if isinstance(v, type) else ())]
                 if callable(f))


def _cached(key, reuse, build):
    """`build()`, or what it made for an equal `key`, kept among the 8 last used if `reuse`. The key
    holds your functions and fit's own (`_own_code`), not what they read: a global a loss reads
    stays as it was at the trace, as in any jax.jit; pass such a value in the state or the batch,
    or call `_STEPS.clear()`."""
    try:
        hash(key)
    except TypeError:  # (a function or an optimizer that cannot be a key)
        reuse = False
    if reuse and key in _STEPS:
        _STEPS.move_to_end(key)
        return _STEPS[key]
    value = build()
    if reuse:
        _STEPS[key] = value
        if len(_STEPS) > 8:  # the least recently used goes
            _STEPS.popitem(last=False)
    return value


def _new_steps(state, train_data, eval_data, config, mesh, *, frozen=None):
    """Every compiled step of the run: the train step (alone, and scanned over `steps_per_jit`
    stacked batches) and the eval steps (`_jit_eval`), each summing metrics on device. (Three small
    jits live elsewhere: `_take`'s rows of device arrays, `_fingerprint`, `_check_schedule`'s.)
    Your step is traced for its metric names before any compile, jitted alone, so the real call
    reuses that trace (0.1-0.2 s)."""
    if train_data is None:  # (evaluate)
        fns, sums = _jit_evals(_joined(state, frozen), eval_data, config, mesh)
        return _Steps(evals=fns, eval_sums=sums)
    replicated, user_step, seed = _replicated(mesh), config.train_step, config.seed
    who = "train_step" if user_step else config.loss_name
    step_fn = user_step or _default_train_step(config)
    if user_step and _takes_three(user_step):  # train_step(state, batch, rng)
        step_fn = lambda state, batch: user_step(state, batch, _step_key(state, seed))
    step_fn = jax.jit(_under(mesh, _per_device(step_fn, config, mesh, (P(), P()))))
    own = user_step or config.loss_name == "nnx_loss_fn"  # (else fit calls the model)
    step_fn = functools.partial(_step_values, step_fn)
    metrics = _trace(step_fn, _joined(state, frozen), train_data.spec, config,
                     not own and "train")[1]
    traced = _metric_names(metrics, who, "loss")
    names = [k for k in traced if not _is_norm(k)]  # (the norms are not summed: _log_norm)
    norms = [k for k in (*_NORMS, *traced) if (k in traced or k == "param_norm") and _is_norm(k)]
    # The lrs a step used, from the state after it: lr_fn(step), or inject_hyperparams' values.
    lrs = [""] if config.lr_fn is not None else list(_lr_in(state.opt_state))
    lr_of = (lambda s: config.lr_fn(s.step - 1)) if config.lr_fn is not None else (
        lambda s: jnp.stack(list(_lr_in(s.opt_state).values()))) if lrs else None
    sums = _TrainSums(names, lrs, norms=_NORMS + tuple(k for k in norms if k not in _NORMS),
                      totals=[k for k in names if isinstance(metrics[k], Total)])
    one = functools.partial(_train_and_accumulate, _StepParts(step_fn, sums, lr_of, config))
    placement = (jax.tree.map(lambda x: x.sharding, state), replicated)
    train_1 = jax.jit(one, donate_argnums=0, out_shardings=placement)
    # k steps per call: a scan over a stacked group of k batches (the frozen base outside it),
    # unrolled or not (`_unrolled`, asked once a run: built once for each answer).
    train_k = functools.cache(lambda unroll: jax.jit(
        lambda state, acc, batches, frozen=None: jax.lax.scan(
            lambda carry, b: (one(*carry, b, frozen), None), (state, acc), batches,
            unroll=unroll)[0], donate_argnums=0, out_shardings=placement))
    # (after the train step: its advice comes first)
    eval_fns, eval_sums = _jit_evals(_joined(state, frozen), eval_data, config, mesh)
    param_norm = jax.jit(_param_norm, out_shardings=replicated)  # (checked before every save)
    # grad_accum's default mode: whether the loss sums over rows, checked once at the first step.
    gap = config.grad_accum > 1 and config.grad_accum_mode == "losses" and not user_step and \
        jax.jit(_under(mesh, _per_device(functools.partial(_accum_gap, config, None if
                config.axis_name else replicated), config, mesh, P())), out_shardings=replicated)
    return _Steps(train_1, train_k, eval_fns, param_norm, train_sums=sums,
                  train_names=names + list(dict.fromkeys(norms)), eval_sums=eval_sums,
                  weighted_loss=isinstance(metrics.get("loss"), Weighted),
                  accum_check=functools.partial(_check_accum, gap, config) if gap else None)


def _per_device(fn, config, mesh, out_specs):
    """`fn(state, batch)` run per device under shard_map with `axis_name` (the batch split over
    the axis, as pmap-era code expects: the default step averages over the devices), else `fn`."""
    if not config.axis_name:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(config.axis_name)), out_specs=out_specs,
                         check_vma=False)


def _unrolled(lowered):
    """Whether k-step calls unroll their scan, from the single step's `lowered` program: on a CPU
    where it has convolutions. XLA's CPU backend ran a rolled scan of convolution steps ~10x
    slower than single steps and an unrolled one ~1.2x faster; without them a rolled scan of 10
    ran 3x faster than an unrolled one (benchmarks/README.md, #49) and compiles as one step."""
    return jax.default_backend() == "cpu" and "stablehlo.convolution" in lowered.as_text()


def _under(mesh, fn):
    """`fn` traced under a mesh of Explicit axes, as your own step under `jax.set_mesh(mesh)`, for a
    model that names its axes: at trace time, not each call (~30 us). Not for Auto axes, where
    Flax's partitioning annotations stay no-ops."""
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return fn

    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)
    return traced


# -- The eval steps: each set's metrics summed on device, in one layout (_EvalSums) ----------------

def _jit_evals(state, eval_data, config, mesh):
    """Each eval set's jitted step and sums' layout, `{set: step}, {set: _EvalSums}`: sets with the
    same kinds of batches share one step (a batch shape compiles once, whichever set feeds it)."""
    built = {}
    for test in eval_data.values():
        if _kinds(test.spec) not in built:
            built[_kinds(test.spec)] = _jit_eval(state, test, config, mesh)
    each = {name: built[_kinds(test.spec)] for name, test in eval_data.items()}
    return {n: fn for n, (fn, _) in each.items()}, {n: sums for n, (_, sums) in each.items()}


def _jit_eval(state, test, config, mesh):
    """The jitted eval step, `(state, sums, batch) -> (sums, host)` (`_EvalSums.add`), and the
    layout of its sums."""
    eval_step, forward, own = config.eval_step, config.forward, config.loss_name == "nnx_loss_fn"
    if eval_step is None and config.loss_fn is None and not own:
        raise ValueError("fit: pass eval_step=, or loss_fn= for an eval of the loss, to "
                         "evaluate on test_ds.")

    def loss_eval(state, batch):  # without an eval_step: loss_fn's, in inference mode
        key = _step_key(state, config.seed)
        out, _ = forward(config.loss_fn, state, state.params, batch, key, train=False)
        loss, metrics = _split_loss(out, config.loss_name)
        return {"loss": loss, **metrics}

    inner = jax.jit(_under(mesh, eval_step or loss_eval))
    who = "eval_step" if eval_step else config.loss_name
    shapes = _trace(inner, state, test.spec, config, not (eval_step or own) and "eval")
    sums = _EvalSums(_as_dict(shapes, "accuracy"), who, bare=not isinstance(shapes, dict))
    _per_example(inner, state, test.spec, sums.arrays, who)

    def _eval_and_accumulate(state, acc, batch, frozen=None):
        rows = jax.tree.leaves(batch)[0].shape[0]
        return sums.add(acc, _as_dict(inner(_joined(state, frozen), batch), "accuracy"), rows)

    return jax.jit(_eval_and_accumulate, out_shardings=_replicated(mesh)), sums


class _EvalSums:
    """An eval step's sums, one layout, made from its outputs' shapes: what the compiled step adds
    for a batch (`add`) and what the host reads once per eval (`read`). By what `eval_step` returns
    for a name: a scalar (a per-batch mean, weighted by rows) or a `Weighted` of scalars goes into
    `sums`, [totals, weights, batches]; an array (counts: a confusion matrix) or a `Weighted` of
    arrays (divided elementwise) is summed, integers exactly, floats in float32; a metric state
    (`merge` and `compute`, e.g. `clu.metrics`) is merged in the step if its `merge` traces to its
    own structure (sums, counts), else on the host (clu's `CollectingMetric`), each batch's copied
    there one batch late. A state's `compute()` runs once per eval; a dict gives a metric a key.
    Every batch is counted once: one that does not split over the devices runs whole on each."""

    def __init__(self, shapes, who, bare=False):
        kinds = {name: _eval_kind(name, value, who) for name, value in shapes.items()}
        self.bare = bare  # (a bare number, named "accuracy": said at the first eval)
        of = lambda kind: {k: shapes[k] for k in shapes if kinds[k] == kind}
        self.scalars, self.arrays, self.states = list(of("scalar")), of("array"), of("state")
        self.host = list(of("host"))
        # The scalars an eval will give (a state's: its compute()'s keys, where they can be known).
        self.names = [n for k, v in shapes.items() if kinds[k] != "array" for n in (
            _computed_names(k, v) if kinds[k] in ("state", "host") else [k])]
        given = self.names + list(self.arrays)
        if len(set(given)) < len(given):
            twice = sorted({n for n in given if given.count(n) > 1})
            raise ValueError(f"fit: {who} gives the metric names {twice} twice (a metric state's "
                             f"compute() keys among them); rename one.")

    def zeros(self):
        # (arrays summed in int32 if integers, exactly, else float32)
        zero = lambda s, like=None: np.zeros((like or s).shape, np.int32 if jnp.issubdtype(
            s.dtype, jnp.integer) else np.float32)
        arrays = {k: (zero(v.total), zero(v.weight, v.total)) if isinstance(v, Weighted) else
                  zero(v) for k, v in self.arrays.items()}  # (a Weighted: total, weight)
        return {"sums": np.zeros(2 * len(self.scalars) + 1, np.float32),  # (+1: the batches)
                "arrays": arrays, "states": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                                         self.states)}

    def add(self, acc, metrics, rows):
        """Traced: `acc` with one batch's `metrics` added, and the states merged on the host."""
        pairs = _totals_and_weights([metrics[k] for k in self.scalars], rows)
        first = acc["sums"][-1] == 0  # (a state's first batch is taken as it is: no empty())
        as_sum = lambda a, m: a + jnp.broadcast_to(m, a.shape).astype(a.dtype)
        arrays = {k: jax.tree.map(as_sum, a, tuple(metrics[k]) if isinstance(
            metrics[k], Weighted) else metrics[k]) for k, a in acc["arrays"].items()}
        states = {k: jax.tree.map(lambda a, new, merged: jnp.where(first, new, merged).astype(
            a.dtype), a, metrics[k], a.merge(metrics[k])) for k, a in acc["states"].items()}
        return {"sums": acc["sums"] + jnp.append(pairs.ravel(), 1.0), "arrays": arrays,
                "states": states}, {k: metrics[k] for k in self.host}

    def read(self, acc, host, where):
        """`{name: value}` of summed `acc` and merged `host` states (numpy, on the host): floats,
        and numpy arrays; None if no batch was added."""
        *sums, batches = acc["sums"].tolist()
        if not batches:
            return None
        n = len(self.scalars)
        values = {k: _mean(k, total, weight, "eval_step", where)
                  for k, total, weight in zip(self.scalars, sums[:n], sums[n:])}
        for k, a in acc["arrays"].items():
            with np.errstate(invalid="ignore", divide="ignore"):  # (0 / 0: NaN, no weight)
                values[k] = a[0] / a[1] if isinstance(a, tuple) else a
        for k, state in {**acc["states"], **host}.items():
            out = state.compute()
            for name, value in (out.items() if isinstance(out, dict) else [(k, out)]):
                if name in values:
                    raise ValueError(f"fit: the metric {name!r} of eval_step is given twice (by "
                                     f"{k!r}'s compute() and another); rename one.")
                value = np.asarray(value)
                values[name] = float(value) if value.ndim == 0 else value
        return values


def _eval_kind(name, value, who):
    """What an eval step's output `value` (shapes) is: "scalar", "array", "state" or "host"."""
    if hasattr(value, "merge") and hasattr(value, "compute"):  # (a metric state)
        try:
            merged = jax.eval_shape(lambda a: a.merge(a), value)
            same = jax.tree.structure(merged) == jax.tree.structure(value) and all(
                a.shape == b.shape for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(value)))
        except Exception:  # (clu's CollectingMetric refuses tracers)
            same = False
        return "state" if same else "host"
    parts = list(value) if isinstance(value, Weighted) else [value]
    for part in parts:
        if not jnp.issubdtype(getattr(part, "dtype", np.dtype(object)), jnp.number):
            raise TypeError(f"fit: {who} must return numbers (a per-batch mean, Weighted(total, "
                            f"weight), an array of counts) or metric states, but {name!r} is "
                            f"{getattr(part, 'dtype', type(part).__name__)}.")
    w, t = (value.weight.shape, value.total.shape) if isinstance(value, Weighted) else ((), ())
    if len(w) > len(t) or any(a not in (1, b) for a, b in zip(w[::-1], t[::-1])):  # (broadcasts?)
        raise TypeError(f"fit: {who}'s Weighted {name!r} has a total of shape "
                        f"{value.total.shape} and a weight of shape {value.weight.shape}; the "
                        f"weight must be a scalar or broadcast to the total's shape.")
    return "scalar" if parts[0].shape == () else "array"


def _computed_names(name, state):
    """The names a metric state's `compute()` gives: its dict's keys (a clu `Collection`: its
    fields, where compute cannot be traced), else `name`."""
    try:
        out = jax.eval_shape(lambda s: s.compute(), state)
    except Exception:  # (it computes with numpy, e.g. an AUC over collected scores)
        fields = dataclasses.fields(state) if dataclasses.is_dataclass(state) else ()
        parts = [f.name for f in fields if hasattr(getattr(state, f.name), "compute")]
        return parts if parts and len(parts) == len(fields) else [name]
    return list(out) if isinstance(out, dict) else [name]


# -- The plan: every period converted to steps once; the monitor and its mode ----------------------

class _Plan:
    """Every period converted to steps once, and what is due when; the monitor and its mode."""

    def __init__(self, opts, train_data, eval_data, steps, state):
        self.num_epochs, self.max_steps = opts.num_epochs, opts.max_steps
        self.steps_per_epoch = opts.steps_per_epoch or train_data.length
        planned = self.steps_per_epoch and self.steps_per_epoch * opts.num_epochs
        self.total = min([n for n in (planned, opts.max_steps) if n], default=None)
        self.every = {"log": opts.log_every, "ckpt": opts.ckpt_every,
                      "eval": opts.eval_every if eval_data else None}
        self.eval_freq, self.has_test = opts.eval_freq, bool(eval_data)
        averaged = _ema_params(getattr(state, "opt_state", None)) is not None  # (fit.ema's)
        self.ema = averaged and opts.ema_eval and bool(eval_data)  # evals of the average too
        python = list(opts.eval_metrics or {})  # (computed in Python: _python_metrics)
        # Each eval set's scalar metrics, all that an eval gives (`_Loop.evals` holds it to them).
        self.eval_names = {name: sums.names + python for name, sums in steps.eval_sums.items()}
        self.monitor, self.mode = _pick_monitor(opts.monitor, opts.mode, steps.train_names,
                                                self.eval_names, self.ema)
        self.best = f"best by {self.monitor} ({self.mode})" if self.monitor else \
            "no best (no eval set or monitor=), the latest kept"  # (said at the start)

    def end(self, start):
        """The run's last step, from `start`, the state's step when it began (None: unknown)."""
        planned = self.steps_per_epoch and start + self.steps_per_epoch * self.num_epochs
        return min([n for n in (planned, self.max_steps) if n], default=None)

    def due(self, name, step, k=1):
        """Whether the steps (step - k, step] include a multiple of that period."""
        every = self.every[name]
        return bool(every) and step // every > (step - k) // every

    def next_due(self, step, now=False):
        """The first step after `step` at which a log, an eval or a save falls due, or max_steps
        ends the run: no step before it needs more than its call. `now`: the next one."""
        return step + 1 if now else min(
            [(step // every + 1) * every for every in self.every.values() if every]
            + [self.max_steps or math.inf])

    def eval_at_epoch_end(self, epochs_done, last):
        epoch_due = not self.every["eval"] and epochs_done % self.eval_freq == 0
        return self.has_test and (epoch_due or last)

    def done(self, epoch, step):
        return epoch >= self.num_epochs or bool(self.max_steps and step >= self.max_steps)


def _pick_monitor(monitor, mode, train_names, eval_names, averaged=False):
    """`monitor` checked, or the default: the (first) eval set's accuracy, else its loss, else its
    first metric; a run without an eval set keeps no best unless `monitor` names one (its best
    train epoch is rarely what it wants; Keras keeps none either): `(None, None)`. `mode` from
    the metric's own name (`eval/val/loss`: loss)."""
    names = [f"train/{n}" for n in train_names] + [
        _metric_tag(part, eval_set, n) for part in ("eval", "eval_ema")[:1 + averaged]
        for eval_set, metrics in eval_names.items() for n in metrics]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"fit: the metric names {twice} are given twice (eval_step's and "
                         f"eval_metrics' names must differ).")
    if monitor is None:
        first, metrics = next(iter(eval_names.items()), (None, []))
        preferred = [n for n in ("accuracy", "loss") if n in metrics] + metrics
        if not preferred:
            return None, None
        monitor = _metric_tag("eval", first, preferred[0])
    if monitor not in names:
        near = difflib.get_close_matches(monitor, names, n=1)
        raise ValueError(f"fit: monitor={monitor!r} is not a metric of this run; it has {names}"
                         f"{f'. Did you mean {near[0]!r}?' if near else ''} (Arrays, such as a "
                         f"confusion matrix, cannot be the monitor; a metric added in fit's eval "
                         f"code is named in _EvalSums.names too.)")
    if mode == "auto" and not _mode_of(monitor):
        raise ValueError(f"fit: cannot tell from its name whether monitor={monitor!r} is "
                         f"better higher or lower; pass mode='min' or mode='max'.")
    return monitor, mode if mode != "auto" else _mode_of(monitor)


def _mode_of(monitor):
    """"min" or "max" as a metric's name says (loss, accuracy, ...), else None."""
    words = set(re.split(r"[^a-z0-9]+", monitor.split("/")[-1].lower()))
    lower = {"loss", "err", "error", "perplexity", "ppl", "mse", "mae", "rmse", "nll", "bce",
             "ce", "kld", "kl", "wer", "cer", "fid"}
    higher = {"accuracy", "acc", "top1", "top5", "f1", "auc", "precision", "recall", "iou",
              "dice", "bleu", "rouge", "psnr", "ssim", "r2", "map", "score", "reward"}
    if bool(words & lower) != bool(words & higher):
        return "min" if words & lower else "max"
    return None


def _is_eval(monitor):
    """Whether a metric is an eval's (judged at evals, of one state): `eval/...`, `eval_ema/...`."""
    return bool(monitor) and monitor.split("/")[0] in ("eval", "eval_ema")


# -- The run: what a checkpoint holds, the best, the checkpoints, what hooks see -------------------

@dataclasses.dataclass
class _Progress:
    """What a checkpoint holds besides the state, all a resume needs to go on exactly (the JSON
    item `meta`): fields, defaults, reader (a missing field: its default), writer, resume checks."""
    epoch: int = 0
    position: Any = (0, None)  # batches done in the epoch, the data iterator's state after them
    positions: Any = None      # each process's position (several processes), by process index
    meter: Any = None          # the train metrics' sums on the host (_Readings.meter)
    history: Any = dataclasses.field(default_factory=lambda: {"epoch": [], "step": []})
    best: Any = None           # the best monitored value, its step, the kept best values
    best_step: Any = None
    top: Any = dataclasses.field(default_factory=list)
    hooks: Any = dataclasses.field(default_factory=dict)  # get_state() of hooks, by _hook_names
    stop: Any = None           # a hook's stop, which is final (a signal's stop is resumable)
    target: Any = (None, None)  # num_epochs and max_steps of the call that wrote it
    seed: Any = None
    batching: Any = (None, None)  # the global batch size and the batches per epoch
    start: int = 0             # the state's step when the run began (a loaded state's)
    base: Any = None           # an nnx frozen base's fingerprint, if not saved (save_frozen)
    options: Any = None        # the HParams of the call that wrote it (a resume says changes)
    changed = {}  # (not saved: {option: (before, now)} of a resumed call)
    # Fields a call sets (a resume keeps them, the checkpoint's checked), and a run's first call;
    # every other field moves during a run: each save writes them all (`saving`).
    CALL, RUN = ("target", "seed", "batching", "options", "base"), ("start",)

    @classmethod
    def read(cls, meta):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in names})

    def write(self):
        return _jsonable({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def check(self, run, seed, batching, shuffle=True):
        """Checks the seed (shuffles, keys), shuffle and batching against the run's (None: not
        known), and the process count where each process's data loader has a position of its own."""
        processes, positions = jax.process_count(), self.positions or [self.position]
        if len(positions) != processes and any(p and p[1] is not None for p in positions):
            raise ValueError(f"fit: run {run} was saved by {len(positions)} process(es), each at "
                             f"its own place in its data loader (get_state); resume it on "
                             f"{len(positions)} process(es), this call has {processes}, or start "
                             f"a fresh run. (Arrays (x, y) resume on any process count.)")
        if self.seed is not None and self.seed != seed:
            raise ValueError(f"fit: run {run} was trained with seed={self.seed}; resume it with "
                             f"that seed, or start a fresh run.")
        if (self.options or {}).get("shuffle", True) != shuffle:  # (the batches' order)
            raise ValueError(f"fit: run {run} was trained with shuffle={not shuffle}; resume it "
                             f"with that, or start a fresh run.")
        if any(a is not None and b is not None and a != b for a, b in zip(self.batching, batching)):
            n = self.batching[0]
            option = "" if n is None else f" (arrays (x, y): batch_size={n})"
            raise ValueError(f"fit: run {run} was trained with a global batch size of {n} and "
                             f"{self.batching[1]} batches per epoch, this call feeds {batching[0]}"
                             f" and {batching[1]}: resume it with its own batch size{option} and "
                             f"data, or start a fresh run (resume=False).")

    def go_on(self, prior):
        """This call's progress from a checkpoint's (`prior`), keeping this call's
        target, seed, batching and options; a hook's stop holds only if the run goes no further
        than that one did. Options that differ from the saved call's are recorded."""
        for name in {f.name for f in dataclasses.fields(self)} - set(self.CALL):
            setattr(self, name, getattr(prior, name))
        self.stop = prior.stop if prior.final(*self.target) else None
        before, now = prior.options or {}, self.options or {}
        self.changed = {k: (before.get(k), now.get(k)) for k in sorted({*before, *now})
                        if before and before.get(k) != now.get(k)}

    def here(self):
        """Where this process's data goes on: its own position, where each process saved one."""
        position, positions = self.position, self.positions  # (both read: check_read)
        if positions and len(positions) == jax.process_count():
            return positions[jax.process_index()]
        return position

    def saving(self, **moving):
        """At a save: every field that moves during a run, each one given (one left out would be
        saved stale, with the value of the first call)."""
        fields = {f.name for f in dataclasses.fields(self)} - {*self.CALL, *self.RUN}
        if moving.keys() != fields:
            raise TypeError(f"_Progress.saving: got {sorted(moving)}, not {sorted(fields)}: a "
                            f"field that moves is given at each save, in _Loop.checkpoint.")
        vars(self).update(moving)

    def __getattribute__(self, name):  # (each field read is recorded: `check_read`)
        if not name.startswith("_"):
            object.__getattribute__(self, "__dict__").setdefault("_read", set()).add(name)
        return object.__getattribute__(self, name)

    def check_read(self):
        """Where a run starts (`_Loop`), after any restore: every field that moves has been read
        back (a field added and given to `saving` but not read would resume silently from 0)."""
        fields = {f.name for f in dataclasses.fields(self)} - {*self.CALL, *self.RUN}
        unread = sorted(fields - vars(self).get("_read", set()))
        if unread:
            raise TypeError(f"_Progress: the fields {unread} are saved at each checkpoint but not "
                            f"read where the run starts, so a resume would not go on from them; "
                            f"read them (e.g. in _Loop.__init__: ckpts.progress.<field>).")

    def final(self, num_epochs, max_steps):
        """Whether a hook ended the run for good: it goes on only if asked to go further."""
        epochs, steps = self.target
        return bool(self.stop) and num_epochs <= epochs and (
            (max_steps or math.inf) <= (steps or math.inf))


class _Best:
    """The one owner of the best checkpoint: the monitor and its mode, the best value so far and
    its step, the values of the `max_to_keep` best (`top`), a save's rank, what orbax keeps. An
    eval monitor is judged at evals, a train one on epochs' means; a value that enters the kept
    best asks for a checkpoint of its step, so `load_ckpt(..., "best")` finds it. Ties: of equal
    values the later is the best (orbax keeps the later of equal ones)."""

    def __init__(self, plan, max_to_keep):
        self.monitor, self.mode, self.max_to_keep = plan.monitor, plan.mode, max_to_keep
        self.value = self.step = None
        self.top, self.seen = [], (None, None)  # (seen: the latest monitored value, its step)
        self.better = lambda a, b: a >= b if self.mode == "max" else a <= b

    def go_on(self, progress):
        """Where a resumed run left its best."""
        self.value, self.step, self.top = progress.best, progress.best_step, list(progress.top)

    def track(self, metrics, step):
        """Follows the best monitored value (an eval's, or an epoch's means); True: the value
        enters the kept best, so its step is saved."""
        value = metrics.get(self.monitor)
        if value is None:
            return False
        self.seen = (value, step)
        if self.value is None or self.better(value, self.value):  # (a tie: the later step)
            self.value, self.step = value, step
        return len(self.top) < self.max_to_keep or self.better(value, self.top[-1])

    def rank(self, step):
        """The monitored value to rank a checkpoint of `step` by (only one that judged this very
        state), recorded among the kept best; None: it is kept as the last, not a best."""
        value, at = self.seen
        if value is None or at != step:
            return None
        self.top = sorted(self.top + [value], reverse=self.mode == "max")[:self.max_to_keep]
        return value

    def manager_options(self):
        """What orbax keeps: the latest checkpoint and the `max_to_keep` best. (`best_fn` with
        `max_to_keep` alone would delete the latest, and keep saves without metrics forever.)"""
        policies, metric = ocp.checkpoint_managers, lambda m: m[self.monitor]
        if self.monitor is None:  # (a run without metrics: the latest alone)
            return dict(preservation_policy=policies.LatestN(1))
        policy = policies.AnyPreservationPolicy([policies.LatestN(1), policies.BestN(
            get_metric_fn=metric, reverse=self.mode == "min", n=self.max_to_keep,
            keep_checkpoints_without_metrics=False)])
        # best_fn too: orbax 0.12 keeps a step's metrics on disk (for a resume) only with it.
        return dict(preservation_policy=policy, best_fn=metric, best_mode=self.mode)


class _Checkpoints:
    """The run's claim and directories, its orbax manager, restore, and saves: at the first log
    point `ckpt_interval` s after the last, every `ckpt_every` steps, after an eval that enters the
    kept best, when a hook asks, on every stop and at the end. A failed save raises one `OSError`
    naming the step, the cause and the last good checkpoint, which stays intact."""

    def __init__(self, opts, best, progress, claim=True, frozen=None):
        self.store = None  # (a bucket's client, `_Bucket`; None: a local disk)
        if _is_url(opts.workdir or ""):  # (its client and the bucket checked, then used as is)
            workdir = opts.workdir.rstrip("/")
            self.store = _Bucket(workdir, "fit", logs=opts.tensorboard and jax.process_index() == 0)
        else:
            workdir = probe = os.path.abspath(os.path.expanduser(opts.workdir or os.getcwd()))
            while not os.path.exists(probe):  # fail before any directory is made
                probe = os.path.dirname(probe)
            if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
                why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
                raise PermissionError(f"fit: workdir {workdir!r} cannot be used: {probe!r} {why}; "
                                      f"pass workdir= a directory you can write to.")
        self.run, self.resumed, self.lock = _claim_run(workdir, opts.log_name, opts.resume, claim,
                                                       store=self.store)
        self.logs = os.path.join(workdir, "logs")  # (tensorboard --logdir)
        self.log_dir = os.path.join(self.logs, self.run)
        self.ckpt_dir = os.path.join(workdir, "checkpoints", self.run)
        self.monitor, self.best, self.progress = best.monitor, best, progress
        self.interval, self.last_time = opts.ckpt_interval, time.monotonic()
        self.mgr, self.latest, self.good, self.calls = None, None, None, 0  # (latest: its step)
        self.processes, self.writing = jax.process_count(), False  # (writing: a save in flight)
        self.quiet = _quiet()  # (orbax's logged reports of failures, while the run is open)
        # An nnx model's frozen base: saved with the state, or (save_frozen=False) its
        # fingerprint instead, computed once.
        self.frozen, self.save_frozen = frozen, opts.save_frozen or frozen is None
        progress.base = None if self.save_frozen else _fingerprint(frozen)

    def restore(self, state):
        """The latest checkpoint's state, its progress taken into the run's (checked against
        this call); else `state`. A frozen base saved with it replaces the caller's only where
        they differ (else the caller's stays the one held)."""
        if not self.resumed:
            return state
        self.open()
        self.latest = self.good = self.mgr.latest_step()
        try:
            state, meta, self.frozen = _restore_all(self.mgr, self.latest, state, "fit",
                                                    frozen=self.frozen)
            prior = _Progress.read(meta)
            prior.check(self.run, self.progress.seed, self.progress.batching,
                        (self.progress.options or {}).get("shuffle", True))
            self.progress.go_on(prior)
        except BaseException:
            self.close()  # (the manager's threads and fit's log filter end with it)
            raise
        return state

    def open(self):
        """The orbax manager, keeping what the run's `_Best` says."""
        if self.mgr is None:
            logging.getLogger("absl").addFilter(self.quiet)
            self.mgr = _open(self.ckpt_dir, ocp.CheckpointManagerOptions(
                cleanup_tmp_directories=True, **self.best.manager_options()))

    def raise_failed(self):
        """A failed asynchronous save's error, once it has ended (asked only while one is in
        flight: ~50 us). One process alone: orbax's wait may be a collective; with several,
        errors come at the next save."""
        if self.writing and self.processes == 1 and not self.mgr.is_saving_in_progress():
            self.wait()  # returns at once; raises a finished save's error

    def count_call(self):
        """A loop call counted for JAX's preemption notifier, which expects every call (calls, not
        steps): "preemption" when it picked this one for all processes to stop at."""
        if self.processes == 1:
            return None
        self.calls += 1
        if self.mgr.reached_preemption(self.calls):
            return "preemption"

    def write(self, step, state, value):
        self.wait()  # the previous save commits first (orbax would wait here too)
        if getattr(self.lock, "lost", None):  # (a bucket's lease that another writer took over)
            raise RuntimeError(self.lock.lost)
        with self._failure(step):
            whole = _with_base(state, self.frozen) if self.save_frozen else state
            saved = self.mgr.save(step, metrics=None if value is None else {self.monitor: value},
                                  args=ocp.args.Composite(
                                      state=ocp.args.StandardSave(_key_data(whole)),
                                      meta=ocp.args.JsonSave(self.progress.write())))
            if not saved:  # (orbax refuses a step at or below the latest it lists)
                raise RuntimeError(f"orbax refused to save step {step}: its latest step is "
                                   f"{self.mgr.latest_step()}")
        self.latest, self.last_time, self.writing = step, time.monotonic(), True

    def wait(self):
        if self.mgr is not None:
            with self._failure(self.latest):
                self.mgr.wait_until_finished()
            self.good, self.writing = self.latest, False

    @contextlib.contextmanager
    def _failure(self, step):
        """One clear error for a save that failed, in the foreground or in the background."""
        try:
            yield
        except Exception as e:
            for name in ("asyncio", "absl"):  # (for good: some come after fit's error)
                logging.getLogger(name).addFilter(_quiet(self.ckpt_dir))
            warnings.filterwarnings("ignore", r"coroutine '.*(write|serializ).*' was never "
                                    r"awaited", RuntimeWarning)
            cause = _cause(e)
            fix = "Free space" if os.strerror(errno.ENOSPC) in cause else "Fix the cause"
            then = (f"The last good checkpoint is step {self.good}, and it is intact. {fix}, "
                    f"then call fit again with resume=True to go on from it." if self.good
                    is not None else f"No checkpoint of this run was written. {fix}, then call "
                                     f"fit again (the run starts afresh).")
            raise OSError(f"fit: saving the checkpoint of step {step} to {self.ckpt_dir} "
                          f"failed: {cause}. {then}") from e

    def close(self):
        try:
            self.wait()  # raises errors of asynchronous saves, never loses them
        finally:
            try:
                if self.mgr is not None:
                    self.mgr.close()
            finally:
                logging.getLogger("absl").removeFilter(self.quiet)
                if self.lock is not None:  # the run is free for a resume
                    self.lock.close()
                    self.lock = None


def _open(ckpt_dir, options):
    # Before orbax starts: reads or writes in flight when a restore or a save fails call back
    # into orbax's closed event loop, from tensorstore's threads, and each prints a traceback.
    if not getattr(sys.unraisablehook, "fit_quiet", False):
        def unraisable(error, hook=sys.unraisablehook):
            if not (error.exc_type is RuntimeError and str(error.exc_value) ==
                    "Event loop is closed"):
                hook(error)
        sys.unraisablehook, unraisable.fit_quiet = unraisable, True
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(ckpt_dir, item_handlers=handlers, options=options)


def _is_url(path):
    return re.match(r"[a-zA-Z][\w+.-]*://", os.fspath(path)) is not None


class _Bucket:
    """A workdir in a GCS bucket, `gs://bucket/path`, through fsspec's client for it, gcsfs: the
    one orbax's paths take there too (its arrays go through tensorstore, TensorBoard's logs
    through google-cloud-storage). What fit needs that a disk gives by itself: listing, reading,
    a create only if absent (`ifGenerationMatch=0`) and an object's age; no flock (`_Lease`)."""

    def __init__(self, url, who, logs=False):
        if not re.fullmatch(r"gs://[\w.-]+(/.*)?", url):
            raise ValueError(f"{who}: {url!r} is not a bucket fit can write to: a local directory "
                             f"or gs://bucket/path (orbax-checkpoint 0.12 writes arrays to gs:// "
                             f"only: mount other stores).")
        need = "pip install gcsfs google-cloud-storage: gcsfs for checkpoints and the run's lock"
        try:
            import fsspec  # (gcsfs's base; not one of fit's packages, needed for a bucket only)
            self.fs = fsspec.filesystem("gs")
        except ImportError as e:
            raise ImportError(f"{who}: a workdir in a bucket ({url}) needs {need}, "
                              f"google-cloud-storage for TensorBoard's logs ({e}).") from None
        if logs and not record_writer.GCS_ENABLED:  # (tensorboardX's writer to a bucket)
            raise ImportError(f"{who}: TensorBoard's logs in a bucket ({url}) need "
                              f"google-cloud-storage: {need}, or pass tensorboard=False.")
        bucket = url.split("/")[2]
        if not self.fs.exists(bucket):
            raise FileNotFoundError(f"{who}: {url!r}: there is no bucket {bucket!r}, or it is not "
                                    f"yours to read; create it, or pass one you can write to.")
        self.checked = False  # (whether the store has been seen to honour a create's condition)

    def listdir(self, url):
        with contextlib.suppress(FileNotFoundError):  # (listed afresh: other hosts write too)
            return [p.rsplit("/", 1)[-1] for p in self.fs.ls(url[5:], detail=False, refresh=True)]
        return []

    def isdir(self, url):
        self.fs.invalidate_cache()
        return self.fs.isdir(url[5:])

    def create(self, url, text):
        """Writes `text` at `url` only if nothing is there (GCS `ifGenerationMatch=0`): False if
        something is, then or by a writer that came first. The first success is tried again: a
        store that takes it twice ignores preconditions, and fit says so."""
        try:
            self.fs.pipe(url[5:], text.encode(), mode="create")
        except FileExistsError:
            return False
        if not self.checked:
            self.checked = True
            if self.create(url, text):
                warnings.warn(f"fit: the store of {url} ignored a precondition (GCS "
                              f"ifGenerationMatch=0) and wrote it twice: runs' claims and locks "
                              f"are not atomic there, so two runs started together may take one "
                              f"name, and a second writer may not be refused.")
        return True

    def read(self, url):
        return self.fs.cat_file(url[5:]).decode()

    def age(self, url):  # (seconds since its write, by the store's clock against this host's)
        return time.time() - self.fs.modified(url[5:]).timestamp()

    def remove(self, url):
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(url[5:])


def _restore_all(mgr, step, state, who, *, frozen=None, **kwargs):
    """`(state, meta, frozen)` of `step` (`kwargs`: `_restore`'s): an nnx model's frozen base from
    the checkpoint that holds it (`frozen`, the one held, where they are equal), else checked
    against the fingerprint a run saved instead (`save_frozen=False`)."""
    base = _is_nnx_state(state) and _meta(mgr, step, who).get("base")
    carved = base and frozen is None  # (nnx weights without the optimizer: all are params)
    if carved:
        params, frozen = _carve(state.params, base)
        state = state.replace(params=params)
    elif base:  # Params outside wrt that the run's step changed (an nnx.EMA's) are its state
        carried, frozen = _carve(frozen, base)
        state = state.replace(batch_stats=_merge(state.batch_stats, carried))
    if base:
        _check_base(base, frozen, f"{who}: the checkpoint at step {step} in {mgr.directory}")
    whole = frozen is not None and not base  # (the base saved with the state)
    restored, meta = _restore(mgr, step, _with_base(state, frozen) if whole else state, who,
                              **kwargs)
    if carved:
        return restored.replace(params=_merge(restored.params, frozen)), meta, None
    if whole:
        restored, saved = _split_base(restored, state, frozen)
        frozen = frozen if _fingerprint(saved) == _fingerprint(frozen) else saved
    return restored, meta, frozen


def _restore(mgr, step, state, who, *, weights_only=False, ema=False):
    """`(state, meta)` of `step`, into `state`'s structure, shapes, shardings (`weights_only`: its
    `params` and `batch_stats`, into a state with any optimizer; `ema`: the average as params)."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          _key_data(state))
    name = _path_name  # (compared first: _check_fits)
    weight = lambda path: not weights_only or name(path).split("/")[0] in ("params", "batch_stats")
    shapes = lambda tree: {name(path): tuple(x.shape) for path, x in
                           jax.tree_util.tree_leaves_with_path(tree) if weight(path)}
    try:
        metadata = mgr.item_metadata(step)["state"]
        stored, wanted = shapes(metadata), shapes(target)
        if not stored:
            raise ValueError("the state's metadata (state/_METADATA) is missing or empty")
        every = {name(p): tuple(x.shape) for p, x in  # (every leaf: where the average is)
                 jax.tree_util.tree_leaves_with_path(metadata.tree, is_leaf=_is_array_like)}
    except Exception as e:
        raise _unrestorable(mgr, step, e, who) from None
    averages = {k[:k.index("fit_ema_params")] + "fit_ema_params" for k in every
                if "fit_ema_params" in k}
    if ema and len(averages) != 1:
        raise ValueError(f"{who}: ema=True, but the checkpoint at step {step} in {mgr.directory} "
                         f"holds no fit.ema average: its run's optimizer was not wrapped in "
                         f"fit.ema(tx). Load it without ema=True.")
    # Weights only: each weight from the checkpoint's leaf of its name (`ema`: the average's); an
    # nnx variable filed in the other group (`wrt` decides) by its path inside the model.
    source = {k: k for k in wanted}
    if weights_only and ema:
        average = averages.pop()
        source = {k: average + k[6:] if k.startswith("params/") else k for k in wanted}
        stored = {k: every[v] for k, v in source.items() if v in every}
    inner = lambda names: {k.split("/", 1)[-1]: k for k in names}
    if weights_only and stored.keys() != wanted.keys() and len(inner(stored)) == len(stored) \
            and inner(stored).keys() == inner(wanted).keys():
        source = {k: inner(stored)[k.split("/", 1)[-1]] for k in wanted}
        stored = {k: stored[v] for k, v in source.items()}
    _check_fits(stored, wanted, f"{who}: the checkpoint at step {step} in {mgr.directory}")
    if weights_only:
        return _restore_weights(mgr, step, state, metadata, source=source, target=target,
                                who=who), None
    with _restoring(mgr, step, who):
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                        meta=ocp.args.JsonRestore()))
        if not (isinstance(out["meta"], dict) and "epoch" in out["meta"]):
            raise ValueError(f"its meta item holds {str(out['meta'])[:80]}")
    restored = jax.tree.map(_as_before, out["state"], state)
    if ema:
        restored = restored.replace(params=_ema_params(restored.opt_state))
    return restored, out["meta"]


def _restore_weights(mgr, step, state, metadata, *, source, target, who):
    """`state` with its `params` and `batch_stats` from the checkpoint's leaves named in `source`
    (`target`: the state's shapes); the rest (orbax restores no part alone) goes to host memory."""
    groups = [k for k in ("params", "batch_stats") if hasattr(target, k)]
    mine = {source[_path_name(p)]: x for p, x in jax.tree_util.tree_leaves_with_path(
        {k: getattr(target, k) for k in groups})}
    one = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    saved = jax.tree_util.tree_map_with_path(lambda p, x: mine.get(
        _path_name(p), jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)), metadata.tree,
        is_leaf=_is_array_like)
    with _restoring(mgr, step, who):
        out = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(saved)))["state"]
    got = {_path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(out)}
    return state.replace(**{k: jax.tree_util.tree_map_with_path(
        lambda p, x, k=k: _as_before(got[source[f"{k}/{_path_name(p)}"]], x), getattr(state, k))
        for k in groups})


def _as_before(restored, like):
    """A restored leaf as the state's: its dtype, or a typed key of its implementation."""
    if _is_key(like):
        return jax.random.wrap_key_data(restored, impl=jax.random.key_impl(like))
    return jnp.asarray(restored, like.dtype)


_is_array_like = lambda x: hasattr(x, "shape")  # (a checkpoint's metadata leaf)


def _key_data(tree):
    """Typed PRNG keys as their raw uint32 data, which orbax can save."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _with_base(state, frozen):
    """`state` with an nnx model's frozen base filed back among its `batch_stats`, as the model
    holds them: the whole state that a checkpoint holds by default (None: `state`)."""
    return state if frozen is None else state.replace(batch_stats=_merge(state.batch_stats,
                                                                         frozen))


def _split_base(whole, like, frozen):
    """`(state, base)` of a restored whole state: its `batch_stats` laid out as `like`'s, and the
    frozen base as `frozen`."""
    stats = whole.batch_stats
    return whole.replace(batch_stats=_part(stats, like.batch_stats)), _part(stats, frozen)


def _carve(tree, paths):
    """`(rest, taken)`: nested dict `tree` without the leaves whose paths are in `paths` (a
    frozen base's fingerprint), and those leaves, each laid out as `tree`."""
    rest, taken = {}, {}
    for k, v in tree.items():
        if isinstance(v, dict):
            parts = _carve(v, {p.split("/", 1)[1] for p in paths if p.startswith(f"{k}/")})
            rest.update({k: parts[0]} if parts[0] else {})
            taken.update({k: parts[1]} if parts[1] else {})
        else:
            (taken if k in paths else rest)[k] = v
    return rest, taken


def _merge(a, b):
    """Nested dicts `a` and `b` as one (`b`'s leaves over `a`'s)."""
    return {**a, **{k: _merge(a.get(k, {}), v) if isinstance(v, dict) else v
                    for k, v in b.items()}}


def _part(tree, like):
    """The part of nested dict `tree` laid out as `like`."""
    return {k: _part(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def _fingerprint(frozen):
    """A frozen base's identity, `{path: [shape, dtype, checksum]}`: the checksum sums, modulo
    2**32, a hash of each element's bits and position (murmur3's mixer: a permutation or a change
    of any bit moves it), exact and free of the summation's order: the same on any device count."""
    def mix(h):  # (every bit of h reaches every bit of the result; uint32 products wrap)
        h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
        h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
        return h ^ (h >> 16)

    def checksum(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        at = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 0) if x.ndim else jnp.uint32(0)
        for axis in range(1, x.ndim):  # (the flat index, row-major)
            at = at * x.shape[axis] + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        return jnp.sum(mix(bits.astype(jnp.uint32) ^ mix(at + np.uint32(0x9E3779B9))),
                       dtype=jnp.uint32)
    sums = jax.device_get(jax.jit(lambda tree: jax.tree.map(checksum, tree))(frozen))
    return {_path_name(p): [list(x.shape), str(x.dtype), int(c)] for (p, x), c in zip(
        jax.tree_util.tree_leaves_with_path(frozen), jax.tree.leaves(sums))}


class _Run:
    """What a hook sees: `event` (`train_start`, `log`, `epoch_end`, `eval`, `save` before a
    checkpoint, `train_end`), `step`, `epoch`, `state` (valid during the call only), `metrics`, at
    `log` the means of the interval up to `step` (a log step's `train/grad_norm`,
    `train/param_norm` and `grad_norm/...`: at multiples of `log_every` only, so not at an epoch's
    last log point if it falls between; read them with `run.metrics.get`), with `state` one call
    past `step` (the host reads a log point's sums after dispatching the next call), but at `step`
    itself where an epoch ends or a save falls there (read at once), `history`, `name`, `id` (the
    same on every resume, e.g. for `wandb.init(id=run.id, resume="allow")`), `monitor`, `mode`,
    `best`, `log_dir`, `ckpt_dir`, `writer`, `total_steps`, `num_epochs`, `stopped_early`,
    `interrupted`, `resumed`, `frozen` (an nnx model's frozen base, which `state` leaves out, or
    None); `arrays` (at `eval`: array metrics, e.g. a confusion matrix, `{tag: ndarray}`; `metrics`
    holds floats only, so `json.dumps(run.metrics)` works). A hook may set `stop` (final), `save`,
    and at train_end `state`; assigning `state` elsewhere or changing `metrics` raises (fit has
    logged and ranked them: compute a metric with `eval_metrics=`). `with run.timed(name):` times a
    hook's own work. `_Run` calls the hooks, keeps the history and hooks' `get_state()`, and makes
    processes agree on what hooks and signals ask."""

    def __init__(self, hooks, plan, ckpts, progress):
        best = self.best_of = ckpts.best
        self.hooks, self.hook_names = hooks, _hook_names(hooks)
        self.hook_states = _hook_states(progress.hooks, hooks, self.hook_names)
        best.go_on(progress)
        self.total_steps, self.num_epochs = plan.end(progress.start), plan.num_epochs
        self.changed = progress.changed  # (the options a resume changed: TensorBoard shows them)
        self.monitor, self.mode = best.monitor, best.mode
        self.log_dir, self.ckpt_dir, self.writer = ckpts.log_dir, ckpts.ckpt_dir, None
        self.frozen, self.resumed = ckpts.frozen, ckpts.resumed  # (the nnx base; a resumed run)
        # The run's name, and an id that no other workdir's run of that name has (for trackers)
        where = hashlib.sha256(ckpts.ckpt_dir.encode()).hexdigest()[:8]  # (absolute, or a URL)
        self.name, self.id = ckpts.run, f"{ckpts.run}-{where}"
        history = self.history = History(progress.history)
        history.run, history.log_dir, history.ckpt_dir = ckpts.run, ckpts.log_dir, ckpts.ckpt_dir
        self.stopping = progress.stop  # (a hook's stop, for good: _Progress.go_on)
        self.stopped_early = self.interrupted = self.stop = self.save = False
        self.event = self.step = self.epoch = self.state = None
        # (clock: set once the loop runs)
        self.metrics, self.arrays, self.last_eval, self.clock = {}, {}, None, None

    best = property(lambda self: self.best_of.value)  # (the best monitored value so far)

    def call(self, event, state, step, epoch, *, metrics=None, arrays=None, save=False,
             stop=None):
        """Calls every hook with (event, run), then takes what they asked for. A stop or save that
        any of several processes asks for (a hook, a signal: `stop`) holds for all."""
        self.event, self.state, self.step, self.epoch = event, state, step, epoch
        self.metrics, self.stop, self.save = metrics or {}, False, self.save or save
        self.arrays, logged = arrays or {}, dict(self.metrics)
        self.stopping = self.stopping or stop
        for hook, name in zip(self.hooks, self.hook_names):
            # Your hooks' time is left out of steps/s (`hooks_s`); the built-in ones' stays in.
            with contextlib.nullcontext() if _builtin(hook) or not self.clock else \
                    self.clock.timed("hooks"):
                hook(event, self)
            if self.state is not state and event != "train_end":
                raise ValueError(f"fit: hook {_name(hook)} assigned run.state at {event!r}, "
                                 f"where fit would ignore it: only at 'train_end' does a hook's "
                                 f"state become the one fit returns.")
            if self.metrics != logged:
                raise ValueError(f"fit: hook {_name(hook)} changed run.metrics at {event!r}, "
                                 f"which fit has already logged and ranked; compute a metric "
                                 f"with fit(..., eval_metrics={{name: fn(state, batches)}}).")
            if self.stop and not self.stopping:
                self.stopping = _name(hook)
            if event == "train_start" and name in self.hook_states and hasattr(hook, "set_state"):
                hook.set_state(self.hook_states[name])  # what it had at the checkpoint
        if event == "train_start" and self.changed:  # (the HParams tab keeps the first values)
            self.history.setdefault("options_changed", []).append(f"step {step}: " + ", ".join(
                f"{k} {a!r} -> {b!r}" for k, (a, b) in self.changed.items()))
        if jax.process_count() > 1 and event != "train_end":  # (a collective all reach)
            _agree_on_stops(self)
        return self.state

    def timed(self, name: str) -> contextlib.AbstractContextManager:
        """`with run.timed("upload"):` a hook's own work, as `history.timing["upload_s"]`; all of
        your hooks' time is kept out of steps/s anyway, as `hooks_s`."""
        if self.clock and name in self.clock.spent:
            raise ValueError(f"fit: run.timed({name!r}) would add to fit's own {name}_s; "
                             f"name your part otherwise.")
        return self.clock.timed(name) if self.clock else contextlib.nullcontext()

    def record(self, row, *items):
        for name, value in [*items, *row.items()]:
            self.history.setdefault(name, []).append(value)

    def end(self, state, step, epoch):
        """The train_end hooks; EarlyStopping may swap in the best state here. A run that was
        already finished calls only these, so it returns what its first call returned."""
        self.stopped_early, self.interrupted = bool(self.stopping), self.stopping in _SIGNALS
        return self.call("train_end", state, step, epoch)

    def close(self):
        """After an error: the built-in hooks close bar and files (the user's get no train_end)."""
        if self.event != "train_end":
            self.interrupted = True
            for hook in filter(_builtin, self.hooks):
                hook("train_end", self)


def _hook_names(hooks):
    """Each hook's stable name, the key of its saved state, the same on every process whatever
    `verbose` and `tensorboard`: its `name` attribute, else its class's or function's name; the
    n-th hook of one name is `<name>_<n>`."""
    bases = [getattr(hook, "name", None) or _name(hook) for hook in hooks]
    return [b if not bases[:i].count(b) else f"{b}_{bases[:i].count(b) + 1}"
            for i, b in enumerate(bases)]


def _hook_states(saved, hooks, names):
    """A checkpoint's hook states by name; one written before #40 keyed them by position among all
    hooks (the built-in ones' count varied): its states go to the hooks that keep one, in order."""
    if not saved or not all(key.isdigit() for key in saved):
        return saved
    keeping = [name for hook, name in zip(hooks, names) if hasattr(hook, "set_state")]
    return dict(zip(keeping, [saved[key] for key in sorted(saved, key=int)]))


# -- The loop: the compiled steps' calls, the train metrics read one call late, time; its body -----

_MANY_SHAPES = 10  # distinct train batch shapes (each compiles) before fit warns


_AHEAD = 2  # calls between the host's waits for the device, once a call _AHEAD before


_LAG = 1  # calls after a log point that its sums are read (the read waits for them if need be)


_WINDOW = 0.2  # seconds of steady steps that steps_per_jit="auto" times, singly and grouped


def _steps_per_call(timed, waited, compile_s, left, periods, *, unroll=False):
    """steps_per_jit="auto"'s k from `timed`, the seconds a step by steps a call measured so far.
    With single steps alone, the k to try: 1 where the device is the bottleneck (the host `waited`
    for it over 10% of the time), where k steps would compile unrolled (`_unrolled`: ~k times a
    step's compile), or where the `left` steps (None: unknown) would run for less than twice the
    `compile_s` so far; else the largest k up to 16 that divides the log, eval and save `periods`,
    so each stays exact (a call of k steps does the host's work of one: its data, dispatch and
    bookkeeping). With k-step calls timed too: k if their steps ran 10% faster, else 1."""
    if len(timed) > 1:
        k = max(timed)
        return k if timed[k] * 1.1 < timed[1] else 1
    if waited > 0.1 or unroll or left is not None and left * timed[1] < 2 * compile_s:
        return 1
    return max(k for k in range(1, 17) if all(p % k == 0 for p in periods))


class _Dispatch:
    """The compiled steps' calls: dispatches step n (or k steps) and keeps their on-device sums
    (`_Readings.read` takes them); only a new batch shape waits, to compile and to time it, and
    XLA's estimates of it (FLOPs for `_Clock`, the memory, said before its first step). `steps_at`
    says how many steps a call takes (steps_per_jit; "auto": `tune`'s choice)."""

    def __init__(self, steps, clock, opts, step, total=None):
        self.steps, self.clock, self.acc, self.calls = steps, clock, steps.acc0, 0
        self.compiled, self.marker, self.waited = {}, None, 0.0  # {shape: (rows, FLOPs)}
        # The batch shapes fed since the last log point, where they changed (agree_shapes).
        self.shape, self.changes, self.fed = None, [], step
        self.grad_accum, self.verbose = opts.grad_accum, _verbosity(opts.verbose)
        self.auto = opts.steps_per_jit == "auto" and jax.process_count() == 1  # (see tune)
        self.said = opts.steps_per_jit == "auto"  # (broken groups: auto's are its own, unsaid)
        self.k = 1 if opts.steps_per_jit == "auto" else opts.steps_per_jit
        self.stop, self.total, self.unroll, self.train_k = opts.max_steps, total, None, None
        self.periods = [p for p in (opts.log_every, opts.eval_every, opts.ckpt_every) if p]
        self.mark, self.timed = None, {}  # (tune's: where its window began; {k: s a step})

    def steps_at(self, step):
        """The steps of a call that starts at `step`: k at multiples of k (so a resume groups
        alike), not past max_steps, else 1."""
        k = self.k
        return k if k > 1 and step % k == 0 and not (self.stop and step + k > self.stop) else 1

    def broken(self, step):
        """A run of k batches whose shapes change at `step`: its batches run alone (said once)."""
        if not self.said:
            warnings.warn(f"fit: steps_per_jit={self.k} stacks runs of {self.k} batches of one "
                          f"shape, but the shapes changed within one at step {step}, whose "
                          f"batches run singly; order the data in runs of {self.k}.")
            self.said = True

    def __call__(self, state, batch, k, *, epoch=0, position=(0, None)):
        """Step n (or k steps) on `batch`; a new shape compiles first (`_compile`)."""
        started = time.perf_counter()  # (the host's wait for the batch ends)
        shape = (k, *(a.shape for a in jax.tree.leaves(batch)))
        if shape != self.shape:  # (length buckets: a new shape)
            self.shape = shape
            self.changes.append((self.fed, shape))
        self.fed, self.calls = self.fed + k, self.calls + 1
        if cost := self.compiled.get(shape):  # (rows, FLOPs per device) of a call of this shape
            train = self.steps.train if k == 1 else self.train_k
            state, self.acc = train(state, self.acc, batch, self.steps.frozen)
        else:  # one wait per new shape, so compile time is kept out of the rate
            state = self._compile(state, batch, shape, (epoch, position))
        if self.calls % _AHEAD == 0:  # no queue of batches (and, measured, a faster host)
            t = time.perf_counter()
            if self.marker is not None:  # the call _AHEAD before, usually long done
                self.marker.block_until_ready()
            self.waited, self.marker = self.waited + time.perf_counter() - t, self.acc["count"]
        if cost:
            self.clock.ran(k, *cost, started)
        return state

    def _compile(self, state, batch, shape, where):
        """A new shape's call, compiled ahead to read XLA's estimates (the call reuses the
        executable); the first shape's with the check before saves beside it (`_compile_check`),
        grad_accum's check (`_check_accum`), and whether k-step calls unroll (`_unrolled`). A
        failure on a later shape is named (another shape; k steps where single ones ran)."""
        k, frozen = shape[0], self.steps.frozen
        if not (self.compiled or self.steps.train_sums.lrs):  # (said once a call)
            _say(self.verbose, "fit: no train/lr: the optimizer keeps no learning rate; build it "
                               "with optax.inject_hyperparams(...), or pass lr_fn=.")
        try:
            with self.clock.timed("compile", k):
                check = None if self.compiled else self._compile_check(state)
                accum = not self.compiled and self.steps.accum_check  # (once: grad_accum's loss)
                accum = accum and accum(state, jax.tree.map(lambda a: a[0], batch) if k > 1 else
                                        batch, frozen)  # (its compile beside the step's)
                if self.unroll is None:  # (the single step's program, as it is traced once)
                    one = batch if k == 1 else jax.tree.map(
                        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
                    self.unroll = _unrolled(self.steps.train.lower(state, self.acc, one, frozen))
                    self.train_k = self.steps.train_k(self.unroll)
                train = self.steps.train if k == 1 else self.train_k
                executable = train.lower(state, self.acc, batch, frozen).compile()
                if accum:
                    accum()  # before the first update, which donates the state
                self.compiled[shape] = self._analyse(executable, shape)  # (the first comes first)
                state, self.acc = jax.block_until_ready(train(state, self.acc, batch, frozen))
                if check:
                    check.join()
        except Exception as e:
            if not self.compiled or shape in self.compiled:  # (the first: its checks say why)
                raise
            (epoch, position), first = where, next(iter(self.compiled))
            if k > 1 and (1, *(s[1:] for s in shape[1:])) in self.compiled:  # (k of them ran)
                raise ValueError(f"fit: the call of {k} steps (steps_per_jit) failed where single "
                                 f"steps of these batches ran ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:300]}); pass steps_per_jit=1.") from e
            raise ValueError(f"fit: the train step failed on the batch of shapes {shape[1:]}"
                             f" (epoch {epoch + 1}, batch {position[0] - k}), which differ "
                             f"from the first batch's {first[1:]}: does the model take inputs "
                             f"of that shape? ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:300]})") from e
        if k == 1 and sum(s[0] == 1 for s in self.compiled) == _MANY_SHAPES:  # (batch shapes)
            warnings.warn(f"fit: train batches have come in {_MANY_SHAPES} shapes so far, and "
                          f"each new shape compiles the step again; pad them to a few lengths "
                          f"(buckets) instead.")
        return state

    def tune(self, step):
        """steps_per_jit="auto", at log points: the steady time a step over whole log intervals
        (at least _WINDOW s) of single steps, then, where `_steps_per_call` says k > 1, of k-step
        calls (their compile left out); the faster stays. Said once; in `timing`."""
        if not (self.auto and self.compiled):
            return
        jax.block_until_ready(self.acc)  # (the interval's steps have run: its time is theirs)
        now = (step, self.clock.steady_seconds(), self.waited)
        steps, seconds, waited = (b - a for a, b in zip(self.mark or now, now))
        self.mark = self.mark or now  # (the window begins at the first log point)
        if not steps or seconds < _WINDOW:
            return
        self.mark, self.timed[self.k] = now, seconds / steps
        k = _steps_per_call(self.timed, waited / seconds, self.clock.spent["compile"][0],
                            self.total and self.total - step, self.periods, unroll=self.unroll)
        if len(self.timed) == 1 and k > 1:  # (k-step calls to be timed in turn)
            self.k = k
            return
        timed = {k: round(1e6 * t, 2) for k, t in self.timed.items()}  # (us a step)
        self.auto, self.k, self.clock.chosen = False, k, {"steps_per_jit": k,
                                                          "steps_per_jit_us": timed}
        _say(self.verbose, f"fit: steps_per_jit='auto': {k} step(s) a call from step {step} "
                           f"(measured, us a step by steps a call: {timed}).")

    def _compile_check(self, state):
        """The check before saves (`param_norm`), compiling in a thread beside the first step's
        compile, on another core: off the first step's path. Lowered here, as the step donates the
        state; a failure shows at its first call, in the open."""
        lowered = self.steps.param_norm.lower(state)

        def compile():
            with contextlib.suppress(Exception):
                lowered.compile()
        thread = threading.Thread(target=compile)
        thread.start()
        return thread

    def _analyse(self, compiled, shape):
        """A call's rows (all processes') and FLOPs per device, from XLA's cost analysis of its
        executable, which counts a rolled loop's body once (grad_accum's scan; steps_per_jit's
        unless unrolled); the first shape's memory estimate is said before its step runs."""
        k = shape[0]
        rows = shape[1][k > 1] * k
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, list) else cost) or {}
        flops = cost.get("flops", 0.0) * (1 if k == 1 or self.unroll else k) * self.grad_accum
        memory, estimate = compiled.memory_analysis(), self.clock.estimate
        if memory is not None:
            new = {f"step_{part}_bytes": getattr(memory, f"{part}_size_in_bytes")
                   for part in ("argument", "output", "temp")}
            if estimate["step_argument_bytes"] is None:  # (the first shape's: said)
                total = sum(new.values()) - memory.alias_size_in_bytes  # (the donated state)
                mb = lambda n: f"{n / 1e6:.1f} MB"
                parts = ", ".join(f"{name} {mb(n)}" for name, n in zip(
                    ("arguments", "outputs", "temporaries"), new.values()))
                _say(self.verbose, f"fit: the compiled train step needs about {mb(total)}"
                                   f" per device ({parts}: XLA's estimate).")
            estimate.update({key: max(v, estimate[key] or 0) for key, v in new.items()})
        return rows, flops

    def agree_shapes(self, step):
        """Every process fed batches of the same shapes since the last log point (_check_data)."""
        fed = "; ".join(f"step {s + 1}: {shape[1:]}" for s, shape in self.changes)
        _agree(fed or "no new shape", f"the processes fed batches of different shapes by step "
                                      f"{step}")
        self.changes = []


class _Readings:
    """The train metrics on the host: the sums of the calls up to a log point, read `_LAG` calls
    later, when the device has finished them, so the host never waits; the means of the log
    interval and the epoch (`meter`, checkpointed as `_Progress.meter`), so a resumed run logs
    what an uninterrupted one would; the non-finite values they show, which raise."""

    def __init__(self, dispatch, opts, meter, step):
        self.dispatch, self.steps, self.clock = dispatch, dispatch.steps, dispatch.clock
        self.skipping, self.norms, self.lr, self.logged = opts.on_nonfinite == "skip", {}, {}, step
        # per part: [steps summed, {metric: sum}]; "skipped": non-finite steps dropped so far;
        # "run": each `Total`'s sum since the run began
        self.meter = {"run": {}, **(meter or {"log": [0, {}], "epoch": [0, {}], "skipped": 0})}
        self.pending = collections.deque()  # log points to read: (sums, step, log?, calls)

    def read(self, step, log_due, sync=False):
        """`[(step, metrics)]` of the log points ready now: a log point's sums are read `_LAG`
        calls later, when the device has finished them and still has steps queued to run while
        the host logs; with `sync` (an epoch's end, a save), at once."""
        ready, calls = [], self.dispatch.calls
        while self.pending and (sync or calls - self.pending[0][3] >= _LAG):
            ready.append(self.pending.popleft())
        if log_due or sync:
            if jax.process_count() > 1:
                self.dispatch.agree_shapes(step)
            d = self.dispatch  # (its sums since the last log point, taken: they start anew)
            acc, calls, d.acc = d.acc, d.calls, self.steps.acc0
            (ready if sync else self.pending).append((acc, step, log_due, calls))
        logged = []
        for acc, at, log, _ in ready:
            self._add(jax.tree.map(np.asarray, acc), at)  # (device_get: ~0.1 ms more on CPU)
            logged += self._interval(at) if log else []
        return logged

    def _add(self, acc, step):
        n, n_bad, first_bad, values, norms, lr = self.steps.train_sums.read(acc)
        if n_bad and not self.skipping:
            bad = [k for k, (total, _) in values.items() if not math.isfinite(total)]
            what = ", ".join(sorted(bad, key=lambda k: k != "loss"))
            self._nonfinite(f"values (NaN or Inf) in {what} at step {first_bad + 1} (checked by "
                            f"step {step})")
        if norms:  # (a log step's)
            self.norms = {f"train/{k}": v for k, v in norms.items() if k in self.steps.train_names}
            grad, param = norms["grad_norm"], norms["param_norm"]
            self.check(step, param if math.isfinite(grad) else grad)
        self.clock.sums_read(n, values.get("loss", (0, 0))[1])
        for part in (self.meter["log"], self.meter["epoch"]):
            part[0] += n
            part[1] = {k: [a + b for a, b in zip(part[1].get(k, (0, 0)), v)]
                       for k, v in values.items()}
        self.meter["skipped"] += n_bad
        for k in self.steps.train_sums.totals:
            self.meter["run"][k] = self.meter["run"].get(k, 0.0) + values[k][0]
        self.lr = lr

    def _interval(self, step):
        """The means of the interval that ends at `step`, with the learning rate and speed."""
        if step == self.logged:
            return []
        means = {**self.means("log"), **self.norms, **self.lr, **self.clock.perf(step)}
        self.norms, self.logged = {}, step  # (no means: every step was skipped)
        return [(step, means)]

    def check(self, step, norm, state=None):
        """A non-finite parameters' `norm` (of `state`, before a save: a NaN anywhere in it too)
        raises: no NaN is saved."""
        if state is not None:
            norm = float(self.steps.param_norm(state))
        if not (math.isfinite(norm) or self.skipping):
            self._nonfinite(f"parameters, gradients or state (NaN or Inf) at step {step}, in "
                            f"the log interval after step {self.logged}")

    @staticmethod
    def _nonfinite(what):
        raise FloatingPointError(f"fit: non-finite {what}; no checkpoint was written after it. "
                                 f"Lower the learning rate, check the data, or pass "
                                 f"on_nonfinite='skip' to drop such updates.")

    def means(self, part, reset=True):
        """The means of a part's sums, which then start again (`reset`). An epoch whose every
        step was skipped as non-finite has NaN means; such a log interval has none."""
        n, sums = self.meter[part]
        if reset:
            self.meter[part] = [0, {}]
        sums = sums if n or part == "epoch" else {}
        where = "an epoch" if part == "epoch" else f"the log interval after step {self.logged}"
        means = {f"train/{k}": _mean(k, *v, "the train step", where) if n else math.nan
                 for k, v in sums.items()}
        means |= {f"train/{k}": self.meter["run"][k] for k in self.steps.train_sums.totals
                  if f"train/{k}" in means}  # (a Total: the run's sum so far)
        if self.skipping:
            means["train/skipped_steps"] = float(self.meter["skipped"])
        return means


# Dense bf16 peak TFLOP/s per chip (data sheets, no sparsity) for perf/mfu, by `device_kind`.
_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0),
                ("L4", 121.0), ("TPU v6 lite", 918.0),
                ("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v4", 275.0), ("TPU v3", 123.0))


def _peak_tflops(device_kind):
    return next((peak for name, peak in _PEAK_TFLOPS if name in device_kind), None)


class _Clock:
    """Time and speed: what the steady rate leaves out (compiles, evals, saves, the last commit,
    your hooks), the steady rate, the speed figures of a log point, and `timing`, the run's."""

    def __init__(self, steps, opts, step):
        # What the steady rate leaves out, [seconds, times]; "data" is the host fetching batches.
        self.spent = {k: [0.0, 0] for k in ("compile", "eval", "save", "finish", "data", "hooks")}
        self.within = {}  # what `run.timed` measures inside another timed part (not subtracted)
        self.spent_steps, self.first_step, self.timing_now = 0, step, False
        self.t0 = self.t_ready = self.t_logged = time.perf_counter()
        self.t_end, self.data_logged, self.compile_shown = None, 0.0, 0.0
        # The steady calls' rows and FLOPs (over `counted` steps), the loss's weights (over
        # `summed` steps): their means a step x steps/s are the speed figures.
        self.rows = self.flops = self.tokens = 0.0
        self.counted = self.summed = 0
        self.weighted = steps.weighted_loss and "loss" in steps.train_sums.names
        self.peak = opts.peak_tflops or _peak_tflops(jax.local_devices()[0].device_kind)
        # XLA's memory estimate of the compiled step, per device (the largest shape's: _Dispatch)
        self.estimate = dict.fromkeys(("step_argument_bytes", "step_output_bytes",
                                       "step_temp_bytes"))
        self.devices = [d for d in jax.local_devices() if d.memory_stats() is not None]
        # steps_per_jit's k (`_Dispatch.tune`: "auto"'s choice, and the us a step it measured)
        self.chosen = {"steps_per_jit": 1 if opts.steps_per_jit == "auto" else opts.steps_per_jit,
                       "steps_per_jit_us": {}}

    def ran(self, k, rows, flops, started):
        """A steady call of k steps, `started` once the host had its batch (the wait for data:
        since the last call's end)."""
        self.spent["data"][0] += started - self.t_ready
        self.rows, self.flops, self.counted = self.rows + rows, self.flops + flops, self.counted + k
        self.t_ready = time.perf_counter()

    def sums_read(self, steps, tokens):  # (the sums of `steps` read: their loss's weights)
        self.summed, self.tokens = self.summed + steps, self.tokens + tokens * self.weighted

    @contextlib.contextmanager
    def timed(self, what, steps=0):
        """Times what the steady rate leaves out: a compile, an eval, a save, the final commit,
        your hooks (and, within them, their own parts, which are not left out twice)."""
        t, inside = time.perf_counter(), self.timing_now
        self.timing_now = True
        try:
            yield
        finally:
            self.timing_now = inside
            # (within another part, or after training ended: reported, not subtracted again)
            apart = inside or self.t_end is not None
            part = (self.within if apart else self.spent).setdefault(what, [0.0, 0])
            part[0] += time.perf_counter() - t
            part[1] += 1
        self.spent_steps += steps
        self.t_ready = time.perf_counter()
        if what == "finish":  # training ends here: closing writers and files after it is not
            self.t_end = self.t_ready

    def steady_seconds(self):
        return (self.t_end or time.perf_counter()) - self.t0 - sum(
            s for k, (s, _) in self.spent.items() if k != "data")

    def steady_rate(self, step):
        seconds, steps = self.steady_seconds(), step - self.first_step - self.spent_steps
        return steps / seconds if steps > 0 and seconds > 0 else None

    def speed(self, rate):
        """At the steady `rate` (steps/s) of this call: `examples_per_s` (all processes' rows);
        `tokens_per_s` (a `Weighted` loss: its mean weight a step x steps/s); `tflops_per_s` per
        device; `mfu` (over the dense bf16 peak); `memory_gb` (a device's peak; not on CPU). None:
        not known (no steady step yet)."""
        # Every figure is its mean per step x steps/s, so all cover the same steps (the rows and
        # FLOPs are summed as calls are dispatched, one call past a log point's step).
        per_step = lambda total, n: rate and n and total / n * rate or None
        out = {"examples_per_s": per_step(self.rows, self.counted),
               "tflops_per_s": per_step(self.flops / 1e12, self.counted)}
        if self.weighted:
            out["tokens_per_s"] = per_step(self.tokens, self.summed)
        if self.peak:
            out["mfu"] = out["tflops_per_s"] and out["tflops_per_s"] / self.peak
        if self.devices:  # (read at log points only: a query per device)
            out["memory_gb"] = max(d.memory_stats().get("peak_bytes_in_use", 0)
                                   for d in self.devices) / 1e9
        return out

    def perf(self, step):
        """A log point's `perf/` figures: steps/s and `speed`, the share of time waiting for
        data since the last one, the compile time (at first, then for each new shape)."""
        now, rate, out = time.perf_counter(), self.steady_rate(step), {}
        if rate:
            out["perf/steps_per_s"] = rate
            out |= {f"perf/{k}": v for k, v in self.speed(rate).items() if v is not None}
        waited = self.spent["data"][0] - self.data_logged
        out["perf/data_wait_fraction"] = waited / max(now - self.t_logged, 1e-9)
        if self.spent["compile"][0] > self.compile_shown:
            out["perf/compile_s"] = self.compile_shown = self.spent["compile"][0]
        self.t_logged, self.data_logged = now, self.spent["data"][0]
        return out

    def timing(self, step):
        now, rate = time.perf_counter(), self.steady_rate(step)
        zero = (0.0, 0)  # (hooks_s: your hooks' time, also that within saves)
        parts = {k: [a + b for a, b in zip(self.spent.get(k, zero), self.within.get(k, zero))]
                 for k in {**self.spent, **self.within}}
        return {**{f"{k}_s": s for k, (s, _) in parts.items()},
                **{f"{k}_count": n for k, (_, n) in parts.items() if k != "data"},
                "close_s": now - (self.t_end or now), "steps": step - self.first_step,
                "steady_steps_per_s": rate, "wall_s": now - self.t0, **self.speed(rate),
                **self.estimate, **self.chosen}


class _Loop:
    """The loop's body around its steps, built once by `fit`: the log points (`log`, with the
    `poll`), an eval, an epoch's end, a save. It holds the run's parts, so none is handed around."""

    def __init__(self, run, readings, ckpts, signals, *, plan, eval_data, python, verbose):
        self.run, self.readings, self.ckpts, self.signals = run, readings, ckpts, signals
        self.plan, self.eval_data, self.python, self.verbose = plan, eval_data, python, verbose
        ckpts.progress.check_read()  # (the run's parts are built: each read what it goes on from)

    def log(self, state, step, epoch, *, due=False, sync=False):
        """A `log` event for each log point whose sums `_Readings.read` returns; at the loop's own
        log points (not `sync`), first the poll."""
        # steps_per_jit="auto" times whole log intervals, waiting for their sums: before `read`
        if due and not sync:  # takes them
            self.readings.dispatch.tune(step)
        logged = self.readings.read(step, due, sync)
        save, stop = self.poll() if logged and not sync else (False, None)
        for at, metrics in logged:
            self.run.call("log", state, at, epoch, metrics=metrics, save=save, stop=stop)

    def pending(self):  # (log points whose sums are to be read at the next call)
        return bool(self.readings.pending)

    def poll(self):
        """`(save, stop)`: whether `ckpt_interval` has passed, a signal to one of several processes;
        a failed asynchronous save raises here. At log points only: orbax's asks cost host time."""
        self.ckpts.raise_failed()
        return time.monotonic() - self.ckpts.last_time >= self.ckpts.interval, self.signals.asked

    def evals(self, state, step, epoch):
        """An eval of every set: `eval/<metric>`, or `eval/<set>/<metric>` for named sets; with
        `plan.ema`, the average's too, `eval_ema/...`. Every metric is computed first (fit's, then
        `eval_metrics`'), then recorded, ranked and shown to the hooks, all the same values."""
        states = {"eval": state}
        if self.plan.ema:
            states["eval_ema"] = state.replace(params=_ema_params(state.opt_state))
        metrics, arrays = {}, {}
        for part, of in states.items():
            for name, test in self.eval_data.items():
                values = _eval_set(self.readings.steps, test, of, name, clock=self.run.clock,
                                   python=self.python)
                for k, v in values.items():  # (arrays: to hooks and TensorBoard, not the history)
                    tag = _metric_tag(part, name, k)
                    (arrays if isinstance(v, np.ndarray) else metrics)[tag] = v
        if self.run.last_eval is None:  # (the first eval of this call)
            _check_first_eval(self.plan, self.readings.steps.eval_sums, metrics, self.verbose)
        run, run.last_eval = self.run, step
        run.record(metrics, ("eval/epoch", epoch + 1), ("eval/step", step))
        run.save = run.best_of.track(metrics, step) or run.save
        run.call("eval", state, step, epoch, metrics=metrics, arrays=arrays)

    def end_epoch(self, state, step, epoch, *, complete):
        """An epoch's end: last log, history row, hooks, due eval (`complete=False`: max_steps
        cut it)."""
        run = self.run
        self.log(state, step, epoch, due=True, sync=True)
        # (a cut epoch's sums go on after a resume)
        row = self.readings.means("epoch", reset=complete)
        run.record(row, ("epoch", epoch + 1), ("step", step))
        run.save = run.best_of.track(row, step) or run.save  # (a train/ monitor's)
        run.call("epoch_end", state, step, epoch, metrics=row)
        last = self.plan.done(epoch + complete, step)
        if self.plan.eval_at_epoch_end(epoch + 1, last) and run.last_eval != step:
            self.evals(state, step, epoch)

    def checkpoint(self, state, step, epoch, position):
        """A checkpoint of this step (asynchronous) with all the run depends on (`_Progress`);
        first the metrics are read and the parameters checked, so a NaN state is never written."""
        run, readings = self.run, self.readings
        if step == self.ckpts.latest:
            return
        self.log(state, step, epoch, sync=True)
        with run.clock.timed("save"):  # (the check, the hooks and orbax's blocking part)
            readings.check(step, None, state)
            run.call("save", state, step, epoch)
            if run.stopping:
                run.history.setdefault("stopped", []).append(f"{run.stopping} at step {step}")
            best, value = run.best_of, run.best_of.rank(step)  # (first: the record holds it)
            position = position if position[0] else (0, None)
            self.ckpts.progress.saving(
                epoch=epoch, position=position, positions=_gathered(position), meter=readings.meter,
                history=run.history, best=best.value, best_step=best.step, top=best.top,
                stop=None if run.stopping in _SIGNALS else run.stopping,
                hooks={name: h.get_state() for h, name in zip(run.hooks, run.hook_names)
                       if hasattr(h, "get_state")})
            self.ckpts.write(step, state, value)
        run.save = False
        if run.stopping in _SIGNALS:
            _say(self.verbose, f"fit: stopped by {run.stopping} at step {step}; checkpoint "
                               f"saved, continue with resume=True.")


def _metric_tag(part, eval_set, metric):
    """`eval/accuracy`, or with a named eval set `eval/val/accuracy`."""
    return f"{part}/{metric}" if eval_set is None else f"{part}/{eval_set}/{metric}"


def _eval_set(steps, test, state, name=None, *, clock=None, python=None):
    """Metrics over one eval set, `{name: float or ndarray}`: summed on device and read once (a
    state merged on the host: each batch's read one batch late, as the next runs), then the ones
    computed in Python (`python`); `clock`: its time is left out of the rate."""
    with clock.timed("eval") if clock else contextlib.nullcontext():
        acc, step, sums = steps.eval0[name], steps.evals[name], steps.eval_sums[name]
        host, last = {}, {}
        for batch, *_ in test.calls(0, put=steps.put):
            acc, out = step(state, acc, batch, steps.frozen)
            host, last = _merged(host, last), out  # (the batch before this one's)
        values = sums.read(jax.device_get(acc), _merged(host, last), f"the eval set {test.name}")
        if values is None:
            raise ValueError(f"fit: {test.name} yielded no batches; a generator can be iterated "
                             f"only once: pass a list or a re-iterable loader.")
        return {**values, **(python(_joined(state, steps.frozen), test) if python else {})}


def _merged(host, new):
    """Metric states merged on the host: `host`'s with `new`'s (on the device), by name."""
    new = jax.device_get(new) if new else new  # (no state merged on the host: no read)
    return {k: host[k].merge(v) if k in host else v for k, v in new.items()}


def _python_metrics(fns, view):
    """`eval_metrics` as one function `(state, eval set) -> {name: float}`: each `fn(view(state),
    batches)` runs on every process (it may call jitted code), and process 0's values hold."""
    def compute(state, test):
        values = []
        for name, fn in fns.items():
            value = fn(view(state), test)
            try:
                values.append(float(value))
            except (TypeError, ValueError):
                raise TypeError(f"fit: eval_metrics[{name!r}] must return a float, got "
                                f"{type(value).__name__} {str(value)[:80]}.") from None
        return dict(zip(fns, (_gathered(values) or [values])[0]))  # (process 0's, exactly)
    return compute if fns else None


# -- Processes and signals: what every process must agree on; SIGINT, SIGTERM, preemption ----------

def _agree_on_stops(run):
    """A stop or save that any process asks for (a hook, a signal) holds for all, so every process
    saves the same; a hook's stop (final) outranks a signal's (resumable)."""
    kind = 0 if not run.stopping else 1 if run.stopping in _SIGNALS else 2
    most, save = multihost_utils.process_allgather(np.array([kind, run.save], np.int32)).max(0)
    run.save = bool(save)
    if most > kind:
        run.stopping = "SIGINT" if most == 1 else "a hook on another process"


def _gathered(value):
    """Every process's JSON-able `value`, by process index (a collective); one process: None."""
    if jax.process_count() == 1:
        return None
    text = json.dumps(_jsonable(value)).encode()
    size = int(np.asarray(multihost_utils.process_allgather(np.int32(len(text)))).max())
    rows = multihost_utils.process_allgather(np.frombuffer(text.ljust(size), np.uint8))
    return [json.loads(bytes(row).decode()) for row in np.asarray(rows)]


def _agree(mine, what):
    """Raises the same error in every process if their texts differ (a collective)."""
    texts = _gathered(mine)
    if len(set(texts)) == 1:
        return
    listed = "\n  ".join(f"process {i}: {text[:2048]}" for i, text in enumerate(texts))
    raise ValueError(f"fit: {what}:\n  {listed}\nEvery process must pass the same arrays (x, y) "
                     f"with the global batch_size (fit takes each process's share), or feed the "
                     f"same number of batches of the same shapes (its share of each global "
                     f"batch), else the run hangs in a collective or trains on mismatched arrays.")


_SIGNALS = ("SIGINT", "SIGTERM", "preemption")  # stops that a resume goes on from


class _Signals:
    """Why the run must stop. Ctrl-C or SIGTERM stops after the step with a checkpoint, resumably;
    SIGTERM then exits 143, a second Ctrl-C aborts at once. One after the last step: SIGTERM exits
    143, Ctrl-C raises KeyboardInterrupt, once the final checkpoint is committed. Off the main
    thread fit cannot catch signals (it warns). With several processes JAX's preemption notifier
    owns SIGTERM (one step for all) and takes Ctrl-C; without it, Ctrl-C on one process stops all
    at the next log point."""

    def __init__(self):
        self.reason, self.asked, self.previous, self.forwarded = None, None, {}, False

    def __enter__(self):
        sigs = [signal.SIGINT] + ([signal.SIGTERM] if jax.process_count() == 1 else [])
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("fit: called off the main thread, where Python lets no code catch "
                          "signals: Ctrl-C and SIGTERM cannot stop this run with a checkpoint "
                          "(resume=True goes on from its last one).", stacklevel=3)
            return self
        self.previous = {sig: signal.signal(sig, self._handle) for sig in sigs}
        return self

    def _handle(self, sig, frame):
        if (self.reason or self.asked or self.forwarded) and sig == signal.SIGINT:
            raise KeyboardInterrupt
        # With several processes, one stopping alone would leave the others in a collective.
        if jax.process_count() == 1:
            self.reason = signal.Signals(sig).name
        elif jax.config.jax_enable_preemption_service:  # it picks one step for all
            self.forwarded = True
            signal.raise_signal(signal.SIGTERM)
        else:  # asked of every process at the next log point (_Loop.poll)
            self.asked = signal.Signals(sig).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def honour(stopping, late):
        """After the run is closed: SIGTERM or preemption (a stop's, or one `late`, after the last
        step) exits 143, what schedulers expect; a late Ctrl-C stops the script."""
        if stopping in ("SIGTERM", "preemption") or late in ("SIGTERM", "preemption"):
            raise SystemExit(128 + signal.SIGTERM)
        if late == "SIGINT" and stopping not in _SIGNALS:
            raise KeyboardInterrupt


# -- Small helpers ---------------------------------------------------------------------------------

def _mean(name, total, weight, who, where):
    """A metric's exact value over many batches: the sum of its totals over their weights."""
    if math.isnan(weight):
        raise ValueError(f"fit: metric {name!r} of {who} has a negative weight in {where}; a "
                         f"Weighted(total, weight) needs weight >= 0 (e.g. a count of tokens).")
    if not weight:
        raise ValueError(f"fit: metric {name!r} of {who} has a total weight of 0 over {where} "
                         f"(all padding?), so it has no value; give it real examples.")
    return total / weight


def _path_name(path):
    """A tree path as `params/Dense_0/kernel`."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _lr_in(tree):
    """The learning rates that `optax.inject_hyperparams` keeps in an optimizer state: one as
    `{"": lr}`, several (`optax.multi_transform`) by their labels (else paths); none: `{}`."""
    is_array = lambda path, value: isinstance(value, (jax.Array, np.ndarray))
    try:
        found = optax.tree.get_all_with_path(tree, "learning_rate", filtering=is_array)
    except Exception:  # (a state optax cannot search: no rate to log)
        return {}
    if len(found) == 1:
        return {"": found[0][1]}
    label = lambda path: [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)
                          and k.key not in ("hyperparams", "learning_rate")][-1:]
    labels = ["".join(label(path)) or _path_name(path[:-2]) for path, _ in found]
    if len(set(labels)) < len(labels):
        labels = [_path_name(path[:-2]) for path, _ in found]
    return dict(zip(labels, [value for _, value in found]))


def _is_nnx_state(state):
    """Whether a TrainState is an nnx model's, as `_adapt` makes it (no apply_fn)."""
    return getattr(state, "apply_fn", True) is None


def _is_nnx(x):
    nnx = sys.modules.get("flax.nnx")  # (no import: it costs runs without nnx ~0.3 s, ~9 MB)
    return nnx is not None and isinstance(x, nnx.Module)


def _is_key(x):
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _verbosity(verbose):
    """0 on processes other than 0; TQDM_DISABLE=1 (tqdm's own switch) turns 1 into 2."""
    if jax.process_index() != 0:
        return 0
    tqdm_off = os.environ.get("TQDM_DISABLE", "").lower() not in ("", "0", "false")
    return 2 if verbose == 1 and tqdm_off else verbose


def _name(fn):
    return getattr(fn, "__name__", type(fn).__name__)


def _itself(x, *_):
    return x


def _say(verbose, message):
    if verbose:
        tqdm.write(message)


def _jsonable(tree):
    as_json = lambda o: o.tolist() if hasattr(o, "tolist") else str(o)  # numpy values; the rest
    return json.loads(json.dumps(tree, default=as_json))


# ==============================================================================================
# Guards. The story of a run ends above. What follows checks, advises and refuses, and is called
# only from the lines named here (tests/test_shape.py holds the file to it), so a reader may skip
# it:
#   fit: _check_state, _check_data, _check_plan, _check_schedule
#   _adapt: _nnx_optimizer, _nnx_fits, _check_frozen
#   _Loop: _check_first_eval
#   _new_steps, _jit_eval, _train_and_accumulate: _trace, _metric_names, _per_example, _warn_dtypes
#   _new_steps: _check_accum
#   _gathered_forward: _check_outputs
#   _Checkpoints: _claim_run, _quiet, _cause
#   _meta, _restore, _restore_weights: _restoring, _unrestorable, _check_fits
#   _restore_all: _check_base
# ==============================================================================================
# -- Checks before any directory or compile: the state, the data, the plan -------------------------

def _check_state(state, opts):
    if not (opts.train_step or opts.loss_fn or opts.nnx_loss_fn):
        raise ValueError("fit: pass loss_fn(outputs, targets)" + (
            " or nnx_loss_fn(model, batch, rngs)." if _is_nnx(state) else
            " (or your own train_step)."))
    if _is_nnx(state):
        for name in ("train_step", "axis_name"):
            if getattr(opts, name) is not None:
                raise ValueError(f"fit: {name}= is for TrainState runs; an nnx model trains with "
                                 f"loss_fn(model(inputs), targets) or nnx_loss_fn(model, batch, "
                                 f"rngs), and eval_step(model, batch).")
    elif _is_nnx(getattr(state, "model", None)):  # e.g. an nnx.ModelAndOptimizer
        raise ValueError(f"fit: state is a {type(state).__name__}, which holds the model and its "
                         f"optimizer; pass them apart: fit(state.model, ..., optimizer=state).")
    elif opts.optimizer is not None or opts.nnx_loss_fn is not None:
        name = "optimizer" if opts.optimizer is not None else "nnx_loss_fn"
        raise ValueError(f"fit: {name}= is for nnx models; a TrainState carries its own "
                         f"optimizer (tx), and fit calls loss_fn(outputs, targets) for it.")
    elif getattr(state, "tx", None) is None or not hasattr(state, "apply_gradients"):
        raise ValueError(f"fit: state must be a TrainState with an optimizer (tx), got "
                         f"{type(state).__name__} with tx={getattr(state, 'tx', None)!r}; build "
                         f"it with TrainState.create(apply_fn=..., params=..., tx=optax.adam"
                         f"(...)), or pass an nnx model with optimizer=nnx.Optimizer(...).")


def _nnx_optimizer(optimizer, who):
    """An nnx model's optimizer, checked (none needed for `evaluate` or weights alone)."""
    if optimizer is None and who == "evaluate":  # (or load_ckpt's weights only)
        from flax import nnx
        return types.SimpleNamespace(tx=None, opt_state=None, step=np.int32(0), wrt=nnx.Param)
    missing = [a for a in ("tx", "opt_state", "step", "wrt") if not hasattr(optimizer, a)]
    if missing:  # (not the object's repr: an optimizer's repr prints the whole model)
        got = "None" if optimizer is None else f"{type(optimizer).__name__} (no {missing})"
        raise TypeError(f"{who}: an nnx model needs optimizer=nnx.Optimizer(model, tx, "
                        f"wrt=nnx.Param), got optimizer={got}.")
    return optimizer


def _nnx_fits(state, who):
    """The nnx optimizer's state must fit the model's parameters it trains."""
    try:
        if state.tx is not None:
            jax.eval_shape(state.tx.update, state.params, state.opt_state, state.params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{who}: the optimizer's state does not fit the model's parameters; "
                         f"build it from this model: nnx.Optimizer(model, tx, wrt=nnx.Param). "
                         f"({e})") from None


def _check_data(train_data, eval_data, opts, mesh):
    """The batching, and that every process feeds the same batches' count and shapes (else a
    collective hangs): every process compares the same table, once, and raises the same error."""
    if opts.batch_size is not None and not any(d.arrays for d in (train_data, *eval_data.values())):
        raise ValueError(f"fit: batch_size={opts.batch_size} is only for array data, a tuple (x, "
                         f"y), but train_ds and test_ds yield their own batches (a list is "
                         f"batches); drop batch_size, or pass the arrays as a tuple (x, y).")
    n, d = train_data.batch_size, _local_shards(mesh, _batch_axes(opts))
    if train_data.arrays:  # (said in global numbers: batch_size is the global batch)
        n, d = train_data.global_batch, d * train_data.share[1]
    if n % d:
        raise ValueError(f"fit: the train batch size ({n}) must be divisible by the number of "
                         f"devices its rows split over ({d}, on the batch_axes "
                         f"{_batch_axes(opts)}); use {n - n % d or d} or {n + d - n % d}. (Only "
                         f"a smaller last batch may split unevenly: it runs whole on every "
                         f"device.)")
    if n % (d * opts.grad_accum):
        k = opts.grad_accum
        raise ValueError(f"fit: grad_accum={k} splits each device's rows into {k} equal "
                         f"microbatches, but the train batch size ({n}) gives {d} device(s) "
                         f"{n // d} rows each; use a batch size divisible by devices x grad_accum "
                         f"= {d * k}, e.g. {n + d * k - n % (d * k)}.")
    if jax.process_count() > 1 and train_data.length is None and not (
            opts.steps_per_epoch or opts.max_steps):
        raise ValueError("fit: with several processes, a train_ds without len() (a generator) "
                         "needs steps_per_epoch= or max_steps=, so all run the same steps.")
    if jax.process_count() > 1:
        _agree("; ".join(d.describe() for d in (train_data, *eval_data.values())),
               "the processes' data disagree")


def _check_plan(opts, train_data, eval_data, total):
    """Raises for a one-shot iterator (a generator) that the run would read more than once."""
    if train_data.stream and opts.num_epochs > 1 and not opts.steps_per_epoch:
        raise ValueError(f"fit: train_ds is a one-shot iterator (a generator), read only once, "
                         f"but num_epochs={opts.num_epochs}; pass a re-iterable (a list, a loader,"
                         f" arrays (x, y) with batch_size=), steps_per_epoch= to take that many "
                         f"batches of the stream each epoch, or max_steps= for an endless one.")
    evals = (math.ceil(total / opts.eval_every) if total else 2) if opts.eval_every else \
        math.ceil(opts.num_epochs / opts.eval_freq)
    reads = evals * (1 + bool(opts.eval_metrics))  # (eval_metrics read a set again)
    for test in eval_data.values():
        if test.stream and reads > 1:
            raise ValueError(f"fit: {test.name} is a one-shot iterator (a generator), read only "
                             f"once, but this run reads it about {reads} times (evals, "
                             f"eval_metrics); pass a re-iterable (a list, a loader, arrays (x, y) "
                             f"with batch_size=).")


def _check_schedule(state, opts, end):
    """Warns for a learning rate that, over the run's steps from the state's to `end`, reaches
    its final value before half of them and stays near 0 after (a schedule built with the wrong
    steps_per_epoch: `len((x, y))` is 2), or is 0 throughout (a spent schedule, in a new run from
    a loaded state). Each rate that `optax.inject_hyperparams` keeps, or `lr_fn`."""
    start = int(jax.device_get(state.step))
    if jax.process_index() != 0 or not end or end - start < 4 or not (
            opts.lr_fn or _lr_in(state.opt_state)):
        return
    steps = np.linspace(start, end - 1, 65).astype(np.int32)
    is_schedule = lambda x: type(x).__name__ == "WrappedScheduleState"

    # An inject_hyperparams schedule's lrs at `step`: with no public call for it, the count of each
    # schedule's state (found by class name) is set, and one update run, of scalar params laid
    # out as the state's (multi_transform's labels are a tree like them).
    tiny = jax.tree.map(lambda x: np.zeros((), x.dtype), state.params)

    def scheduled(step):
        s = jax.tree.map(lambda x: x._replace(count=step) if is_schedule(x) else x,
                         state.tx.init(tiny), is_leaf=is_schedule)
        return _lr_in(state.tx.update(tiny, s, tiny)[1])
    try:
        found = jax.jit(jax.vmap(opts.lr_fn or scheduled))(steps)
    except Exception:  # no schedule that fit can see: nothing to say
        return
    for label, lrs in (found.items() if isinstance(found, dict) else [("", found)]):
        lrs, which = np.asarray(lrs, np.float64), f" ({label})" if label else ""
        moving = np.flatnonzero(lrs != lrs[-1])
        if not len(moving) and lrs[-1] == 0:
            warnings.warn(f"fit: the learning rate{which} is 0 at every step of this run, steps "
                          f"{start} to {end}: its schedule is spent (a state loaded at step "
                          f"{start}?). Build the optimizer with a schedule for these steps, e.g. "
                          f"lr_schedule(..., continue_from=...).", stacklevel=3)
        if not len(moving) or abs(lrs[-1]) > 0.01 * np.abs(lrs).max():
            continue
        final = int(steps[moving[-1] + 1])
        if final < (start + end) / 2:
            warnings.warn(f"fit: the learning-rate schedule{which} reaches its final value "
                          f"{lrs[-1]:.3g} at about step {final}, but this run trains steps "
                          f"{start} to {end}. Was it built for this run (e.g. lr_schedule("
                          f"steps_per_epoch=...): array data gives ceil(len(x) / batch_size) "
                          f"steps per epoch)?", stacklevel=3)


# -- Advice: your functions checked as they are traced ---------------------------------------------

def _trace(fn, state, spec, config, fit_calls=False):
    """`fn(state, batch)`'s output shapes: checks your functions before any compile or directory,
    turning cryptic failures into advice (`fit_calls`: "train" or "eval" where fit calls the
    model, so that your own function may call it instead)."""
    try:
        return jax.eval_shape(fn, state, spec)
    except NameError as e:
        axis = (re.findall(r"unbound axis name: ([\w-]+)", str(e)) or [None])[0]
        if not axis:
            raise
        raise ValueError(f"fit: the model uses the named axis {axis!r} (e.g. BatchNorm(axis_name="
                         f"{axis!r}), written for pmap), which plain jit does not bind; pass "
                         f"axis_name={axis!r} to fit to run the step per device over it.") from None
    except TypeError as e:  # (Python names the method: "MLP.__call__() missing 1 required")
        train = "unexpected keyword argument 'train'" in str(e)
        if not fit_calls or not (train or "__call__() missing" in str(e)):
            raise
        fix = (f"eval_step({'state' if config.linen else 'model'}, batch)" if fit_calls == "eval"
               else "train_step(state, batch) -> (state, metrics) and eval_step(state, batch)"
               if config.linen else "nnx_loss_fn(model, batch, rngs) and eval_step(model, batch)")
        what = ("does not take train=, which fit passes" if train else
                "needs arguments that fit does not pass")
        raise TypeError(f"fit: the model {what} when it calls the model itself ({e}). Pass your "
                        f"own {fix} to call it your way; see README.md.") from None
    except ValueError as e:  # an nnx Dropout without rngs of its own, called with none
        if config.loss_name == "nnx_loss_fn" or "no `rngs` argument" not in str(e):
            raise
        raise ValueError(f"fit: {str(e).splitlines()[0]}: the model takes rngs at call time; "
                         f"call it yourself with nnx_loss_fn(model, batch, rngs), see README.md "
                         f"(NNX models).") from None
    except flax.errors.ScopeCollectionNotFound as e:
        if "batch_stats" not in str(e) or hasattr(state, "batch_stats"):
            raise
        name = type(state).__name__
        raise TypeError(f"fit: the model has BatchNorm statistics, but {name} has no batch_stats "
                        f"field to keep them in; add one (class MyState({name}): batch_stats: "
                        f"Any = None, then MyState.create(..., batch_stats=variables["
                        f"'batch_stats'])), or use fit.TrainState.") from None


def _metric_names(metrics, who, default):
    """The names of a step's metrics, from their shapes (jax.eval_shape): each must be a scalar."""
    for name, value in _as_dict(metrics, default).items():
        for part in value if isinstance(value, (Weighted, Total)) else [value]:
            if getattr(part, "shape", ()) != () or not jnp.issubdtype(part.dtype, jnp.number):
                raise TypeError(f"fit: {who} must return scalar metrics (per-batch means or "
                                f"Weighted(total, weight) of scalars), but metric {name!r} has "
                                f"shape {part.shape} and dtype {part.dtype}; reduce it with "
                                f".mean() or .sum().")
    return list(_as_dict(metrics, default))


def _per_example(fn, state, spec, arrays, who):
    """Refuses an array metric whose shape follows the batch's rows (a value per example, where
    a mean or counts were meant): traced again at twice the rows, its shape must not change."""
    if not arrays:
        return
    double = jax.tree.map(lambda s: jax.ShapeDtypeStruct((2 * s.shape[0], *s.shape[1:]),
                                                         s.dtype), spec)
    try:
        again = _as_dict(jax.eval_shape(fn, state, double), "accuracy")
    except Exception:  # (a model of one batch size: it cannot tell)
        return
    for name, value in arrays.items():
        if jax.tree.map(np.shape, again[name]) != jax.tree.map(np.shape, value):
            shape, rows = jax.tree.leaves(value)[0].shape, jax.tree.leaves(spec)[0].shape[0]
            raise TypeError(f"fit: {who} must return per-batch means (scalars), Weighted, arrays "
                            f"of counts whose shape does not follow the batch (a confusion "
                            f"matrix) or metric states, but {name!r} has shape {shape} for a "
                            f"batch of {rows} rows: a value per example; reduce it with .mean() "
                            f"or .sum().")


def _warn_dtypes(new, old):
    """At trace time: a step that changes a leaf's dtype (bf16 params from a float32 state) gets
    its leaves cast back, silently but for this warning."""
    changed = [(jax.tree_util.keystr(path), n.dtype, o.dtype) for (path, n), o in zip(
        jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old)) if n.dtype != o.dtype]
    if changed:
        path, new_dtype, old_dtype = changed[0]
        warnings.warn(f"fit: the train step changes the dtype of {len(changed)} state leaves "
                      f"(e.g. {path}: {new_dtype}, where the state holds {old_dtype}); fit casts "
                      f"them back. Build the state in the dtype to keep; for mixed precision "
                      f"cast inside apply_fn or the model (or in fit's _gradient_step).")


def _check_frozen(after, before):
    """At trace time: a step that changes an nnx.Param of the frozen base (outside the optimizer's
    `wrt`, left unchanged by the loss traced on the first batch: `_frozen_base`) raises, naming
    it: fit passes the base to every step and would not keep the change."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(after), jax.tree.leaves(before)):
        if a is not b:
            raise ValueError(f"fit: the step changes {_path_name(path)}, an nnx.Param outside "
                             f"the optimizer's wrt that the loss left unchanged on the first "
                             f"batch, so fit holds it as a frozen base and would not keep the "
                             f"change; make it another nnx.Variable type (as BatchStat), or "
                             f"train it (wrt).")


def _check_first_eval(plan, eval_sums, metrics, verbose):
    """At a call's first eval: every scalar metric is one the plan knew (a metric added in fit's
    eval code must be named in `_EvalSums.names` too: the monitor is checked against those before
    any work); a bare number `eval_step` returns, named `accuracy`, is said with its mode where it
    is the monitor, and one outside [0, 1] is warned about: a loss returned bare would keep the
    worst model as the best."""
    parts = ("eval", "eval_ema")
    known = {_metric_tag(part, name, n) for name, names in plan.eval_names.items()
             for n in names for part in parts}
    vague = [_metric_tag(part, name, "") for name, sums in eval_sums.items() for part in parts
             if sums.states or sums.host]  # (a state's compute() keys: known when it runs)
    unknown = sorted(t for t in set(metrics) - known if not t.startswith(tuple(vague)))
    if unknown:
        raise ValueError(f"fit: the eval gave {unknown}, which the plan does not know (a metric "
                         f"added in fit's eval code): add its name to _EvalSums.names, where "
                         f"the monitor is checked before any work.")
    for name, sums in eval_sums.items():
        tag = _metric_tag("eval", name, "accuracy")
        if not sums.bare or tag not in metrics:
            continue
        if tag == plan.monitor:
            _say(verbose, f"fit: eval_step returns a bare number, logged as {tag}: the best "
                          f"checkpoint is its {'maximum' if plan.mode == 'max' else 'minimum'}.")
        if not 0 <= metrics[tag] <= 1:
            warnings.warn(f"fit: eval_step returns a bare number, which fit logs as {tag} (an "
                          f"accuracy: the best is its maximum), but it is {metrics[tag]:.4g}, "
                          f"outside [0, 1]. If it is a loss, return {{'loss': x}} (the best is "
                          f"then its minimum); a percentage is fine as it is.", stacklevel=2)


def _check_outputs(outputs, whole, rows):
    """At trace time, grad_accum_mode="outputs": each leaf of the model's outputs has the rows as
    its leading axis, or the same shape for any rows (a logit scale), so that `_gathered_forward`
    can join the microbatches' (`outputs`, stacked) as the whole batch's (`whole`, its shapes)."""
    for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(outputs), jax.tree.leaves(whole)):
        if a.shape[1:] != w.shape and (a.ndim < 2 or w.shape != (a.shape[0] * a.shape[1],
                                                                 *a.shape[2:])):
            raise TypeError(f"fit: grad_accum_mode='outputs' joins the model's outputs of "
                            f"microbatches, but output {_path_name(path) or '(the whole)'} has "
                            f"shape {a.shape[1:]} for a microbatch of {rows} rows and {w.shape} "
                            f"for the batch: the rows must be its leading axis (or absent, as a "
                            f"logit scale's). A model that couples the rows itself (a similarity "
                            f"matrix) cannot be split: compute that in loss_fn.")


_COUPLED = 1e-2  # _coupled's bound on the gradient's relative change (rounding: ~1e-7)
_QUICK = {"xla_backend_optimization_level": 0, "xla_gpu_autotune_level": 0}  # (XLA's options)


def _check_accum(gap, config, state, batch, frozen=None):
    """At the first step of grad_accum's default mode, once a call (not in the compiled step, which
    stays as it was): whether the loss couples the rows of a batch, whose microbatches would each
    see only their own rows (`_accum_gap`). Traced here; compiled in a thread, beside the first
    step's compile (at XLA's lowest optimisation: it runs once); the returned function runs it and
    raises, before the first update. Costs that compile, and a run of two eval-mode gradients of
    a microbatch's worth of rows."""
    args, compiled = (_joined(state, frozen), batch), []
    lowered = gap.lower(*args)

    def compile():  # (~2.5x faster than at the default level, on a CPU)
        with contextlib.suppress(Exception):
            compiled.append(lowered.compile(_QUICK))
    thread = threading.Thread(target=compile)
    thread.start()

    def check():
        thread.join()  # (a compile that failed there: again here, in the open)
        values = jax.device_get((compiled[0] if compiled else gap)(*args))
        _coupled(*(float(v) for v in values), config)
    return check


def _coupled(gap, whole, parts, config):
    if not gap > _COUPLED:  # (NaN, a zero gradient: nothing to tell)
        return
    name, k = config.loss_name, config.grad_accum
    fix = ("grad_accum_mode='outputs' (loss_fn taken once, on the whole batch's outputs)" if
           name == "loss_fn" else "loss_fn(outputs, targets) with grad_accum_mode='outputs'")
    raise ValueError(f"fit: with grad_accum={k} each microbatch's loss sees only its own rows, "
                     f"but {name} couples the rows of a batch (a contrastive loss, a mean over "
                     f"the batch's tokens): the update would be a smaller batch's. On the first "
                     f"batch's first and last rows, a microbatch's worth (the model in eval "
                     f"mode), their gradient as two microbatches is {gap:.1%} of its norm away "
                     f"from their gradient as one (losses {parts:.4g} and {whole:.4g}). Use "
                     f"{fix}; for a mean over tokens, Weighted(total, count); or a bigger batch "
                     f"per device with grad_accum=1.")


# -- The run's claim and lock ----------------------------------------------------------------------

def _claim_run(workdir, log_name, resume, claim=True, *, store=None):
    """`(name, whether it has a checkpoint, the lock)` of the run picked: a fresh run the next free
    `<log_name>_<n>`, `resume=True` the highest n, `resume="<name>"` that one. Process 0 claims;
    the others get its answer or its refusal. `store`: a bucket's `_Bucket`."""
    answer, lock = ["", False, None, ""], None
    if jax.process_index() == 0:
        try:
            name, restored, lock = _claim(workdir, log_name, resume, claim, store)
            answer = [name, restored, None, ""]
        except (ValueError, RuntimeError) as e:
            answer = ["", False, type(e).__name__, str(e)]
    name, restored, error, message = (_gathered(answer) or [answer])[0]  # (process 0's, for all)
    if error:
        raise (RuntimeError if error == "RuntimeError" else ValueError)(message)
    return name, restored, lock


def _claim(workdir, log_name, resume, claim=True, store=None):
    """A fresh run claims its directory with an exclusive mkdir (two processes started at once get
    two runs); every run then holds an advisory lock: a second writer is refused, and a writer that
    dies releases it (the kernel drops its locks). `claim=False` (past the end) makes nothing. In a
    bucket (`store`): an object created only if absent (`_made`), and a lease (`_Lease`)."""
    root = os.path.join(workdir, "checkpoints")
    listed = lambda path: os.listdir(path) if os.path.isdir(path) else []
    lock = _lock
    if store is not None:
        listed, lock = store.listdir, functools.partial(_Lease, store)
    runs = sorted(set(listed(os.path.join(workdir, "logs")) + listed(root)))
    has_steps = lambda run: any(d.isdigit() for d in listed(os.path.join(root, run)))
    if isinstance(resume, str):  # (processes see one shared workdir, as orbax needs)
        if resume not in runs:
            raise ValueError(f"fit: resume={resume!r} is not a run in {workdir}; its runs: "
                             f"{runs or 'none'}. Pass one of them, or resume=True for the latest.")
        return resume, has_steps(resume), lock(os.path.join(root, resume))
    taken = [int(m.group(1)) for m in map(re.compile(re.escape(log_name) + r"_(\d+)").fullmatch,
                                          runs) if m]
    if resume and taken:  # the latest run: from its checkpoint, or afresh if it saved none
        name = f"{log_name}_{max(taken)}"
        try:
            return name, has_steps(name), lock(os.path.join(root, name))
        except RuntimeError:
            if has_steps(name):
                raise
            # (a fresh run started at the same moment holds it, with nothing to go on from:
            # sweep members that all pass resume=True get a run each, as fresh runs do)
    n = max(taken, default=0)
    if not claim:
        return f"{log_name}_{n + 1}", False, None
    while True:  # the next n that no other process has claimed meanwhile
        n += 1
        run_dir = os.path.join(root, f"{log_name}_{n}")
        if _made(run_dir, store):
            with contextlib.suppress(RuntimeError):  # (a resume of it, started at once, won)
                return f"{log_name}_{n}", False, lock(run_dir)


def _made(run_dir, store=None):
    """Whether this process made `run_dir`, by an exclusive mkdir; in a bucket (`store`), by its
    object `fit.run` created only if absent, kept as a directory is (the lock's come and go)."""
    if store is not None:
        return store.create(os.path.join(run_dir, "fit.run"), "")
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    try:
        os.mkdir(run_dir)
        return True
    except FileExistsError:
        return False


def _lock(run_dir):
    """An advisory lock on `<run_dir>/fit.lock`, held until fit closes it; it names its holder.
    (`flock` holds on local disks and NFS; object-store mounts such as gcsfuse ignore it.)"""
    if fcntl is None:  # (Windows: no lock)
        return None
    os.makedirs(run_dir, exist_ok=True)
    lock = open(os.path.join(run_dir, "fit.lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        run = os.path.basename(run_dir)
        raise RuntimeError(f"fit: run {run} is being written by {holder}, which holds "
                           f"{os.path.join(run_dir, 'fit.lock')}; two writers would overwrite "
                           f"each other's checkpoints. Wait for it to end, or give each member "
                           f"of a sweep its own log_name (or resume=\"<run name>\").") from None
    lock.truncate(0)
    lock.write(f"host {socket.gethostname()}, pid {os.getpid()}")
    lock.flush()
    return lock


_LEASE_S = 60.0  # seconds a run's lock in a bucket lives unrenewed (renewed every quarter of it)


class _Lease:
    """The run's lock in a bucket, which has no flock: a chain of objects `fit.lock.<k>`, each
    created only if absent, so of two writers after the same k one wins. The holder renews it
    every `_LEASE_S / 4` s by creating k + 1 (a thread) and frees it at close with an empty one.
    A second writer is refused once it has seen the chain move on, as flock refuses it; a lock
    not renewed for `_LEASE_S` s is a dead holder's, and taken over (so a killed run's resume
    waits up to that long). A holder that could not renew in time has `lost` it: its next save
    raises."""

    def __init__(self, bucket, run_dir):
        self.bucket, self.dir, self.lost = bucket, run_dir, None
        self.holder = f"host {socket.gethostname()}, pid {os.getpid()}"
        self.k = self._take()
        self.renewed, self.done = time.monotonic(), threading.Event()
        self.thread = threading.Thread(target=self._renew, daemon=True)
        self.thread.start()

    def _path(self, k):
        return os.path.join(self.dir, f"fit.lock.{k}")

    def _take(self):
        """The next k once the newest lock is free or its holder's lease has run out."""
        seen, number = None, re.compile(r"fit\.lock\.(\d+)").fullmatch
        while True:
            chain = [int(m.group(1)) for m in map(number, self.bucket.listdir(self.dir)) if m]
            k = max(chain, default=0)
            holder, age = "", None
            if k:
                with contextlib.suppress(FileNotFoundError):
                    holder, age = self.bucket.read(self._path(k)), self.bucket.age(self._path(k))
                if age is None:
                    continue  # (renewed and cleared meanwhile: look again)
            if not holder or age > _LEASE_S:
                if self.bucket.create(self._path(k + 1), self.holder):
                    for old in chain:  # (the earlier holders' objects)
                        self.bucket.remove(self._path(old))
                    return k + 1
            elif seen not in (None, k):  # renewed while this process waited: a live writer
                raise RuntimeError(f"fit: run {os.path.basename(self.dir)} is being written by "
                                   f"{holder}, which holds {self._path(k)} (renewed "
                                   f"{age:.0f} s ago); two writers would overwrite each other's "
                                   f"checkpoints. Wait for it to end (a dead writer's lock runs "
                                   f"out {_LEASE_S:.0f} s after it last renewed it), or give each "
                                   f"member of a sweep its own log_name (or resume=\"<run "
                                   f"name>\").")
            else:  # wait to see it renewed (live) or run out (dead)
                if seen is None:
                    print(f"fit: run {os.path.basename(self.dir)} is locked by {holder}, renewed "
                          f"{age:.0f} s ago; waiting to see it renewed (a live writer: refused) or "
                          f"run out (a dead one: taken over, at most {_LEASE_S:.0f} s).",
                          file=sys.stderr)
                seen = k
                time.sleep(min(_LEASE_S / 3, _LEASE_S - age) + 0.1)

    def _renew(self):
        while not self.done.wait(_LEASE_S / 4):
            try:
                if not self.bucket.create(self._path(self.k + 1), self.holder):
                    break  # taken over: this process was silent for too long
                self.k, self.renewed = self.k + 1, time.monotonic()
                self.bucket.remove(self._path(self.k - 2))
            except Exception:  # (the store out of reach: tried again until the lease runs out)
                if time.monotonic() - self.renewed > _LEASE_S:
                    break
        if not self.done.is_set():
            self.lost = (f"fit: this process lost run {os.path.basename(self.dir)}'s lock "
                         f"{self._path(self.k)}: it could not renew it for {_LEASE_S:.0f} s, and "
                         f"another writer may hold it now; the checkpoint is not saved, so as not "
                         f"to overwrite theirs. Call fit again with resume=True.")

    def close(self):
        self.done.set()
        self.thread.join()
        if self.lost is None:  # free for the next writer at once (if this fails: in _LEASE_S)
            with contextlib.suppress(Exception):
                self.bucket.create(self._path(self.k + 1), "")
                self.bucket.remove(self._path(self.k - 1))
                self.bucket.remove(self._path(self.k))


# -- Checkpoints that do not fit or are damaged; failed saves --------------------------------------

def _check_fits(stored, wanted, where):
    """Raises, naming each leaf, if a checkpoint's `stored` shapes (by path) differ from the state's
    (`wanted`): orbax's own errors do not name the parameter whose shape differs."""
    problems = ([f"{k}: in the checkpoint, not in the state" for k in stored.keys() - wanted]
                + [f"{k}: in the state, not in the checkpoint" for k in wanted.keys() - stored]
                + [f"{k}: shape {stored[k]} in the checkpoint, {wanted[k]} in the state"
                   for k in stored.keys() & wanted if stored[k] != wanted[k]])
    if problems:
        listed = "\n  ".join(sorted(problems)[:12]) + ("\n  ..." if len(problems) > 12 else "")
        raise ValueError(f"{where} does not fit this state ({len(problems)} differences):\n  "
                         f"{listed}\nUse the model and optimizer of the run that wrote it, or "
                         f"start a fresh run (resume=False or another log_name).")


def _check_base(saved, frozen, where):
    """Raises, naming the first path that differs, if the model's frozen base is not the one
    whose fingerprint a run saved (`save_frozen=False`)."""
    mine = _fingerprint(frozen)
    for path in sorted({*saved, *mine}):
        if saved.get(path) != mine.get(path):
            raise ValueError(f"{where} was saved without its frozen base (save_frozen=False), and "
                             f"the model's base differs from that run's at {path}: "
                             f"{mine.get(path)} here, {saved.get(path)} there ([shape, dtype, "
                             f"checksum]); pass the model with the run's base.")


@contextlib.contextmanager
def _restoring(mgr, step, who):
    """Any failure to read a checkpoint (truncated file, missing item, half a JSON) as one error."""
    try:
        yield
    except Exception as e:
        raise _unrestorable(mgr, step, e, who) from None


def _unrestorable(mgr, step, error, who):
    """The error for a damaged checkpoint: its step, the cause, the earlier steps, how to go on."""
    path = os.path.join(str(mgr.directory), str(step))
    earlier = sorted(s for s in mgr.all_steps() if s < step)
    mv = "gcloud storage mv" if _is_url(path) else "mv"  # (a bucket's "directory": its objects)
    go_on = (f"The run's earlier checkpoints: steps {earlier}. To go on from step {earlier[-1]}, "
             f"move the damaged one aside ({mv} {path} {path}.damaged), then call fit again with "
             f"resume=True (or load_ckpt(..., step={earlier[-1]}))" if earlier else
             "It is the run's only checkpoint (fit keeps the latest and the max_to_keep best), "
             "so there is none to go back to: start a fresh run")
    return ValueError(f"{who}: the checkpoint of step {step} at {path} is damaged and cannot be "
                      f"restored: {_cause(error)}. {go_on}.")


def _cause(error):
    """An exception and its chain in one line: the first line (at most 200 characters) and an OS
    error named anywhere (orbax says "No space left on device" far past its first line)."""
    chain = []
    while error is not None and len(chain) < 8:
        chain.append(str(error) or type(error).__name__)
        error = error.__cause__ or error.__context__
    whole, line = "\n".join(chain), chain[0].strip().splitlines()[0]
    line = line if len(line) <= 200 else line[:200] + "..."
    found = sorted((whole.find(m), m) for m in map(os.strerror, errno.errorcode) if m in whole)
    return f"{line} ({found[0][1]})" if found and found[0][1] not in line else line


def _quiet(ckpt_dir=None):
    """A log filter hiding orbax's reports of a failure fit raises clearly: its records (while fit
    runs); with `ckpt_dir` (for good), those naming it, which a failed save's other writes send."""
    def quiet(record):
        text = record.pathname if not ckpt_dir else record.getMessage() + (
            "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else "")
        return f"{os.sep}orbax{os.sep}" not in text and not (ckpt_dir and ckpt_dir in text)
    return quiet
