"""pytest fixtures shared by the test files."""

import jax
import pytest


@pytest.fixture
def x64():
  """Runs a test with ``jax_enable_x64`` (float64 arrays), for this test only."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled():
  """Drops JAX's compiled executables after each test file: the whole suite
  in one process otherwise keeps every one (the interpreted Mosaic GPU
  kernels compile many), and XLA's CPU compiler crashed late in the suite
  (a segmentation fault in test_validation, twice)."""
  yield
  jax.clear_caches()
