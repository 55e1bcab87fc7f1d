"""One step of ``deltajax.gated_delta`` (forward+backward, or forward) for a profiler.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        --log-file $OUT/step.csv python benchmarks/ncu_step.py --gate kda
    python3 ../shared/tools/ncu_kernels.py step.csv

Runs the jitted step twice (compilation and autotuning in the first), on
benchmark.py's inputs; the last launches in the log are one step. ``--impl
jla`` profiles jla's kernels on the same inputs (its wheel importable).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.benchmark import deltajax_attention
from benchmarks.benchmark import load_jla
from benchmarks.benchmark import make_inputs


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--gate", choices=("gdn", "kda"), default="gdn")
  parser.add_argument("--impl", default="pallas",
                      help='a deltajax implementation, or "jla"')
  parser.add_argument("--forward", action="store_true",
                      help="the forward alone (no gradients)")
  args = parser.parse_args()
  shape = tuple(int(x) for x in args.shape.split(","))
  q, k, v, a, b, do = make_inputs(shape, gate=args.gate)
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  a, b = jnp.asarray(a), jnp.asarray(b)

  attention = (load_jla(args.gate) if args.impl == "jla"
               else deltajax_attention(args.impl, args.gate))
  if attention is None:
    parser.error("jla is not importable")

  def loss(q, k, v, a, b):
    o = attention(q, k, v, a, b)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  step = jax.jit(loss if args.forward  # o formed, as benchmark.py's step
                 else jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  for _ in range(2):
    jax.block_until_ready(step(q, k, v, a, b))


if __name__ == "__main__":
  main()
