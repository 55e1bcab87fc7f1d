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
from deltajax.pallas import core, ops, output, state, ut

VARIANTS = {
    "inverse": [core.Launch(num_warps=w, num_stages=1) for w in (1, 2)],
    "forward_scan": [core.Launch(block_v=bv, num_warps=w, num_stages=s)
                     for bv, w, s in ((64, 4, 3), (64, 4, 2), (32, 4, 2))],
    "output": [core.Launch(block_v=bv, num_warps=4, num_stages=1)
               for bv in (128, 64)],
    "w_u": [core.Launch(num_warps=w, num_stages=1) for w in (4, 2)],
    "output_backward": [core.Launch(block_v=bv, num_warps=w, num_stages=s)
                        for bv, w, s in ((64, 4, 2), (64, 4, 1), (128, 8, 1))],
    "backward_scan": [core.Launch(block_v=64, num_warps=w, num_stages=1)
                      for w in (8, 4)],
    "ut_backward": [core.Launch(block_v=bv, num_warps=4, num_stages=s)
                    for bv, s in ((64, 2), (64, 1), (32, 2), (128, 1))],
}


def stage_inputs(shape, c=64):
  """Each kernel as ``(fn(launch=..., **arrays), arrays)``, its inputs
  computed once with the default launches (core.KernelConfig)."""
  q, k, v, a, b, do = make_inputs(shape)
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  g, beta, _ = ops._gates(jnp.asarray(a)[..., None], jnp.asarray(b), None, c,
                          jnp.float32, shape[3], False)
  s0 = jnp.zeros((shape[0], shape[2], shape[3], shape[3]), jnp.float32)
  config = core.KernelConfig(interpret=False)
  fixed = lambda fn, **kw: functools.partial(
      fn, chunk_size=c, interpret=False, dot=config.dot, **kw)
  arrays = {
      "inverse": dict(k=k, g=g, b=beta, cuts=None, a=None),
      "forward_scan": dict(k=k, v=v, g=g, b=beta, cuts=None, chunk_seq=None,
                           initial_state=s0),
      "output": dict(q=q, k=k, g=g, cuts=None, p=None),
      "w_u": dict(k=k, v=v, g=g, b=beta, cuts=None),
      "output_backward": dict(q=q, k=k, g=g, cuts=None, p=None, d_o=do),
      "backward_scan": dict(q=q, k=k, g=g, cuts=None, chunk_seq=None,
                            d_o=do, d_final=s0),
      "ut_backward": dict(k=k, v=v, g=g, b=beta, cuts=None),
  }
  calls = {
      "inverse": fixed(ut.inverse, heads=shape[2]),
      "forward_scan": fixed(state.forward_scan),
      "output": fixed(output.output, scale=0.1, out_dtype=v.dtype),
      "w_u": fixed(ut.w_u),
      "output_backward": fixed(output.output_backward, scale=0.1),
      "backward_scan": fixed(state.backward_scan, scale=0.1),
      "ut_backward": fixed(ut.ut_backward),
  }
  run = lambda name: calls[name](launch=getattr(config, name),
                                 **arrays[name])
  t = run("inverse")
  for name in ("forward_scan", "w_u", "ut_backward"):
    arrays[name]["t"] = t
  delta, states, _ = run("forward_scan")
  w, u = run("w_u")
  for name in ("output", "output_backward"):
    arrays[name].update(states=states, delta=delta)
  _, dg_out, dd_local, dk_out = run("output_backward")
  arrays["backward_scan"].update(w=w, d_delta_local=dd_local)
  d_delta, d_next, _ = run("backward_scan")
  arrays["ut_backward"].update(w=w, u=u, states=states, d_next=d_next,
                               delta=delta, d_delta=d_delta, dk_out=dk_out,
                               dg_out=dg_out)
  return {name: (calls[name], arrays[name]) for name in calls}


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
    config = core.KernelConfig(interpret=False)
    for name, (fn, arrays) in calls.items():
      jax.block_until_ready(jax.jit(functools.partial(
          fn, launch=getattr(config, name)))(**arrays))
    return
  print(f"| kernel | launch | ms |  (shape {shape})\n|---|---|---|")
  for name, variants in VARIANTS.items():
    for opts in variants:
      # Jitted with the arrays as arguments: an eager pallas_call is traced
      # and compiled again at every call.
      fn, arrays = calls[name]
      fn = jax.jit(functools.partial(fn, launch=opts))
      try:
        ms = median_ms(lambda: fn(**arrays), 20)
        print(f"| {name} | {opts} | {ms:.3f} |", flush=True)
      except Exception as e:  # a launch that does not compile (e.g. smem)
        print(f"| {name} | {opts} | failed: {str(e).splitlines()[0][:80]} |",
              flush=True)


if __name__ == "__main__":
  main()
