"""#39, item 1: eval results of any shape, merged exactly over every batch, device and process.

`eval_step` may return, per name, a per-batch mean, a `Weighted` of scalars or of arrays (divided
elementwise at the end), an array of counts (a confusion matrix, summed), or a metric state with
`merge` and `compute` (clu's `Accuracy` and `Average`, merged inside the compiled eval step; clu's
`CollectingMetric`, which refuses tracers, merged on the host), a `clu.metrics.Collection` giving
one metric per key of its `compute()`. Scalars are metrics (logged, monitored, in the history);
arrays reach hooks as `run.arrays` and TensorBoard as text, never the history or the checkpoint.

Every eval here runs on 4 simulated devices over sets whose last batch does not split over them
(it runs whole on each device and must be counted once): `a`, 203 held-out digits (batches of 64:
64, 64, 64, 11) and `b`, the other 154 (64, 64, 26). Each value is checked against numpy or
scikit-learn over all of a set's examples, from the parameters the eval used.
"""
import glob
import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as cm
from jax.sharding import Mesh
from sklearn.metrics import confusion_matrix, f1_score, roc_auc_score
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import fit as fit_module
from conftest import CNN, MLP, loss_fn, make_state
from fit import Weighted, evaluate, fit

BATCH, SPLIT = 64, 203  # test rows [:203] are set a, [203:] set b: neither's last batch splits
STEPS, EVAL_EVERY = 16, 4  # 512 train rows, 8 steps an epoch, two epochs: evals at 4, 8, 12, 16


# ----------------------------------------------------------------------------------------------
# Metrics, the eval step and the reference computed from all of a set's examples

@flax.struct.dataclass
class AUC(cm.CollectingMetric.from_outputs(("is_zero", "score"))):
    """ROC AUC of "is this a zero?" over the whole set: collects every batch's labels and scores
    (its `merge` concatenates, which clu refuses under jit: fit merges it on the host)."""

    def compute(self):
        v = super().compute()
        return roc_auc_score(v["is_zero"], v["score"])


@flax.struct.dataclass
class Both(cm.Collection):
    """A clu Collection with a state merged on the host (the AUC): merged on the host whole."""
    accuracy: cm.Accuracy
    loss: cm.Average.from_output("loss")
    auc: AUC


@flax.struct.dataclass
class Sums(cm.Collection):
    """A clu Collection of sum-like states only: merged inside the compiled eval step."""
    accuracy: cm.Accuracy
    loss: cm.Average.from_output("loss")


def apply(state, x, params=None):
    """Logits of `state`'s model (or of `params` with its batch_stats), in inference mode."""
    variables = {"params": state.params if params is None else params}
    if state.batch_stats:
        variables["batch_stats"] = state.batch_stats
    return state.apply_fn(variables, x, train=False)


def outputs(state, x, y):
    """What the clu metrics are built from: logits, labels, per-example loss, AUC's inputs."""
    logits = apply(state, x)
    return dict(logits=logits, labels=y, is_zero=(y == 0).astype(jnp.int32),
                score=jax.nn.softmax(logits)[:, 0],
                loss=optax.softmax_cross_entropy_with_integer_labels(logits, y))


def per_class(y, pred):
    """Weighted(correct per class, examples per class): per-class accuracy, shape (10,)."""
    hit = (pred == y).astype(jnp.float32)
    return Weighted(jnp.zeros(10).at[y].add(hit), jnp.zeros(10).at[y].add(1.0))


def eval_all(state, batch):
    """Every kind at once: a per-batch mean, an int32 count array, a host-merged state (AUC), a
    state merged in the step (clu's Accuracy) and a Weighted of arrays."""
    x, y = batch
    out = outputs(state, x, y)
    pred = out["logits"].argmax(-1)
    return {"accuracy": (pred == y).mean(),
            "confusion": jnp.zeros((10, 10), jnp.int32).at[y, pred].add(1),
            "auc": AUC.from_model_output(**out),
            "clu_accuracy": cm.Accuracy.from_model_output(**out),
            "per_class": per_class(y, pred)}


