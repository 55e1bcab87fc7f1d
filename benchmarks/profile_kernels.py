"""Times each Pallas kernel of impl="pallas" on its own, with launch variants.

    python benchmarks/profile_kernels.py [--shape 4,4096,16,128]

Says where the time of the forward and backward goes and which block size,
warp count and pipeline depth each kernel runs fastest with. GPU only.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.benchmark import make_inputs, median_ms
from deltajax.pallas import ops, output, state, ut

VARIANTS = {
    "inverse": [dict(num_warps=w) for w in (1, 2)],
    "forward_scan": [dict(block_v=bv, num_warps=w, num_stages=s) for bv, w, s in
                     ((64, 4, 3), (64, 4, 2), (32, 4, 2))],
    "output": [dict(block_v=bv) for bv in (128, 64)],
    "w_u": [dict(num_warps=w) for w in (4, 2)],
    "output_backward": [dict(block_v=bv, num_warps=w, num_stages=s)
                        for bv, w, s in ((64, 4, 2), (64, 4, 1), (128, 8, 1))],
    "backward_scan": [dict(block_v=64, num_warps=w, num_stages=1)
                      for w in (8, 4)],
    "ut_backward": [dict(block_v=bv, num_warps=4, num_stages=s) for bv, s in
                    ((64, 2), (64, 1), (32, 2), (128, 1))],
}


def stage_inputs(shape, c=64):
  """Each kernel as ``(fn(*arrays, **launch), arrays)``, its inputs computed
  once with the default launches."""
  q, k, v, a, b, do = make_inputs(shape)
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  g, beta = ops._gates(jnp.asarray(a)[..., None], jnp.asarray(b), c,
                       jnp.float32)
  s0 = jnp.zeros((shape[0], shape[2], shape[3], shape[3]), jnp.float32)
  t = ut.inverse(k, g, beta, chunk_size=c)
  w, u = ut.w_u(k, v, g, beta, t, chunk_size=c)
  delta, states, _ = state.forward_scan(t, k, v, g, beta, s0, chunk_size=c)
  _, dk_out, dg_out, dd_local = output.output_backward(
      q, k, g, states, delta, do, chunk_size=c, scale=0.1)
  d_delta, d_next, _ = state.backward_scan(q, k, w, g, do, dd_local, s0,
                                           chunk_size=c, scale=0.1)
  fixed = functools.partial
  return {
      "inverse": (fixed(ut.inverse, chunk_size=c), (k, g, beta)),
      "forward_scan": (fixed(state.forward_scan, chunk_size=c),
                       (t, k, v, g, beta, s0)),
      "output": (fixed(output.output, chunk_size=c, scale=0.1,
                       out_dtype=v.dtype), (q, k, g, states, delta)),
      "w_u": (fixed(ut.w_u, chunk_size=c), (k, v, g, beta, t)),
      "output_backward": (fixed(output.output_backward, chunk_size=c,
                                scale=0.1), (q, k, g, states, delta, do)),
      "backward_scan": (fixed(state.backward_scan, chunk_size=c, scale=0.1),
                        (q, k, w, g, do, dd_local, s0)),
      "ut_backward": (fixed(ut.ut_backward, chunk_size=c),
                      (k, v, g, beta, t, w, u, states, d_next, delta, d_delta,
                       dk_out, dg_out)),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--once", action="store_true",
                      help="run each kernel once with its default launch "
                      "(for a profiler such as ncu)")
  args = parser.parse_args()
  shape = tuple(int(x) for x in args.shape.split(","))
  calls = stage_inputs(shape)
  if args.once:
    for fn, arrays in calls.values():
      jax.block_until_ready(jax.jit(fn)(*arrays))
    return
  print(f"| kernel | launch | ms |  (shape {shape})\n|---|---|---|")
  for name, variants in VARIANTS.items():
    for opts in variants:
      # Jitted with the arrays as arguments: an eager pallas_call is traced
      # and compiled again at every call.
      fn, arrays = calls[name]
      fn = jax.jit(functools.partial(fn, **opts))
      try:
        ms = median_ms(lambda: fn(*arrays), 20)
        print(f"| {name} | {opts} | {ms:.3f} |", flush=True)
      except Exception as e:  # a launch that does not compile (e.g. smem)
        print(f"| {name} | {opts} | failed: {str(e).splitlines()[0][:80]} |",
              flush=True)


if __name__ == "__main__":
  main()
