"""The per-step path a reader follows for one train step (#49 item 4), counted from a run.

    python benchmarks/step_path.py [FIT_PY ...]      # default: this checkout's fit.py

For each fit.py given, trains a small MLP on arrays `(x, y)` (batch 32, `steps_per_jit=1`,
log_every=5, TensorBoard on) and records, with `sys.settrace`, every function of that fit.py
that runs (a) while the train step is traced (the compiled step's Python: what a reader reads
for what runs on the device) and (b) on the host from the `log` hook of step 10 to that of step
20 (steady steps and a log point between, no compile, no save, no eval). A piece is one such
function; its lines are its source lines (a nested function's inside its parent's counted once;
a lambda or a comprehension is its parent's, not a piece). fit's own loop, entered before the
window, is not counted (~30 lines in both files compared in #49). Prints the pieces, by part,
and the totals: what a reader follows from a batch to the device, to the step and back to the
logged metrics.
"""
import importlib.util
import inspect
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "tests"))


def load(path):
    spec = importlib.util.spec_from_file_location("fit", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fit"] = module  # (conftest imports fit)
    spec.loader.exec_module(module)
    return module


def path_of(fit_py):
    fit = load(fit_py)
    from conftest import MLP, loss_fn, make_state
    source = os.path.abspath(fit.__file__)
    seen, phase = {"step": set(), "host": set()}, {"now": None}

    def tracer(frame, event, arg):
        if event == "call" and phase["now"] and frame.f_code.co_filename == source:
            seen[phase["now"]].add(frame.f_code)
        return None

    # The compiled step's Python: what runs while fit's train step is traced.
    wrapped = fit._default_train_step

    def traced_step(config):
        step = wrapped(config)

        def train_step(state, batch):
            before, phase["now"] = phase["now"], "step"
            try:
                return step(state, batch)
            finally:
                phase["now"] = before
        return train_step
    fit._default_train_step = traced_step

    def hook(event, run):  # the host from the log of step 10 to that of step 20
        if event == "log" and run.step == 10:
            phase["now"] = "host"
        elif event == "log" and run.step == 20:
            phase["now"] = None

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * 40, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    sys.settrace(tracer)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            fit.fit(make_state(MLP()), (x, y), loss_fn=loss_fn, batch_size=32, num_epochs=1,
                    steps_per_jit=1, log_every=5, verbose=0, workdir=workdir, hooks=[hook],
                    ckpt_interval=1e9)
    finally:
        sys.settrace(None)
        fit._default_train_step = wrapped
    lines = open(source).read().splitlines()

    def span(code):
        _, first = inspect.getsourcelines(code)
        return range(first, first + len(inspect.getsourcelines(code)[0]))
    parts = {}
    for part in ("step", "host"):
        codes = sorted(seen[part], key=lambda c: c.co_firstlineno)
        covered = set().union(*(span(c) for c in codes)) if codes else set()
        # a piece: a function or method that has a name (lambdas, comprehensions: its parent's)
        names = dict.fromkeys(".".join(n for n in c.co_qualname.split(".") if not (
            n.startswith("<") and n != "<locals>")).removesuffix(".<locals>") for c in codes)
        parts[part] = (list(names), len(covered), covered)
    both = parts["step"][2] | parts["host"][2]
    return parts, len(parts["step"][0]) + len(parts["host"][0]), len(both), len(lines)


def main(paths):
    for fit_py in paths or [os.path.join(HERE, "fit.py")]:
        parts, pieces, lines, total = path_of(fit_py)
        print(f"== {fit_py}: {pieces} pieces, {lines} lines (of {total} in the file)")
        for part, (names, n, _) in parts.items():
            where = "traced into the step" if part == "step" else "on the host, a steady step"
            print(f"  {where}: {len(names)} pieces, {n} lines: {', '.join(names)}")


if __name__ == "__main__":
    # one process per fit.py (each defines its own module)
    if len(sys.argv) > 2:
        import subprocess
        for p in sys.argv[1:]:
            subprocess.run([sys.executable, __file__, p], check=True)
    else:
        main(sys.argv[1:])