def reference(state, x, y, params=None):
    """The same metrics over all of (x, y) at once, with numpy and scikit-learn."""
    logits = np.asarray(apply(state, x, params), np.float64)
    pred = logits.argmax(-1)
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores = scores[:, 0] / scores.sum(-1)
    with np.errstate(invalid="ignore"):  # (a class absent from the set: 0 / 0, NaN)
        correct = np.bincount(y, weights=pred == y, minlength=10) / np.bincount(y, minlength=10)
    return {"pred": pred, "accuracy": np.mean(pred == y),
            "auc": roc_auc_score(y == 0, scores),
            "confusion": confusion_matrix(y, pred, labels=range(10)),
            "f1": f1_score(y, pred, labels=range(10), average="macro", zero_division=0),
            "per_class": correct}


def macro_f1(confusion):
    """Macro-F1 from a confusion matrix (rows: true class, columns: predicted): the mean over
    classes of 2 TP / (2 TP + FP + FN), 0 for a class neither present nor predicted."""
    c = np.asarray(confusion, np.float64)
    tp = np.diag(c)
    denominator = c.sum(0) + c.sum(1)
    return float(np.mean(np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)))


class Capture:
    """An eval hook: at every eval, the step, the metrics and arrays fit gave the hooks, and the
    reference of each tag's set, computed there from the state the eval used (`run.state` is
    valid during the call only). `sets`: `{None: (x, y)}` or named sets, as `test_ds`."""

    def __init__(self, sets, ema=False):
        self.sets, self.ema, self.evals = sets, ema, []

    def __call__(self, event, run):
        if event != "eval":
            return
        refs = {}
        for part in ("eval", "eval_ema") if self.ema else ("eval",):
            params = fit_module._ema_params(run.state.opt_state) if part == "eval_ema" else None
            for name, (x, y) in self.sets.items():
                prefix = part + "/" if name is None else f"{part}/{name}/"
                refs[prefix] = reference(run.state, x, y, params)
        self.evals.append({"step": run.step, "metrics": dict(run.metrics), "refs": refs,
                           "arrays": {k: np.array(v) for k, v in run.arrays.items()}})


# ----------------------------------------------------------------------------------------------
# Fixtures: one trained run on one set, shared by the tests that read its results

@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:4]), ("data",))


@pytest.fixture(scope="module")
def data(digits):
    """train (512 rows), and the eval sets a (203 rows) and b (154 rows)."""
    x, y, xt, yt = digits
    return (x[:512], y[:512]), {"a": (xt[:SPLIT], yt[:SPLIT]), "b": (xt[SPLIT:], yt[SPLIT:])}


def run_kwargs(mesh, workdir, **more):
    """The training every run here shares: a CNN (BatchNorm, Dropout) on 4 devices, 16 steps."""
    return dict(loss_fn=loss_fn, eval_step=eval_all, batch_size=BATCH, num_epochs=2,
                eval_every=EVAL_EVERY, mesh=mesh, workdir=str(workdir), verbose=0, **more)


@pytest.fixture(scope="module")
def one_set(data, mesh4, tmp_path_factory):
    """A run on set a alone (tags eval/<name>), AUC as its monitor: the trained state, history
    and what its eval hook saw."""
    train, sets = data
    capture = Capture({None: sets["a"]})
    state, history = fit(make_state(CNN(), optax.adam(1e-2)), train, sets["a"], hooks=[capture],
                         monitor="eval/auc", **run_kwargs(mesh4, tmp_path_factory.mktemp("one")))
    return state, history, capture


