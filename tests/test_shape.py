"""#43, "one training step readable in one sitting": the restructure keeps what it must and holds
fit.py to its shape. Each test names the item it guards:

- the compiled steps are the programs of before #43 (optimized HLO: as many instructions, the
  same ones);
- the guards' banner: the code below it is reached only from the callers it names;
- the shape limits (item 7): lengths of `fit` and of every other function, positional parameters,
  line widths, README.md's length, and code lines no more than before #43;
- facts kept once (item 5): `_Steps`' defaults, `_builtin`, what a checkpoint holds (`_Progress`),
  where `jax.jit` is called, the options' defaults in their docs;
- the pure step `_gradient_step` is the function that trains (an edit of it changes the result);
- annotations on the public API (item 6).
"""
import ast
import dataclasses
import difflib
import inspect
import io
import json
import os
import re
import time
import tokenize
import typing

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import fit
from conftest import CNN, MLP, eval_step, fit_at, flat, loss_fn, make_state
from test_traps import batches, edited_fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE_43 = "95db3d8"  # fit.py before the restructure of #43
COMMON = dict(verbose=0, tensorboard=False)


def _read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


SOURCE = _read("fit.py")
TREE = ast.parse(SOURCE)


def _functions(tree):
    """Every function of a module (top level, methods, nested), lambdas aside."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _top_name(node):
    """The name a top-level statement defines (a def, a class, `name = ...`), else None."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    names = [t.id for t in targets if isinstance(t, ast.Name)]
    return names[0] if names else None


# -- The compiled steps: the same programs as before #43 -------------------------------------------

class PlainCNN(nn.Module):
    """conftest's CNN without BatchNorm and Dropout."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _instructions(compiled):
    """The optimized HLO's instructions (lines with " = ", the module's header aside), their
    metadata (source lines, Python names) left out and their names numbered by first use, so
    equal programs read alike."""
    names = {}
    rename = lambda m: names.setdefault(m.group(0), f"%v{len(names)}")
    return [re.sub(r"%[\w.-]+", rename, re.sub(r", metadata=\{[^}]*\}", "", line))
            for line in compiled.as_text().splitlines()
            if " = " in line and not line.startswith(("HloModule", "//"))]


def _programs(module, model):
    """The instructions of `module`'s compiled train step and eval step, built as fit builds them
    (`_StepConfig`, `_build_steps`), on one device."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    var = model.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32), train=False)
    state = module.TrainState.create(apply_fn=model.apply, params=var["params"],
                                     batch_stats=var.get("batch_stats", {}), tx=optax.adam(1e-3))
    x = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32)
    y = (np.arange(64) % 10).astype(np.int32)
    opts = module.Options(loss_fn=loss_fn, eval_step=eval_step, batch_size=32)
    state = module._place_state(state, 0, module.NamedSharding(mesh, module.P()))
    train = module._Data((x, y), "train_ds", opts, train=True)
    tests = module._eval_sets((x, y), "test_ds", opts)
    config = module._StepConfig.of(opts, module._linen_forward, eval_step, mesh, linen=True)
    module._STEPS.clear()
    steps = module._build_steps(state, train, tests, config, mesh)
    batch = module._putter(mesh, "data")((x[:32], y[:32]))
    evals = steps.evals if hasattr(steps, "evals") else steps.eval  # (before #43: `eval`)
    return (_instructions(steps.train.lower(state, steps.acc0, batch).compile()),
            _instructions(evals[None].lower(state, steps.eval0[None], batch).compile()))


