"""notebooks/quickstart.ipynb runs top to bottom on CPU (tiny model, no downloads) within its time budget."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel (pip install -e .[test])")

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300  # a hang guard, not a speed check: the notebook takes ~15 s alone on 2 cores

pytestmark = pytest.mark.slow


def test_quickstart_notebook_runs():
    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no python3 Jupyter kernel spec (install ipykernel in this environment)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "accuracy" in text and "tokens computed" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the reuse plot
