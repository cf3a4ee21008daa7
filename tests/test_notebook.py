"""examples/mnist.ipynb runs headless, top to bottom, in a fresh Jupyter kernel (nbclient): no
cell errors, the printed test accuracy is well above chance, and fit's progress bar is a
Jupyter widget (tqdm.auto picks tqdm.notebook when ipywidgets is installed). The notebook
writes its logs and checkpoints to $FIT_WORKDIR, pointed here at pytest's tmp_path, so the
repo stays clean. Needs nbclient, nbformat, ipykernel and ipywidgets; skips without them."""
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "examples", "mnist.ipynb")
WIDGET = "application/vnd.jupyter.widget-view+json"


def _text(output):
    """What a cell output shows as text: a stream, or a result's text/plain."""
    if output["output_type"] == "stream":
        return output["text"]
    return output.get("data", {}).get("text/plain", "")


@pytest.mark.slow
def test_mnist_notebook_runs_headless(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("ipywidgets")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this environment: logs go to tmp_path, and it sees the one CPU device
    # a user's machine has, not conftest's 8 simulated ones.
    monkeypatch.setenv("FIT_WORKDIR", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if a cell fails

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o["output_type"] == "error"]
    assert not errors, errors
    assert all(c.execution_count for c in code), "a code cell did not run"

    printed = "".join(_text(o) for c in code for o in c.outputs)
    found = re.search(r"test accuracy: ([0-9.]+)", printed)
    assert found, printed
    assert float(found.group(1)) > 0.5, f"accuracy {found.group(1)} is near chance (0.1)"

    fit_cell = next(c for c in code if "fit(state" in c.source)
    kinds = [sorted(o.get("data", {})) or o["output_type"] for o in fit_cell.outputs]
    assert any(WIDGET in o.get("data", {}) for o in fit_cell.outputs), (
        f"fit's progress bar is not a Jupyter widget; the fit cell produced {kinds}")

    # Everything went to $FIT_WORKDIR, nothing next to the notebook.
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "logs"]
    assert os.listdir(tmp_path / "logs") == ["digits_1"]
    for sub in ("logs", "checkpoints"):
        assert not os.path.exists(os.path.join(REPO, "examples", sub)), f"examples/{sub} was written"
