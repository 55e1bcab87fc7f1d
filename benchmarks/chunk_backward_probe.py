"""The Mosaic GPU chunk_backward alone against the two kernels it replaces.

    MOSAIC_GPU_DUMP_PTXAS=1 python -m benchmarks.chunk_backward_probe \\
        --registers 104,216,184 128,208,168 104,232,168 --blocks 64 128

Times :func:`deltajax.mosaic.chunk_backward.chunk_backward` at each
register split of its three warpgroups (``REGISTERS``: multiples of 8
summing to at most 504) and each width of WG0's column blocks (``BLOCK``),
and :func:`deltajax.mosaic.output.output_backward`
followed by :func:`deltajax.mosaic.ut_backward.ut_backward` (the default
path's, with ``narrow_dk`` and no dDelta_local) on the same random chunk
inputs (benchmark.py's timing), and prints how far each variant's gradients
are from the first's (0 where only registers moved). With
``MOSAIC_GPU_DUMP_PTXAS=1`` ptxas prints each kernel's registers and
spills.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.benchmark import median_ms
from deltajax.mosaic import chunk_backward
from deltajax.mosaic import compat
from deltajax.mosaic import output
from deltajax.mosaic import ut_backward
from deltajax.mosaic.ut import C


def chunk_inputs(bsz, t_len, heads, dim, seed=0):
  """Random chunk inputs of both paths at ``[B, T, H, D]`` (K = V = D):
  ``(q, k, v, g, b, t, states, d_next, d_o, delta, d_delta)``."""
  keys = jax.random.split(jax.random.key(seed), 11)
  bf16 = lambda i, *s, x=1.0: (x * jax.random.normal(keys[i], s)).astype(
      jnp.bfloat16)
  n = t_len // C
  a = -0.1 * jax.random.uniform(keys[3], (bsz, heads, n, C))
  g = jnp.cumsum(a, axis=-1).reshape(bsz, heads, t_len)
  b = jax.random.uniform(keys[4], (bsz, heads, t_len))
  strict = jnp.tril(jnp.ones((C, C)), -1)
  t = (jnp.eye(C) + 0.1 * strict * jax.random.normal(
      keys[5], (bsz, heads, n, C, C))).reshape(bsz, heads, t_len, C)
  unit = dim ** -0.5
  return (bf16(0, bsz, t_len, heads, dim, x=unit),
          bf16(1, bsz, t_len, heads, dim, x=unit),
          bf16(2, bsz, t_len, heads, dim), g, b, t.astype(jnp.bfloat16),
          bf16(6, bsz, heads, n, dim, dim, x=0.1),
          bf16(7, bsz, heads, n, dim, dim, x=0.1),
          bf16(8, bsz, t_len, heads, dim), bf16(9, bsz, t_len, heads, dim),
          bf16(10, bsz, t_len, heads, dim))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--registers", nargs="*",
                      default=[",".join(map(str, chunk_backward.REGISTERS))])
  parser.add_argument("--blocks", nargs="*", type=int,
                      default=[chunk_backward.BLOCK])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--interpret", action="store_true",
                      help="in the Mosaic GPU interpreter (a smoke test)")
  args = parser.parse_args()
  mg = compat.Mosaic(interpret=args.interpret)
  (q, k, v, g, b, t, states, d_next, d_o, delta,
   d_delta) = chunk_inputs(*(int(x) for x in args.shape.split(",")))
  scale = q.shape[-1] ** -0.5

  def two_kernels(q, k, v, g, b, t, states, d_next, d_o, delta, d_delta):
    dq, dg_out, _, dk_out = output.output_backward(
        mg, q, k, g, states, delta, d_o, scale=scale, narrow_dk=True,
        local_delta=False)
    return (dq, *ut_backward.ut_backward(mg, k, v, g, b, t, states, d_next,
                                         delta, d_delta, dk_out, dg_out))

  inputs = (q, k, v, g, b, t, states, d_next, d_o, delta, d_delta)
  fn = jax.jit(two_kernels)
  print(f"two kernels: {median_ms(lambda: fn(*inputs), args.reps):.4f} ms",
        flush=True)
  first = None
  for registers, block in itertools.product(args.registers, args.blocks):
    chunk_backward.REGISTERS = tuple(int(x) for x in registers.split(","))
    chunk_backward.BLOCK = block
    fn = jax.jit(lambda *x: chunk_backward.chunk_backward(mg, *x,
                                                          scale=scale))
    label = f"registers {registers}, block {block}"
    try:
      ms = median_ms(lambda: fn(*inputs[:9]), args.reps)
      out = [np.asarray(x, np.float32) for x in fn(*inputs[:9])]
    except Exception as e:  # a split that does not compile
      print(f"{label}: failed: {str(e).splitlines()[0][:120]}")
      continue
    first = first or out
    moved = max(float(np.max(np.abs(x - y))) for x, y in zip(out, first))
    finite = all(np.isfinite(x).all() for x in out)
    print(f"{label}: {ms:.4f} ms, finite {finite}, max change {moved}",
          flush=True)


if __name__ == "__main__":
  main()
