"""Times each Pallas kernel of impl="pallas" on its own, with launch variants.

    python -m benchmarks.profile_kernels [--shape 4,4096,16,128] [--gate kda]

Says where the time of the forward and backward goes and which block size,
warp count and pipeline depth each kernel runs fastest with. GPU only.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.benchmark import make_inputs, median_ms
from deltajax import stages
from deltajax.pallas import core, intra, output, reverse, scan, ut
from deltajax.pallas import ut_backward

VARIANTS = {
    "inverse": [core.Launch(num_warps=w, num_stages=1) for w in (1, 2, 4)],
    "intra": [core.Launch(num_warps=w, num_stages=1, block_k=bk)
              for w, bk in ((4, 64), (4, 128), (4, 32), (2, 64), (8, 128))],
    "forward_scan": [core.Launch(block_v=bv, num_warps=w, num_stages=s)
                     for bv, w, s in ((64, 4, None), (64, 4, 2), (64, 4, 1),
                                      (32, 4, 2), (32, 4, None),
                                      (64, 8, None))],
    "output": [core.Launch(block_v=bv, num_warps=w, num_stages=s)
               for bv, w, s in ((128, 4, 1), (64, 4, 1), (128, 8, 1),
                                (64, 8, 1), (64, 4, 2))],
    "w_u": [core.Launch(num_warps=w, num_stages=1) for w in (4, 2)],
    "output_backward": [core.Launch(block_v=bv, num_warps=w, num_stages=s)
                        for bv, w, s in ((64, 4, 2), (64, 4, 1), (128, 8, 1))],
    "backward_scan": [core.Launch(block_v=bv, num_warps=w, num_stages=1)
                      for bv, w in ((64, 8), (64, 4), (32, 8), (32, 4))],
    "ut_backward": [core.Launch(block_v=bv, num_warps=w, num_stages=s,
                                block_k=bk)
                    for bv, w, s, bk in ((64, 4, 2, 64), (64, 4, 2, 32),
                                         (128, 4, 1, 64), (64, 8, 2, 64),
                                         (64, 4, 2, 128), (64, 4, 1, 32))],
    "intra_backward": [core.Launch(num_warps=w, num_stages=1, block_k=bk)
                       for w, bk in ((4, 32), (4, 64), (2, 32), (8, 64),
                                     (4, 128), (8, 128))],
}


def stage_inputs(shape, gate="gdn", c=64):
  """Each kernel of ``gate`` as ``(fn(launch=..., **arrays), arrays)``, its
  inputs computed once with the default launches (core.Config)."""
  channel = gate == "kda"
  q, k, v, a, b, do = make_inputs(shape, gate=gate)
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  a = jnp.asarray(a) if channel else jnp.asarray(a)[..., None]
  g, beta, _, decayed = stages.gates(a, jnp.asarray(b), None, c,
                                     jnp.float32, shape[3], False,
                                     from_start=(q, k), to_end=(k,))
  qg, kg, kd = decayed or (None, None, None)
  s0 = jnp.zeros((shape[0], shape[2], shape[3], shape[3]), jnp.float32)
  config = core.Config(interpret=False)
  fixed = lambda fn, **kw: functools.partial(
      fn, chunk_size=c, interpret=False, dot=config.dot, **kw)
  calls = {
      "inverse": fixed(ut.inverse, heads=shape[2]),
      "forward_scan": fixed(scan.forward),
      "output": fixed(output.output, scale=0.1, out_dtype=v.dtype),
      "w_u": fixed(ut.w_u),
      "output_backward": (fixed(output.delta_backward) if channel else
                          fixed(output.output_backward, scale=0.1)),
      "backward_scan": fixed(reverse.backward, scale=0.1),
      "ut_backward": fixed(ut_backward.ut_backward),
  }
  if channel:
    calls["intra"] = fixed(intra.forward, heads=shape[2], scale=0.1)
    calls["intra_backward"] = fixed(intra.backward, scale=0.1)
  run = lambda name, **kw: calls[name](
      launch=config.launch(name, channel), **kw)
  arrays = {"inverse": dict(k=k, g=g, b=beta, cuts=None, a=None)}
  p = None
  if channel:
    arrays["intra"] = dict(q=q, k=k, a=a, cuts=None)
    a_kk, p, *_ = run("intra", **arrays["intra"])
    arrays["inverse"].update(g=None, a=a_kk)
  t = run("inverse", **arrays["inverse"])
  arrays["forward_scan"] = dict(k=k, v=v, g=g, b=beta, cuts=None,
                                chunk_seq=None, initial_state=s0, t=t,
                                decayed=(kg, kd) if channel else None)
  delta, states, _ = run("forward_scan", **arrays["forward_scan"])
  arrays["output"] = dict(q=q, k=k, g=g, cuts=None, p=p, states=states,
                          delta=delta, qg=qg)
  _, delta = run("output", **arrays["output"])  # the backward's copy
  arrays["w_u"] = dict(k=k, v=v, g=g, b=beta, cuts=None, t=t)
  w, u = run("w_u", **arrays["w_u"])
  if channel:
    arrays["output_backward"] = dict(p=p, d_o=do)
    dd_local = run("output_backward", **arrays["output_backward"])
    dg_out = dk_out = None
  else:
    arrays["output_backward"] = dict(q=q, k=k, g=g, cuts=None, d_o=do,
                                     states=states, delta=delta)
    _, dg_out, dd_local, dk_out = run("output_backward",
                                      **arrays["output_backward"])
  arrays["backward_scan"] = dict(q=q, k=k, g=g, cuts=None, chunk_seq=None,
                                 d_o=do, d_final=s0, w=w,
                                 d_delta_local=dd_local,
                                 decayed=(qg, kd) if channel else None)
  d_delta, d_next, _ = run("backward_scan", **arrays["backward_scan"])
  arrays["ut_backward"] = dict(
      k=k, v=v, g=g, b=beta, cuts=None, t=t, w=w, u=u, states=states,
      d_next=d_next, delta=delta, d_delta=d_delta, dg_out=dg_out,
      dk_out=dk_out)
  if channel:
    dk, _, _, dg, dm = run("ut_backward", **arrays["ut_backward"])
    arrays["intra_backward"] = dict(q=q, k=k, g=g, b=beta, cuts=None,
                                    states=states, d_o=do, delta=delta,
                                    d_m=dm, dk=dk, dg=dg)
  return {name: (calls[name], arrays[name]) for name in calls}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--gate", choices=("gdn", "kda"), default="gdn")
  parser.add_argument("--kernels", default=",".join(VARIANTS),
                      help="comma-separated kernels to time")
  parser.add_argument("--once", action="store_true",
                      help="run each kernel once with its default launch "
                      "(for a profiler such as ncu)")
  args = parser.parse_args()
  shape = tuple(int(x) for x in args.shape.split(","))
  calls = stage_inputs(shape, args.gate)
  if args.once:
    config = core.Config(interpret=False)
    for name, (fn, arrays) in calls.items():
      jax.block_until_ready(jax.jit(functools.partial(
          fn, launch=config.launch(name, args.gate == "kda")))(**arrays))
    return
  print(f"| kernel | launch | ms |  (shape {shape})\n|---|---|---|")
  for name, variants in VARIANTS.items():
    timed = name in calls and name in args.kernels.split(",")
    for opts in variants if timed else ():
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
