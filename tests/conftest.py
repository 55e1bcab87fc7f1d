"""pytest fixtures shared by the test files."""

import importlib.metadata
import os
import shutil
import tempfile

# Parallel workers (pytest-xdist, ``-n``) share one GPU: none of them takes
# most of its memory up front, and each gives back what it frees (a caching
# allocator would keep every worker's peak).
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

# Off the GPU the tests compile far more than they run (an interpreted kernel
# is a large XLA program): without LLVM's optimisation passes the CPU
# compiles them in about two thirds of the time.
if not any((d.metadata["Name"] or "").lower().replace("_", "-")
           .startswith("jax-cuda") for d in importlib.metadata.distributions()):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0")))

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

# One compilation cache on disk for the run, its workers included (made
# before they start, which inherit the variable): the tests compile the same
# programs in many files, after _release_compiled has dropped them, and in
# both workers; reading them back takes 10 % off the default run.
_CACHE = "DELTAJAX_TEST_COMPILATION_CACHE"
if _CACHE not in os.environ:
  os.environ[_CACHE] = tempfile.mkdtemp(prefix="deltajax-tests-")
  _OWN_CACHE = os.environ[_CACHE]
else:
  _OWN_CACHE = None
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  """Removes the run's compilation cache (in the process that made it)."""
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture
def x64():
  """Runs a test with ``jax_enable_x64`` (float64 arrays), for this test only."""
  with jax.enable_x64(True):
    yield


@pytest.fixture
def hopper():
  """Lowers for CUDA as for an H100, with no GPU here: JAX 0.11's Triton
  lowering asks the device for its compute capability, which an abstract
  device gives (JAX 0.10's asks none)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                       num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled():
  """Drops JAX's compiled executables after each test file: the whole suite
  in one process otherwise keeps every one (the interpreted Mosaic GPU
  kernels compile many): without it each worker grew past 4 GB and the
  default run was two thirds done when it otherwise ends, and XLA's CPU
  compiler crashed late in the suite (a segmentation fault in
  test_validation, twice)."""
  yield
  jax.clear_caches()