@pytest.mark.parametrize("model", [CNN, PlainCNN, MLP], ids=["cnn_bn_dropout", "cnn", "mlp"])
def test_the_compiled_steps_are_the_programs_of_before_43(model, tmp_path, monkeypatch):
    """A restructure moves code, not math: XLA's optimized train and eval steps have as many
    instructions as those of fit.py before #43, and the same ones (names and metadata aside).
    (If a change of the step was intended, say so in its commit and compare with that commit.)"""
    before = fit_at(BEFORE_43, tmp_path, monkeypatch)
    now, then = _programs(fit, model()), _programs(before, model())
    counts = lambda programs: tuple(map(len, programs))
    assert counts(now) == counts(then), f"(train, eval) instructions: {counts(now)} now, " \
                                        f"{counts(then)} before #43"
    for step, a, b in zip(("train", "eval"), now, then):
        diff = [line for line in difflib.unified_diff(b, a, "before #43", "now", lineterm="", n=0)
                if not line.startswith("@@")]
        assert not diff, f"the {step} step's instructions differ:\n" + "\n".join(diff[:12])


# -- The guards' banner ----------------------------------------------------------------------------

def _banner():
    """The line of "# Guards." and its `#   caller, ...: guard, ...` lines, as (callers, guards)."""
    lines = SOURCE.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# Guards."))
    end = next(i for i in range(at, len(lines)) if lines[i].startswith("# ====="))
    groups = [(m.group(1).split(", "), m.group(2).split(", ")) for line in lines[at:end]
              if (m := re.match(r"#   ([\w, ]+): ([\w, ]+)$", line))]
    return at + 1, groups  # (ast's line numbers start at 1)


def _references(node, names):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in names}


def test_code_below_the_guards_banner_is_reached_only_from_the_callers_it_names():
    """Below "# Guards." are only guards, each called from above by the callers the banner names
    (a class's methods are the class's), so a reader of the story may skip them all. Every name
    below is one the banner lists, or a helper of those (reached from a listed one below the
    banner); each name on a banner line has a call on that line, so the banner stays true."""
    line, groups = _banner()
    assert groups, "the banner lists no `#   caller, ...: guard, ...` lines"
    pairs = {}
    for callers, guards in groups:
        for caller in callers:
            pairs.setdefault(caller, set()).update(guards)
    above = [n for n in TREE.body if n.lineno < line]
    below = {_top_name(n): n for n in TREE.body if n.lineno > line and _top_name(n)}
    listed = set().union(*pairs.values())
    unknown = listed - set(below)
    assert not unknown, f"the banner lists {sorted(unknown)}, not defined below it"
    callers = {_top_name(n): n for n in above}
    unknown = set(pairs) - set(callers)
    assert not unknown, f"the banner names callers {sorted(unknown)}, not defined above it"
    unlisted = sorted((_top_name(n), callee, n.lineno) for n in above
                      for callee in _references(n, set(below))
                      if callee not in pairs.get(_top_name(n), ()))
    assert not unlisted, f"(caller, guard, line) above the banner, not in it: {unlisted}"
    # A line `a, b: c, d` says a and b call (some of) c and d: each name on it has a call there.
    calls = {(c, g) for c in pairs for g in _references(callers[c], set(below))}
    stale = sorted({c for cs, gs in groups for c in cs if not any((c, g) in calls for g in gs)} |
                   {g for cs, gs in groups for g in gs if not any((c, g) in calls for c in cs)})
    assert not stale, f"named on a banner line without a call on that line: {stale}"
    reached, todo = set(), list(listed)
    while todo:  # helpers of the listed guards, below the banner too
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += _references(below[name], set(below))
    orphans = sorted(set(below) - reached)
    assert not orphans, f"below the banner, neither listed nor a listed guard's helper: {orphans}"


# -- The shape limits (item 7) ---------------------------------------------------------------------

def test_fit_spans_at_most_100_lines_and_every_other_function_50():
    """From a function's `def` line to its end (nested functions and methods too)."""
    long = [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in _functions(TREE)
            if node.end_lineno - node.lineno + 1 > (100 if node.name == "fit" else 50)]
    assert not long, f"(function, line, lines) too long: {long}"


def test_no_function_has_more_than_5_positional_parameters():
    """Self and cls aside; the public `lr_schedule` has 6 (its arguments read as a schedule)."""
    many = []
    for node in _functions(TREE):
        args = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
        if len(args) > (6 if node.name == "lr_schedule" else 5):
            many.append((node.name, node.lineno, len(args)))
    assert not many, f"(function, line, positional parameters) too many: {many}"


