"""What differs between JAX releases around Mosaic GPU and its CPU interpreter.

JAX 0.10 runs the kernels in the Mosaic GPU interpreter on the CPU, JAX 0.11
compiles them for Hopper; the kernels' building blocks (:mod:`core`, its
:class:`core.Mosaic`) are written once against both. Here are the shims
over JAX's internals that the two releases do not share:

* :func:`interpret_params`: the interpreter's parameters (None where JAX
  has no interpreter);
* :func:`reserve_interpreter_threads` and :func:`cpu_threads`: the XLA CPU
  threads that the interpreter's concurrent warpgroups need, reserved when
  deltajax is imported;
* :func:`races_found`: the interpreter's race detector;
* :func:`shared_memory_bytes` reads a kernel's shared memory from Mosaic
  GPU's lowering, whose internals it relies on.
"""

from __future__ import annotations

import os
import re

import jax
from jax.experimental.mosaic.gpu import core as mgpu_core


def interpret_params(detect_races=False):
  """The interpreter's parameters (None where JAX has no interpreter), its
  race detector on or off."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError:  # a JAX without the Mosaic GPU interpreter
    return None
  return InterpretGPUParams(detect_races=detect_races)


# The interpreter runs a kernel's warpgroups (three at most) as concurrent
# XLA CPU computations, which wait for each other at barriers, beside the
# computation that called them: XLA's CPU runtime needs a thread for each.
INTERPRETER_THREADS = 4


def cpu_threads():
  """The threads of XLA's CPU runtime: ``NPROC`` where it is set, else the
  CPUs this process may run on (as XLA counts them)."""
  nproc = os.environ.get("NPROC", "")
  return int(nproc) if nproc.isdigit() else len(os.sched_getaffinity(0))


def reserve_interpreter_threads():
  """Gives XLA's CPU runtime :data:`INTERPRETER_THREADS` threads at least
  (``NPROC``) on a machine with fewer CPUs, if the runtime has not started
  yet and ``NPROC`` is not set: deltajax's import does this, so that the
  interpreter runs on any machine; a runtime started before it keeps its
  threads (then :func:`core._check_interpreter_threads` refuses)."""
  try:
    from jax._src import xla_bridge
    started = xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):  # a JAX without that function
    return
  if (not started and "NPROC" not in os.environ
      and cpu_threads() < INTERPRETER_THREADS):
    os.environ["NPROC"] = str(INTERPRETER_THREADS)


def races_found():
  """Whether the interpreter's race detector found a race in the last
  kernel interpreted with it (:class:`core.Mosaic` ``detect_races``)."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  return gpu_callbacks.get_races().races_found


def shared_memory_bytes(fn, *args):
  """The shared memory per CTA, in bytes, that the first Mosaic GPU kernel
  of ``fn`` on ``args`` (shapes and dtypes) requests, lowered for CUDA
  without a GPU: Mosaic GPU's check of the request against a limit, here
  0, names it."""
  with mgpu_core.artificial_shared_memory_limit(0):
    try:
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except ValueError as e:
      if found := re.search(r"smem_bytes=(\d+)", str(e)):
        return int(found.group(1))
      raise
  raise ValueError("no Mosaic GPU kernel takes shared memory")


reserve_interpreter_threads()
