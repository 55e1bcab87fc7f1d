"""Decoding speed against the bytes-moved floor: the step, a pool, verify.

    python -m benchmarks.decode [--gates gdn kda] [--batches 1 4 16 64 256]
        [--impls auto pallas] [--bandwidth TB_PER_S] [--out DIR]

For each gate, state dtype (float32, bfloat16) and batch B (H = 16, K = V =
128, bf16 q/k/v, :func:`benchmark.make_inputs`' gates): microseconds per
token of :func:`deltajax.gated_delta_step` in a jitted loop of 100 tokens
with the state carried (:func:`benchmark.time_decode_step`), per ``--impls``
entry, with the same from a pool of 4 B states at random slots
(``state_indices``) and per :func:`deltajax.gated_delta_verify` call of T =
4 draft tokens, chained on its last state; and the step's floor: the bytes it
must move (the state read and written, the token's q, k, v, gates and
output) over the GPU's memory bandwidth. Prints a markdown table and writes
it to ``decode.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os

import jax
import jax.numpy as jnp

import deltajax
from benchmarks import benchmark

HEADS, DIM, VERIFY_TOKENS = 16, 128, 4
# Peak memory bandwidth (bytes/s) by device kind: the floor's denominator.
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def bandwidth(device_kind: str) -> float | None:
  """Bytes per second of ``device_kind``'s memory, or None if unknown."""
  return next((bw for name, bw in BANDWIDTH.items() if name in device_kind),
              None)


def step_bytes(bsz, gate="gdn", state_dtype=jnp.float32, h=HEADS, d=DIM):
  """The bytes one decoding step must move: the state ``[B, H, K, V]`` read
  and written, q, k, v and o in bf16, the float32 gates."""
  state = 2 * bsz * h * d * d * jnp.dtype(state_dtype).itemsize
  tokens = 4 * bsz * h * d * 2  # q, k, v, o
  gates = {"gdn": 2, "kda": d + 1, "gdn2": 3 * d}[gate] * bsz * h * 4
  return state + tokens + gates


def time_verify(bsz, gate="gdn", impl="auto", state_dtype=jnp.float32,
                calls=25, reps=20, h=HEADS, d=DIM, t=VERIFY_TOKENS):
  """Microseconds per :func:`deltajax.gated_delta_verify` call of ``t``
  tokens, ``calls`` of them in a jitted loop, each from the last state of
  the one before."""
  q, k, v, a, b, _ = benchmark.make_inputs((bsz, t, h, d), seed=3, gate=gate)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  a, b = jax.tree.map(jnp.asarray, (a, b))
  b, w = b if gate == "gdn2" else (b, None)

  @jax.jit
  def verify(state):
    def call(_, carry):
      state, acc = carry
      o, states = deltajax.gated_delta_verify(state, q, k, v, a, b, w=w,
                                                impl=impl)
      return states[:, -1], acc + o[:, -1, :, 0].astype(jnp.float32)
    return jax.lax.fori_loop(0, calls, call,
                             (state, jnp.zeros((bsz, h), jnp.float32)))

  state = jnp.zeros((bsz, h, d, d), state_dtype)
  return benchmark.median_ms(lambda: verify(state), reps) * 1e3 / calls


def rows(gates, batches, impls, reps):
  """One dict per gate, state dtype and batch."""
  for gate in gates:
    for state_dtype in (jnp.float32, jnp.bfloat16):
      for bsz in batches:
        row = dict(gate=gate, state=jnp.dtype(state_dtype).name, bsz=bsz,
                   bytes=step_bytes(bsz, gate, state_dtype))
        for impl in impls:
          row[impl] = benchmark.time_decode_step(
              bsz, HEADS, DIM, gate=gate, impl=impl, state_dtype=state_dtype,
              reps=reps)
          row[f"pool {impl}"] = benchmark.time_decode_step(
              bsz, HEADS, DIM, gate=gate, impl=impl, state_dtype=state_dtype,
              pool=4, reps=reps)
          row[f"verify {impl}"] = time_verify(bsz, gate, impl, state_dtype,
                                              reps=reps)
        benchmark.log(str(row))
        yield row


def table(rows, impls, peak) -> str:
  """Markdown: us per step, per step from a pool and per verify call, by
  implementation; the first implementation's pool and verify over its
  step; and the floor (bytes / ``peak``) with that step as a multiple of
  it."""
  cols = [f"{kind}{i}" for i in impls for kind in ("", "pool ", "verify ")]
  names = [f"{kind} {i} (us)" for i in impls
           for kind in ("step", "pool 4B", f"verify T={VERIFY_TOKENS}")]
  head = ("| gate | state | B | " + " | ".join(names)
          + " | pool / step | verify / step | MiB moved | floor (us) "
          "| step / floor |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  first = impls[0]
  for r in rows:
    floor = r["bytes"] / peak * 1e6 if peak else None
    cells = [r["gate"], r["state"], str(r["bsz"]),
             *(f"{r[c]:.1f}" for c in cols),
             f"{r['pool ' + first] / r[first]:.2f}",
             f"{r['verify ' + first] / r[first]:.2f}",
             f"{r['bytes'] / 2 ** 20:.2f}",
             f"{floor:.1f}" if floor else "",
             f"{r[first] / floor:.2f}" if floor else ""]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gates", nargs="*", default=("gdn", "kda"),
                      choices=("gdn", "kda", "gdn2"))
  parser.add_argument("--batches", nargs="*", type=int,
                      default=(1, 4, 16, 64, 256))
  parser.add_argument("--impls", nargs="*", default=("auto",),
                      choices=deltajax.api.STEP_IMPLEMENTATIONS)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--bandwidth", type=float, default=None,
                      help="memory bandwidth in TB/s (default: by device)")
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  args = parser.parse_args()
  kind = jax.devices()[0].device_kind
  peak = args.bandwidth * 1e12 if args.bandwidth else bandwidth(kind)
  results = list(rows(args.gates, args.batches, args.impls, args.reps))
  text = (f"{kind}, {datetime.date.today()}, JAX {jax.__version__}; H = "
          f"{HEADS}, K = V = {DIM}, bf16 q/k/v; median of {args.reps} "
          f"samples (benchmark.median_ms); floor at "
          f"{peak / 1e12 if peak else '?'} TB/s\n\n"
          + table(results, args.impls, peak))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "decode.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