def test_no_line_is_wider_than_100_and_the_readme_is_at_most_300_lines():
    wide = [i + 1 for i, line in enumerate(SOURCE.splitlines()) if len(line) > 100]
    assert not wide, f"fit.py's lines over 100 characters: {wide}"
    readme = len(_read("README.md").splitlines())
    assert readme <= 300, f"README.md has {readme} lines"


def _code_lines(source):
    """Lines that hold a token other than a comment or a docstring (blank lines aside)."""
    tree, docs = ast.parse(source), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0].value, "value", None), str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docs)


# fit.py's code lines, as `_code_lines` counts them: the size accepted so far, each issue's growth
# recorded (a change that needs more raises this limit in its own commit, saying why):
# 2,016 before #39-#43 (5402c9f); 2,502 after them (7711fde; #43's +39 accepted by #48);
# #47 +22 (the frozen base found by a trace, the resume's base); #48 +2 (a best only where asked);
# #52 +69 (step_metrics and Total; the traps' checks: the first eval's names, _Progress's reads);
# #51 +138 (a gs:// workdir: _Bucket, _Lease, the claim by a create-if-absent);
# #50 +108 (grad_accum_mode="outputs": _gathered_forward; the default mode's check, _accum_gap);
# #49 +60 (steps_per_jit="auto": _Data.calls, _steps_per_call, the clock per call); then +20:
# #52's shuffle=, a Total refused outside step_metrics and summed over axis_name's devices; the
# review of the merge: a failed k-step call named (#49), a frozen base held once in #50's scan.
CODE_LINES = 2921


def test_fit_py_stays_within_its_accepted_size():
    """Comments and docstrings aside, fit.py has no more lines than the size accepted so far
    (`CODE_LINES`): growth is a decision, recorded beside the limit, never a drift."""
    now = _code_lines(SOURCE)
    assert now <= CODE_LINES, f"fit.py has {now} code lines, {CODE_LINES} accepted so far"


# -- Facts kept once (item 5) ----------------------------------------------------------------------

def test_steps_defaults_come_from_its_fields():
    """`_Steps` is built by name with any part left out: each field defaults to None, however many
    fields it has."""
    params = inspect.signature(fit._Steps).parameters.values()
    assert [p.name for p in params] == list(fit._Steps._fields)
    assert all(p.default is None for p in params), [p for p in params if p.default is not None]
    assert fit._Steps() == (None,) * len(fit._Steps._fields)


class _SlowBar(fit.ProgressBar):
    """A ProgressBar subclass, so a built-in hook (`fit._builtin`), that sleeps at log points."""

    def __init__(self):
        super().__init__(verbose=0)
        self.events = []

    def __call__(self, event, run):  # (ProgressBar's own drawing left out: no output)
        self.events.append(event)
        if event == "log":
            time.sleep(0.05)


def test_a_progress_bar_subclass_is_built_in_for_time(tmp_path, one_device_mesh):
    """`_builtin(hook)` is the one test: a ProgressBar subclass passed in `hooks=` is fit's own, so
    its time is left out of `hooks_s` (your hooks' time), where a plain function's is in."""
    def slow(event, run):
        if event == "log":
            time.sleep(0.05)

    assert fit._builtin(_SlowBar()) and not fit._builtin(slow)
    bar, data = _SlowBar(), batches(8)
    kwargs = dict(loss_fn=loss_fn, num_epochs=3, log_every=2, mesh=one_device_mesh, **COMMON)
    _, built_in = fit.fit(make_state(MLP()), data, workdir=str(tmp_path / "a"), hooks=[bar],
                          **kwargs)
    _, plain = fit.fit(make_state(MLP()), data, workdir=str(tmp_path / "b"), hooks=[slow],
                       **kwargs)
    logs = bar.events.count("log")
    assert logs >= 12, bar.events
    assert plain.timing["hooks_s"] >= logs * 0.05 - 0.01, plain.timing
    assert built_in.timing.get("hooks_s", 0.0) < 0.1, built_in.timing


