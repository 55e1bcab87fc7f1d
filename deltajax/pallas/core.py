"""Shared plumbing for the Pallas kernels: lowering choice, dots, masks, block specs.

Every kernel is lowered through Triton (``pallas.triton.CompilerParams``), or
run in Pallas interpret mode when no GPU is present (slow; for tests).
Triton limits shape the kernels: power-of-two loads and stores, 2-D dots with
every dimension >= 16, no slicing of values (slice refs with ``pl.ds``), no
scratch buffers, no reverse cumsum.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

SUB = 16  # the smallest block a Triton dot accepts
MIN_CAPABILITY = (8, 0)


def padded_dim(d: int) -> int:
  """Head dims are padded with zeros to a power of two of at least ``SUB``."""
  return max(SUB, 1 << (d - 1).bit_length())


def gpu_capability() -> tuple[int, int] | None:
  """Compute capability of the default device, or None when it is not a GPU."""
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def interpret_mode() -> bool:
  """Kernels run in interpret mode when there is no GPU; raise on an old GPU."""
  cc = gpu_capability()
  if jax.default_backend() != "gpu":
    return True
  if cc is not None and cc < MIN_CAPABILITY:
    raise ValueError(
        f"impl='pallas' needs an NVIDIA GPU of compute capability >= 8.0 for "
        f"Triton lowering; this one is {cc[0]}.{cc[1]}. Use impl='chunked' "
        f"(impl='auto' does so on this GPU).")
  return False


def call(kernel, *, grid, in_specs, out_specs, out_shape, num_warps=4,
         num_stages=2, name=None):
  """``pl.pallas_call`` lowered through Triton (interpret mode without a GPU)."""
  interpret = interpret_mode()
  fn = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=interpret, name=name,
      compiler_params=None if interpret else pl_triton.CompilerParams(
          num_warps=num_warps, num_stages=num_stages))

  @functools.wraps(fn)
  def run(*args):
    with warnings.catch_warnings():
      # JAX 0.11 deprecates the Triton lowering of pallas_call in favour of
      # Mosaic GPU; deltajax asks for it explicitly.
      warnings.filterwarnings("ignore", category=DeprecationWarning,
                              message=".*[Tt]riton.*")
      return fn(*args)

  return run


def block(*shape):
  """A BlockSpec whose ``None`` entries are squeezed dimensions."""
  def spec(index_map):
    return pl.BlockSpec(tuple(pl.squeezed if d is None else d for d in shape),
                        index_map)
  return spec


def accumulator(dtype):
  """float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def mm(a, b, *, trans_a=False, trans_b=False, precision="tf32x3"):
  """2-D matrix product with float32 accumulation (float64 for float64).

  16-bit operands use the tensor cores as they are. On the GPU, float32
  operands use ``precision``: "tf32x3" (three TF32 passes on the tensor
  cores, about float32 accuracy), "tf32" (one pass, 10-bit mantissas) or
  "ieee" (plain float32 FMAs). Interpret mode computes exactly.
  """
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  acc = accumulator(a.dtype)
  algorithm = lax.Precision.HIGHEST
  if a.dtype == jnp.float32 and not interpret_mode():
    algorithm = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                 "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
                 "ieee": lax.Precision.HIGHEST}[precision]
  return lax.dot_general(a, b, dims, precision=algorithm,
                         preferred_element_type=acc)


def blocks(size: int, block: int):
  """Static ref slices ``pl.ds`` covering ``range(size)`` in steps of ``block``."""
  block = min(size, block)
  return [pl.ds(i, block) for i in range(0, size, block)]


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def causal(c: int, *, strict: bool):
  """``[c, c]`` boolean mask: ``j < i`` (strict) or ``j <= i``."""
  i, j = iota((c, c), 0), iota((c, c), 1)
  return i > j if strict else i >= j


def decay(g_i, g_j, mask):
  """``exp(g_i - g_j)`` on ``mask``, 0 elsewhere; masked before ``exp`` (GDN seed 4.1)."""
  return jnp.exp(jnp.where(mask, g_i[:, None] - g_j[None, :], -jnp.inf))


def last(x):
  """The last entry of a vector, without slicing a value."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == x.shape[0] - 1, x, 0))

