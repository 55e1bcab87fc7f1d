"""Executes every notebook in colabs/ end to end on the CPU with small settings."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colabs").glob("*.ipynb"))


def test_the_notebooks_exist():
  assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "kernels_and_benchmarks",
                                         "associative_recall", "generation",
                                         "real_model_layers"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, cell.source[:80]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_cpu(path, tmp_path, monkeypatch):
  """Runs every cell in a fresh python3 kernel; a failing cell fails the test."""
  monkeypatch.setenv("DELTAJAX_SMALL", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  # The notebooks train models: they run, not just compile, so they get
  # XLA's optimised CPU code back (conftest turns it off for the tests).
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "").replace(
      "--xla_backend_optimization_level=0", "").strip())
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=600,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