def test_a_progress_bar_subclass_is_built_in_for_closing_after_an_error(tmp_path):
    """After a hook raises, the built-in hooks (a ProgressBar subclass too) get `train_end` to
    close their bar and files; your hooks get none."""
    events = []

    def boom(event, run):
        if event == "log":
            raise RuntimeError("boom")

    bar = _SlowBar()
    with pytest.raises(RuntimeError, match="boom"):
        fit.fit(make_state(MLP()), batches(4), loss_fn=loss_fn, log_every=2,
                hooks=[bar, lambda event, run: events.append(event), boom],
                workdir=str(tmp_path), **COMMON)
    assert bar.events[-1] == "train_end" and "log" in bar.events, bar.events
    assert "log" in events and "train_end" not in events, events


def test_progress_names_its_call_and_run_fields_and_a_save_gives_every_other():
    """`_Progress.CALL` and `.RUN` are fields, apart; `saving` takes exactly the rest."""
    fields = {f.name for f in dataclasses.fields(fit._Progress)}
    call, run = set(fit._Progress.CALL), set(fit._Progress.RUN)
    assert call | run <= fields and not call & run, (call, run, fields)
    moving = dict.fromkeys(fields - call - run)
    fit._Progress().saving(**moving)
    for left_out in moving:
        with pytest.raises(TypeError, match=rf"_Progress\.saving.*'{left_out}'"):
            fit._Progress().saving(**{k: v for k, v in moving.items() if k != left_out})


def test_a_new_progress_field_fails_the_first_save_rather_than_being_saved_stale(tmp_path,
                                                                               monkeypatch):
    """A field added to `_Progress` (as a user would add one), read where the run starts but not
    given at the save, raises there, naming it, before any checkpoint is written: it cannot be
    saved with its first value."""
    edited = edited_fit(tmp_path, monkeypatch, ("    CALL, RUN = (",
                                                "    extra: Any = None\n    CALL, RUN = ("),
                        ("        ckpts.progress.check_read()",
                         "        self.extra = ckpts.progress.extra\n"
                         "        ckpts.progress.check_read()"))
    saves = []
    with pytest.raises(TypeError, match=r"_Progress\.saving.*'extra'"):
        edited.fit(edited.TrainState.create(apply_fn=MLP().apply, tx=optax.adam(1e-3),
                                            params=make_state(MLP()).params), batches(4),
                   loss_fn=loss_fn, ckpt_every=2, hooks=[lambda e, run: e == "save" and
                                                         saves.append(run.step)],
                   workdir=str(tmp_path / "w"), **COMMON)
    assert saves == [2], saves  # (its first save)
    ckpts = tmp_path / "w" / "checkpoints"
    steps = [p.name for p in ckpts.glob("*/*") if p.name.isdigit()] if ckpts.exists() else []
    assert not steps, steps


def test_a_checkpoint_meta_holds_every_progress_field(tmp_path):
    """What a checkpoint holds besides the state is `_Progress`, all of it and nothing else."""
    _, history = fit.fit(make_state(MLP()), batches(4), loss_fn=loss_fn,
                         workdir=str(tmp_path), **COMMON)
    mgr = fit._open(history.ckpt_dir, ocp.CheckpointManagerOptions(create=False))
    try:
        meta = fit._meta(mgr, mgr.latest_step(), "test")
    finally:
        mgr.close()
    assert set(meta) == {f.name for f in dataclasses.fields(fit._Progress)}, sorted(meta)


