"""pytest fixtures shared by the test files."""

import jax
import pytest


@pytest.fixture
def x64():
  """Runs a test with ``jax_enable_x64`` (float64 arrays), for this test only."""
  with jax.enable_x64(True):
    yield