def assert_eval_exact(evaluation, prefix):
    """One eval's values under a tag prefix (`eval/`, `eval/a/`, `eval_ema/b/`) against its
    reference: scalars to 1e-6, the summed confusion matrix exactly, as integers."""
    ref, metrics, arrays = evaluation["refs"][prefix], evaluation["metrics"], evaluation["arrays"]
    where = (evaluation["step"], prefix)
    assert metrics[prefix + "auc"] == pytest.approx(ref["auc"], abs=1e-6), where
    assert metrics[prefix + "accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6), where
    assert metrics[prefix + "clu_accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6), where
    confusion = arrays[prefix + "confusion"]
    assert confusion.dtype == np.int32, (where, confusion.dtype)  # (counts summed as integers)
    np.testing.assert_array_equal(confusion, ref["confusion"], err_msg=str(where))
    assert macro_f1(confusion) == pytest.approx(ref["f1"], abs=1e-6), where
    np.testing.assert_allclose(arrays[prefix + "per_class"], ref["per_class"], atol=1e-6,
                               err_msg=str(where))


# ----------------------------------------------------------------------------------------------
# 1. Exact at every eval: one set, named sets, the EMA's eval

def test_every_eval_is_exact_over_the_whole_set_with_a_ragged_last_batch(one_set, data):
    """At each of the 4 evals of a 4-device run on 203 rows (last batch 11 rows, run whole on
    every device): the host-merged AUC equals sklearn's roc_auc_score, the summed confusion
    matrix sklearn's confusion_matrix exactly (so macro-F1 from it equals f1_score's), clu's
    Accuracy (merged in the compiled step) and the per-batch mean the accuracy, the Weighted
    per-class accuracy numpy's; all from the parameters the eval used. Scalars are `metrics`,
    arrays only `run.arrays`."""
    _, _, capture = one_set
    assert [e["step"] for e in capture.evals] == [4, 8, 12, 16]
    for evaluation in capture.evals:
        assert set(evaluation["metrics"]) == {"eval/accuracy", "eval/auc", "eval/clu_accuracy"}
        assert set(evaluation["arrays"]) == {"eval/confusion", "eval/per_class"}
        assert_eval_exact(evaluation, "eval/")
    # (The run learned: a confusion matrix of an untrained model would test little.)
    assert capture.evals[-1]["refs"]["eval/"]["accuracy"] > 0.5


def test_named_sets_and_the_ema_are_each_exact(data, mesh4, tmp_path):
    """test_ds={"a": ..., "b": ...} with tx=fit.ema(...): tags eval/a/..., eval/b/...,
    eval_ema/a/..., eval_ema/b/... (b's last batch: 26 rows, on 4 devices), each exact against
    its set's reference, eval_ema's from the average's params (`_ema_params` of the optimizer
    state), which differ from the trained ones."""
    train, sets = data
    capture = Capture(sets, ema=True)
    _, history = fit(make_state(CNN(), fit_module.ema(optax.adam(1e-2), decay=0.9)), train, sets,
                     hooks=[capture], **run_kwargs(mesh4, tmp_path))
    tags = {f"{part}/{s}/" for part in ("eval", "eval_ema") for s in "ab"}
    assert len(capture.evals) == 4
    for evaluation in capture.evals:
        assert set(evaluation["arrays"]) == {t + k for t in tags for k in ("confusion",
                                                                           "per_class")}
        for tag in tags:
            assert_eval_exact(evaluation, tag)
    last = capture.evals[-1]["refs"]
    assert not np.array_equal(last["eval/a/"]["pred"], last["eval_ema/a/"]["pred"]), \
        "the EMA's predictions equal the trained params': the eval_ema check would prove nothing"
    assert history["eval_ema/b/auc"] == [e["metrics"]["eval_ema/b/auc"] for e in capture.evals]
    assert not any("confusion" in k or "per_class" in k for k in history)


# ----------------------------------------------------------------------------------------------
# 2. Interrupt and resume: the same eval rows as the run never stopped

class Stop(Exception):
    """Raised by a hook to cut a run, as a crash would."""


def test_a_resumed_run_logs_the_same_evals_as_an_uninterrupted_one(one_set, data, mesh4,
                                                                   tmp_path):
    """The run of `one_set`, cut by an exception at the eval of step 8 (its last checkpoint:
    step 6, mid-epoch, from ckpt_every=6), then resumed with resume=True: the eval rows of its
    history (the restored one of step 4, the recomputed ones of 8, 12 and 16) equal the
    uninterrupted run's, AUC included, and the hooks' arrays (confusion matrices) too."""
    _, reference_history, reference_capture = one_set
    train, sets = data

    def crash(event, run):
        if event == "eval" and run.step == 8:
            raise Stop

    kwargs = run_kwargs(mesh4, tmp_path, ckpt_every=6, monitor="eval/auc")
    with pytest.raises(Stop):
        fit(make_state(CNN(), optax.adam(1e-2)), train, sets["a"], hooks=[crash], **kwargs)
    capture = Capture({None: sets["a"]})
    _, history = fit(make_state(CNN(), optax.adam(1e-2)), train, sets["a"], hooks=[capture],
                     resume=True, **kwargs)
    assert [e["step"] for e in capture.evals] == [8, 12, 16], "resumed from step 6"
    for key in ("eval/step", "eval/accuracy", "eval/auc", "eval/clu_accuracy"):
        assert history[key] == reference_history[key], key
    assert len(history["eval/auc"]) == 4
    arrays = {e["step"]: e["arrays"] for e in reference_capture.evals}
    for evaluation in capture.evals:
        for tag, array in evaluation["arrays"].items():
            np.testing.assert_array_equal(array, arrays[evaluation["step"]][tag])


# ----------------------------------------------------------------------------------------------
# 3. Device reads: one per eval set, unless a state is merged on the host

@pytest.fixture
def reads(monkeypatch):
    """`{set: jax.device_get calls}` during each `fit._eval_set` (one eval of one set)."""
    counts, calls = {}, [0]
    device_get, one_set_eval = jax.device_get, fit_module._eval_set

    def counting(tree):
        calls[0] += 1
        return device_get(tree)

    def evaluate_one(steps, test, state, name=None, **kwargs):
        before = calls[0]
        try:
            return one_set_eval(steps, test, state, name, **kwargs)
        finally:
            counts[name] = calls[0] - before
    monkeypatch.setattr(jax, "device_get", counting)  # (fit.jax is the jax module)
    monkeypatch.setattr(fit_module, "_eval_set", evaluate_one)
    return counts


def test_sums_are_read_once_per_set_and_a_host_state_once_per_batch(one_set, data, mesh4, reads):
    """Sum-like outputs (clu's Accuracy, merged in the step; a count array) are read from the
    device once per eval set: `evaluate` of 2 named sets, 2 reads. Adding a state merged on the
    host (the AUC) adds a read per batch (a: 4 batches, b: 3), and the values stay exact."""
    state, _, _ = one_set
    _, sets = data

    def sums_only(state, batch):
        out = eval_all(state, batch)
        return {k: out[k] for k in ("clu_accuracy", "confusion")}

    values = evaluate(state, sets, sums_only, batch_size=BATCH, mesh=mesh4)
    assert reads == {"a": 1, "b": 1}, reads
    for name, (x, y) in sets.items():
        ref = reference(state, x, y)
        assert values[name]["clu_accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
        np.testing.assert_array_equal(values[name]["confusion"], ref["confusion"])

    reads.clear()
    values = evaluate(state, sets, eval_all, batch_size=BATCH, mesh=mesh4)
    assert reads == {"a": 1 + 4, "b": 1 + 3}, reads
    for name, (x, y) in sets.items():
        ref = reference(state, x, y)
        assert values[name]["auc"] == pytest.approx(ref["auc"], abs=1e-6), name
        np.testing.assert_array_equal(values[name]["confusion"], ref["confusion"])


# ----------------------------------------------------------------------------------------------
# 4. A clu Collection: the same values as clu's own loop

@pytest.mark.parametrize("collection", [Both, Sums], ids=["with_host_auc", "sums_only"])
@pytest.mark.parametrize("bare", [True, False], ids=["bare", "in_a_dict"])
def test_a_clu_collection_gives_what_clus_own_loop_gives(one_set, data, mesh4, collection, bare):
    """eval_step returning a clu `Collection` (bare, or as one value of a dict): `evaluate` gives
    one value per field (accuracy, loss, auc), equal to 1e-6 to clu's own loop over the same
    batches on one device (single_from_model_output, merge, compute). `Both` holds a
    CollectingMetric (merged on the host), `Sums` only sums (merged in the compiled step)."""
    state, _, _ = one_set
    x, y = data[1]["a"]

    def eval_step(state, batch):
        metrics = collection.single_from_model_output(**outputs(state, *batch))
        return metrics if bare else {"metrics": metrics}

    values = evaluate(state, (x, y), eval_step, batch_size=BATCH, mesh=mesh4)
    single = jax.jit(lambda state, x, y: collection.single_from_model_output(
        **outputs(state, x, y)))
    clu = None
    for i in range(0, len(x), BATCH):
        batch = jax.device_get(single(state, x[i:i + BATCH], y[i:i + BATCH]))
        clu = batch if clu is None else clu.merge(batch)
    expected = {k: float(v) for k, v in clu.compute().items()}
    assert set(values) == set(expected) == set(collection.__annotations__)
    for k in expected:
        assert values[k] == pytest.approx(expected[k], abs=1e-6), k


# ----------------------------------------------------------------------------------------------
# 5. Weighted of arrays, and float arrays

def test_weighted_arrays_divide_elementwise_after_summing_everything(one_set, data, mesh4):
    """A Weighted of arrays is summed (total and weight) over all batches and devices, then
    divided elementwise: per-class accuracy equals numpy's, on the set a and on a set with no 9s
    (class 9's 0 / 0 is NaN, no error); a scalar weight broadcasts (the share of predictions
    per class); a float array is summed in float32 (softmax probabilities per class)."""
    state, _, _ = one_set
    a = data[1]["a"]
    no_nines = (a[0][a[1] != 9], a[1][a[1] != 9])

    def eval_step(state, batch):
        x, y = batch
        logits = apply(state, x)
        pred = logits.argmax(-1)
        return {"per_class": per_class(y, pred),
                "share": Weighted(jnp.zeros(10).at[pred].add(1.0), jnp.float32(len(y))),
                "probability_sums": jax.nn.softmax(logits).sum(0)}

    values = evaluate(state, {"a": a, "no_nines": no_nines}, eval_step, batch_size=BATCH,
                      mesh=mesh4)
    for name, (x, y) in {"a": a, "no_nines": no_nines}.items():
        got, ref = values[name], reference(state, x, y)
        assert all(isinstance(v, np.ndarray) and v.shape == (10,) for v in got.values()), got
        np.testing.assert_allclose(got["per_class"], ref["per_class"], atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["share"], np.bincount(ref["pred"], minlength=10) / len(y),
                                   atol=1e-6, err_msg=name)
        probabilities = np.asarray(jax.nn.softmax(apply(state, x)), np.float64).sum(0)
        assert got["probability_sums"].dtype == np.float32
        np.testing.assert_allclose(got["probability_sums"], probabilities, rtol=1e-5)
    assert np.isnan(values["no_nines"]["per_class"][9])
    assert not np.isnan(values["no_nines"]["per_class"][:9]).any()


# ----------------------------------------------------------------------------------------------
# 6. Arrays in TensorBoard as text, never in the history or the checkpoint

def parse_table(markdown):
    """The numbers of a markdown table as `_table` writes it: a header row of column indices,
    a separator, then `| row | value | ... |` rows."""
    lines = markdown.strip().splitlines()
    assert set(lines[1].replace("|", "").split()) == {"---"}, markdown
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [int(r[0]) for r in rows] == list(range(len(rows))), markdown
    return np.array([[float(c) for c in r[1:]] for r in rows])


def test_arrays_are_tensorboard_text_and_stay_out_of_history_and_checkpoint(one_set):
    """The TensorBoard hook writes each array at each eval as a text summary under its tag
    (tensorboardX: `<tag>/text_summary`, the "text" plugin): a markdown table whose numbers are
    the array the hooks got. The history and the checkpoint's JSON metadata hold the scalars
    (the monitored AUC too, its best the best in the history), not the arrays."""
    _, history, capture = one_set
    events = EventAccumulator(history.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    arrays = {e["step"]: e["arrays"] for e in capture.evals}
    for tag in ("eval/confusion", "eval/per_class"):
        text = f"{tag}/text_summary"
        assert text in events.Tags()["tensors"], events.Tags()
        assert events.SummaryMetadata(text).plugin_data.plugin_name == "text"
        written = events.Tensors(text)
        assert [e.step for e in written] == sorted(arrays)
        for e in written:
            table = parse_table(e.tensor_proto.string_val[0].decode())
            expected = np.atleast_2d(arrays[e.step][tag])
            np.testing.assert_array_equal(table, expected, err_msg=f"{text} at step {e.step}")
    assert "eval/confusion" not in events.Tags()["scalars"]

    assert not any(k.endswith(("confusion", "per_class")) for k in history), list(history)
    steps = sorted(int(s) for s in os.listdir(history.ckpt_dir) if s.isdigit())
    for step in steps:
        (path,) = glob.glob(os.path.join(history.ckpt_dir, str(step), "meta", "metadata"))
        with open(path) as f:
            meta = json.load(f)
        assert "eval/auc" in meta["history"], meta["history"].keys()
        assert not any("confusion" in k or "per_class" in k for k in meta["history"])
    assert meta["history"]["eval/auc"] == history["eval/auc"]
    assert meta["best"] == max(history["eval/auc"])  # (monitor="eval/auc": a computed scalar)


# ----------------------------------------------------------------------------------------------
# 7. Outputs of no known kind: a TypeError naming the metric

@flax.struct.dataclass
class NoCompute:
    """A pytree with `merge` but no `compute`: not a metric state."""
    count: jax.Array

    def merge(self, other):
        return NoCompute(self.count + other.count)


class Opaque:
    """Neither a number nor a pytree."""


def test_outputs_of_no_known_kind_raise_a_type_error_naming_the_metric(mesh4, data):
    """A string, an object that is no pytree, or a pytree without `compute` as a metric: a
    TypeError that names the metric, raised before any compile (jax's own, for the first two,
    names the output's path)."""
    a = data[1]["a"]
    cases = {"name": lambda x, y: "hello", "opaque": lambda x, y: Opaque(),
             "no_compute": lambda x, y: NoCompute(jnp.zeros(3))}
    for name, make in cases.items():
        def eval_step(state, batch):
            return {"accuracy": (apply(state, batch[0]).argmax(-1) == batch[1]).mean(),
                    name: make(*batch)}
        with pytest.raises(TypeError, match=f"'{name}'") as error:
            evaluate(make_state(MLP()), a, eval_step, batch_size=BATCH, mesh=mesh4)
        if name == "no_compute":
            assert "metric states" in str(error.value) and "NoCompute" in str(error.value)


@pytest.mark.parametrize("weight_shape", [
    (3,),  # does not broadcast with the total's at all
    (2, 10),  # broadcasts, but to a larger shape than the total's
], ids=["incompatible", "larger"])
def test_a_weighted_whose_weight_does_not_fit_its_total_is_a_type_error(mesh4, data,
                                                                       weight_shape):
    """Weighted(total of shape (10,), weight of a shape that does not broadcast to (10,)): a
    TypeError naming the metric and both shapes, not a silent broadcast to a larger array."""
    def eval_step(state, batch):
        return {"per_class": Weighted(jnp.zeros(10), jnp.ones(weight_shape))}

    with pytest.raises(TypeError, match=r"'per_class'.*\(10,\).*broadcast"):
        evaluate(make_state(MLP()), data[1]["a"], eval_step, batch_size=BATCH, mesh=mesh4)


def test_a_metric_name_given_twice_is_refused(mesh4, data):
    """A clu Collection whose compute() gives `accuracy` beside eval_step's own `accuracy`: one
    of them would be lost, so fit refuses the pair before any work, naming the name."""
    @flax.struct.dataclass
    class Both(cm.Collection):
        accuracy: cm.Accuracy

    def eval_step(state, batch):
        logits = apply(state, batch[0])
        return {"accuracy": (logits.argmax(-1) == batch[1]).mean(),
                "m": Both.single_from_model_output(logits=logits, labels=batch[1])}

    with pytest.raises(ValueError, match=r"\['accuracy'\] twice"):
        evaluate(make_state(MLP()), data[1]["a"], eval_step, batch_size=BATCH, mesh=mesh4)