def test_a_new_progress_field_not_read_back_fails_before_any_step(tmp_path, monkeypatch):
    """#52 (T12): a field added to `_Progress` and given at every save, but not read where the run
    starts (as a count of examples seen whose counter started at 0 on resume), raises a TypeError
    naming it before any step, on a fresh run as on a resume. (7711fde saved it and resumed
    without it, silently.)"""
    edited = edited_fit(tmp_path, monkeypatch, ("    CALL, RUN = (",
                                                "    examples: Any = 0\n    CALL, RUN = ("),
                        ("epoch=epoch, position=position, positions=",
                         "examples=0, epoch=epoch, position=position, positions="))
    events = []
    with pytest.raises(TypeError, match=r"_Progress: the fields \['examples'\] are saved at each "
                                        r"checkpoint but not read"):
        edited.fit(edited.TrainState.create(apply_fn=MLP().apply, tx=optax.adam(1e-3),
                                            params=make_state(MLP()).params), batches(4),
                   loss_fn=loss_fn, hooks=[lambda e, run: events.append(e)],
                   workdir=str(tmp_path / "w"), **COMMON)
    assert "log" not in events and "save" not in events, events


# Where fit calls jax.jit outside `_build_steps`' own `_new_steps` and `_jit_eval`: none of these
# is a step of the run (each is a small program of its own, outside the compiled-steps cache).
_JIT_ELSEWHERE = {
    "_take": "module level: gathers the rows of an epoch's batches from arrays on the device",
    "_fingerprint": "the nnx frozen base's checksums, saved instead of the base (save_frozen)",
    "_check_schedule": "a guard: the learning rates of `lr_fn` over the run's steps, checked",
}


def test_every_compiled_step_is_built_in_build_steps():
    """fit's comment and `_build_steps`' docstring say every compiled step is built there: the
    file's `jax.jit`s are in `_new_steps` and `_jit_eval` (which `_build_steps` calls) and in the
    small helpers of `_JIT_ELSEWHERE` only."""
    found = {}
    for node in TREE.body:
        for sub in ast.walk(node):
            jit = isinstance(sub, ast.Attribute) and sub.attr == "jit" and \
                isinstance(sub.value, ast.Name) and sub.value.id == "jax"
            imported = isinstance(sub, ast.ImportFrom) and any(a.name == "jit" for a in sub.names)
            if jit or imported:
                found.setdefault(_top_name(node), []).append(sub.lineno)
    # (equal, not a subset: a helper that no longer calls jax.jit leaves the list too)
    assert set(found) == {"_new_steps", "_jit_eval", *_JIT_ELSEWHERE}, found


def _as_written(value):
    """A default as the docs write it: strings in double quotes (`mode="auto"`)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_as_written, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


_DEFAULTS = [f for f in dataclasses.fields(fit.Options) if f.default is not None]
# Options whose default no entry states yet (strict: once one does, its mark must go):
_NOT_IN_DOCSTRING = (set(), "")
_NOT_IN_REFERENCE = (set(), "")


def _marked(missing, reason):
    return [pytest.param(f, id=f.name, marks=pytest.mark.xfail(strict=True, reason=reason))
            if f.name in missing else pytest.param(f, id=f.name) for f in _DEFAULTS]


@pytest.mark.parametrize("field", _marked(*_NOT_IN_DOCSTRING))
def test_options_docstring_states_each_default(field):
    """Each option with a non-None default has an entry `name=<default>:` in `Options`' docstring,
    its value the field's."""
    entry = f"{field.name}={_as_written(field.default)}:"
    lines = [line.strip() for line in fit.Options.__doc__.splitlines()]
    assert any(line.startswith(entry) for line in lines), f"Options' docstring has no {entry!r}"


@pytest.mark.parametrize("field", _marked(*_NOT_IN_REFERENCE))
def test_reference_options_section_states_each_default(field):
    """Each option with a non-None default has an entry `` - `name=<default>` `` in the `Options`
    section of docs/reference.md, its value the field's."""
    section = _read("docs/reference.md").split("## `Options`' docstring", 1)[1].split("\n## ")[0]
    entry = f"- `{field.name}={_as_written(field.default)}`"
    assert any(line.startswith(entry) for line in section.splitlines()), \
        f"docs/reference.md's Options section has no {entry!r}"


