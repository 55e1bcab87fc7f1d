"""Bytes and FLOPs of one ``impl="mosaic"`` Gated DeltaNet step, kernel by
kernel, against the H200's floor.

    python benchmarks/floor.py [--shape B,T,H,D] [--us inverse,scan,...]

Each kernel's HBM traffic is counted from its inputs and outputs (each read
or written once), its FLOPs from its products (2 M N K each), per chunk of
64 tokens, for the per-head gate without grouped value heads; ``--us``
gives measured times (Nsight Compute) in the kernels' order (inverse, scan,
reverse pass, chunk_backward), for the achieved rates. RESULTS.md has the
table at (4, 4096, 16, 128).
"""

from __future__ import annotations

import argparse

BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
TENSOR = 990e12     # dense bf16 FLOP/s
C = 64


def kernels(bsz, t_len, heads, d):
  """``{name: (bytes read, bytes written, FLOPs)}`` of the kernels of one
  default step (the forward saves the chunks' states but no Delta; the
  reverse pass forms W and dDelta_local itself and writes the states'
  cotangents only; ``chunk_backward`` forms every chunk-parallel
  gradient), K = V = d, 16-bit q/k/v, T and the saved
  states in 16 bits."""
  chunks = bsz * heads * t_len // C
  tok = bsz * t_len * heads * d * 2      # [B, T, H, d], 16-bit
  vec = bsz * heads * t_len * 4          # [B, H, T], float32
  t_mat = bsz * heads * t_len * C * 2    # T, 16-bit
  states = chunks * d * d * 2            # a state per chunk, 16-bit
  mm = lambda m, n, k: 2 * m * n * k * chunks
  square, keys = mm(C, C, d), mm(C, d, d)  # [C, C] or [C, d] results
  return {
      "UT inverse (Pallas)": (tok + 2 * vec, t_mat,
                              mm(C, C, d) + mm(C, C, C) // 3),
      # K S, Delta, Q K^T, Q S, P Delta (two passes), the update.
      "scan + output, saving S": (3 * tok + t_mat + 2 * vec, tok + states,
                                  3 * keys + 4 * square),
      # W, K Q^T, P^T dO; K dS, Q^T dO, W^T dDelta.
      "reverse pass (three warpgroups)": (
          3 * tok + t_mat + 2 * vec, states, 3 * keys + 3 * square),
      # WG0: K S, Delta, dP~, dO S^T, dP~ K; WG1: K Q^T, P^T dO, K dS',
      # T^T dDelta, dDelta S^T, Z, dX_k, Z_k, -dM (two passes), K K^T;
      # WG2: Delta dS'^T, dX_k again, dP~^T Q, dE^T K, dE K.
      "chunk_backward": (4 * tok + t_mat + 2 * states + 2 * vec,
                         3 * tok + 2 * vec,
                         5 * keys + 14 * square + 2 * mm(C, C, C)),
  }


def table(shape, times_us=None):
  """The markdown table, with achieved rates where ``times_us`` are given."""
  rows = ["| kernel | MB read + written | GFLOP | floor us | us | TB/s | "
          "TFLOP/s |", "|---|---|---|---|---|---|---|"]
  found = kernels(*shape)
  times_us = times_us or [None] * len(found)
  total = [0, 0, 0, 0]
  for (name, (read, written, flops)), us in zip(found.items(), times_us):
    moved = read + written
    floor = max(moved / BANDWIDTH, flops / TENSOR) * 1e6
    rates = (f"{us} | {moved / us / 1e6:.2f} | {flops / us / 1e6:.0f}"
             if us else "- | - | -")
    rows.append(f"| {name} | {read / 1e6:.0f} + {written / 1e6:.0f} | "
                f"{flops / 1e9:.1f} | {floor:.0f} | {rates} |")
    total = [total[0] + moved, total[1] + flops, total[2] + floor,
             total[3] + (us or 0)]
  moved, flops, floor, us = total
  rates = (f"{us} | {moved / us / 1e6:.2f} | {flops / us / 1e6:.0f}"
           if us else "- | - | -")
  rows.append(f"| all | {moved / 1e6:.0f} | {flops / 1e9:.1f} | "
              f"{floor:.0f} | {rates} |")
  bsz, t_len, heads, d = shape
  own = 8 * bsz * t_len * heads * d * 2  # q, k, v, o, dO, dq, dk, dv
  rows.append(f"\nThe op's own HBM traffic: {own / 1e6:.0f} MB, "
              f"{own / BANDWIDTH * 1e6:.0f} us.")
  return "\n".join(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--us", default=None,
                      help="measured us per kernel, comma-separated")
  args = parser.parse_args()
  shape = tuple(int(x) for x in args.shape.split(","))
  times = [float(x) for x in args.us.split(",")] if args.us else None
  print(table(shape, times))


if __name__ == "__main__":
  main()
