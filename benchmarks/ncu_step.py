"""One step of ``deltajax.gated_delta`` (forward+backward, or forward) for a profiler.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        --log-file $OUT/step.csv python -m benchmarks.ncu_step --gate kda
    python -m benchmarks.ncu_step --summarize $OUT/step.csv

Runs the jitted step three times (compilation and autotuning in the
first), on benchmark.py's inputs. ``--summarize`` reads Nsight Compute's
CSV and prints each kernel's time in the last step: the log's last launches
that repeat the ones before them (the last two steps launch the same
kernels). ``--impl jla`` profiles jla's kernels on the same inputs (where
jla is importable); ``--documents N`` packs N documents into every row, as
benchmark.py's option of that name. ``--decode`` profiles decoding instead:
:func:`benchmark.time_decode_step`'s jitted loop of ``gated_delta_step``
(``--impl`` a step implementation), so the last step is one token's kernels.
"""

from __future__ import annotations

import argparse
import collections
import csv

import jax
import jax.numpy as jnp

from benchmarks.benchmark import deltajax_attention
from benchmarks.benchmark import documents
from benchmarks.benchmark import load_jla
from benchmarks.benchmark import make_inputs
from benchmarks.benchmark import time_decode_step


def last_step(launches):
  """The last step of ``launches`` (a list of ``(kernel, us)``): the
  shortest tail that repeats the launches just before it."""
  names = [name for name, _ in launches]
  for n in range(1, len(names) // 2 + 1):
    if names[-n:] == names[-2 * n:-n]:
      return launches[-n:]
  raise ValueError("the log holds no two identical steps")


def summarize(path):
  """Prints each kernel's time (us) in the last step of an Nsight Compute
  CSV log of ``gpu__time_duration.sum``, slowest first, and the total."""
  with open(path, newline="") as f:
    rows = [r for r in csv.DictReader(line for line in f
                                      if not line.startswith("=="))
            if r.get("Metric Name") == "gpu__time_duration.sum"]
  scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3,
           "ns": 1e-3, "us": 1.0, "ms": 1e3}  # Nsight Compute's old, new
  launches = [(r["Kernel Name"], float(r["Metric Value"].replace(",", ""))
               * scale[r["Metric Unit"]]) for r in rows]
  times = collections.Counter()
  for name, us in last_step(launches):
    times[name] += us
  for name, us in times.most_common():
    print(f"{us:9.1f}  {name[:100]}")
  print(f"{sum(times.values()):9.1f}  total")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--summarize", metavar="CSV", default=None,
                      help="print the last step's kernel times of a log")
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--gate", choices=("gdn", "kda"), default="gdn")
  parser.add_argument("--impl", default="pallas",
                      help='a deltajax implementation, or "jla"')
  parser.add_argument("--forward", action="store_true",
                      help="the forward alone (no gradients)")
  parser.add_argument("--documents", type=int, default=0,
                      help="documents of random lengths packed into each row "
                      "(benchmark.documents)")
  parser.add_argument("--packing", choices=("segment_ids", "cu_seqlens"),
                      default="segment_ids",
                      help="how deltajax takes the --documents")
  parser.add_argument("--decode", action="store_true",
                      help="a jitted loop of decoding steps at --shape's "
                      "B, H, D (T unused)")
  args = parser.parse_args()
  if args.summarize:
    summarize(args.summarize)
    return
  shape = tuple(int(x) for x in args.shape.split(","))
  if args.decode:
    bsz, _, h, d = shape
    time_decode_step(bsz, h, d, steps=4, gate=args.gate, impl=args.impl,
                     reps=1)
    return
  q, k, v, a, b, do = make_inputs(shape, gate=args.gate)
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  a, b = jnp.asarray(a), jnp.asarray(b)

  ids = documents(*shape[:2], args.documents) if args.documents else None
  attention = (load_jla(args.gate, ids) if args.impl == "jla"
               else deltajax_attention(
                   args.impl, args.gate,
                   None if ids is None else (args.packing, ids)))
  if attention is None:
    parser.error("jla is not importable")

  def loss(q, k, v, a, b):
    o = attention(q, k, v, a, b)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  step = jax.jit(loss if args.forward  # o formed, as benchmark.py's step
                 else jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  for _ in range(3):
    jax.block_until_ready(step(q, k, v, a, b))


if __name__ == "__main__":
  main()