# -- The pure step: the function to edit -----------------------------------------------------------

_LOSS_LINE = "return loss.total if isinstance(loss, Weighted) else loss, (loss, metrics, stats)"


def _trained(module, tx, data, workdir):
    state = module.TrainState.create(apply_fn=MLP().apply, params=make_state(MLP()).params, tx=tx)
    return flat(module.fit(state, data, loss_fn=loss_fn, workdir=workdir, **COMMON)[0].params)


@pytest.mark.parametrize("scale", [0.0, 2.0])
def test_an_edit_of_gradient_step_alone_changes_training(scale, tmp_path, monkeypatch):
    """`_gradient_step` is the step's math: scaling the loss it differentiates (and nothing else)
    scales one SGD step's update, so 0.0 leaves the params as they were."""
    (tmp_path / "edited").mkdir()
    edited = edited_fit(tmp_path / "edited", monkeypatch, (
        _LOSS_LINE, f"return {scale} * (loss.total if isinstance(loss, Weighted) else loss), "
                    f"(loss, metrics, stats)"))
    data, tx, initial = batches(1), optax.sgd(0.1), flat(make_state(MLP()).params)
    update = _trained(fit, tx, data, str(tmp_path / "a")) - initial
    scaled = _trained(edited, tx, data, str(tmp_path / "b")) - initial
    assert np.abs(update).max() > 1e-4, "the unedited step must move the params"
    assert not np.allclose(scaled, update), "the edited step trained as the unedited one"
    np.testing.assert_allclose(scaled, scale * update, rtol=1e-5, atol=1e-7)
    if scale == 0.0:
        assert np.array_equal(scaled, np.zeros_like(scaled))


# -- Annotations on the public API (item 6) --------------------------------------------------------

_ANNOTATED = {
    "fit": fit.fit, "evaluate": fit.evaluate, "load_ckpt": fit.load_ckpt,
    "lr_schedule": fit.lr_schedule, "ema": fit.ema, "TrainState.create": fit.TrainState.create,
    "Options.of": fit.Options.of, "_Run.timed": fit._Run.timed,
    **{f"{cls.__name__}.{name}": getattr(cls, name) for cls, names in (
        (fit.EarlyStopping, ("__init__", "__call__", "get_state", "set_state")),
        (fit.Profiler, ("__init__", "__call__")), (fit.ProgressBar, ("__init__", "__call__")),
        (fit.TensorBoard, ("__init__", "__call__"))) for name in names},
}


@pytest.mark.parametrize("name", sorted(_ANNOTATED))
def test_the_public_api_is_annotated(name):
    """Every parameter (`*args`, `**kwargs` too; self and cls aside) and the return."""
    sig = inspect.signature(_ANNOTATED[name])
    bare = [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    assert not bare, f"{name}: parameters without an annotation: {bare}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"


def test_fits_signature_shows_every_option_with_its_type_and_default():
    """help(fit) and IDEs show `Options`' fields as fit's keyword-only parameters, in order, each
    with the field's type and default (`_with_options`)."""
    params = list(inspect.signature(fit.fit).parameters.values())
    assert [p.name for p in params[:3]] == ["state", "train_ds", "test_ds"], params
    options = [(p.name, p.kind, p.annotation, p.default) for p in params[3:]]
    assert options == [(f.name, inspect.Parameter.KEYWORD_ONLY, f.type, f.default)
                       for f in dataclasses.fields(fit.Options)]


@pytest.mark.parametrize("name", ["loss_fn", "eval_step", "eval_metrics", "train_step",
                                  "nnx_loss_fn", "lr_fn", "hooks"])
def test_options_that_take_functions_are_typed_as_functions(name):
    """An option whose values are functions says their shape (`Callable[...]`), not plain `Any`."""
    kind = {f.name: f.type for f in dataclasses.fields(fit.Options)}[name]
    assert kind is not typing.Any and "Callable" in str(kind), kind
