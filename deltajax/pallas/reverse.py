"""The reverse state pass over chunks: the backward's only sequential kernel.

One program per (batch, value head, V block) walks the chunks from the last
with the state cotangent ``[K, BV]`` in registers, in float32, as
:func:`scan.forward` walks them forward (its helpers: the chunk boundaries of
packed sequences, the cut tiles, the state entering a chunk, the block
specs). A per-channel gate comes as ``Q e^g`` and ``K e^{g_C - g}``
(:func:`intra.chunk_gates`) with the gate at each chunk's end.

Optional inputs, each a static branch: ``cuts`` and ``chunk_seq`` as in
:mod:`scan`; with ``chunk_seq``, the final state's cotangent enters at a
sequence's last chunk and the carried cotangent leaves at its first chunk as
the initial state's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas import scan


def _backward_kernel(*, q_ref, k_ref, w_ref, g_ref, cuts_ref, seq_ref, do_ref,
                     dd_ref, dfinal_ref, qg_ref, kd_ref, d_delta_ref,
                     d_next_ref, d_initial_ref, chunk_size, scale, dot):
  """A per-channel gate comes as ``Q e^g`` (qg) and ``K e^{g_C - g}`` (kd),
  and q_ref, k_ref are None."""
  c = chunk_size
  n_chunks = w_ref.shape[0] // c
  dtype, acc = w_ref.dtype, d_initial_ref.dtype
  decayed = qg_ref is not None

  def load(n):
    """Chunk n's tiles: ``(queries, keys, w, gate, gate at the chunk's
    end)``, the queries and keys decayed (and no gate) per channel."""
    rows, end = pl.ds(n * c, c), n * c + c - 1
    if decayed:
      tiles = (qg_ref[rows, :], kd_ref[rows, :], w_ref[rows, :], None,
               g_ref[n, :].astype(acc))
    else:
      tiles = (q_ref[rows, :], k_ref[rows, :], w_ref[rows, :],
               g_ref[rows].astype(acc), g_ref[end].astype(acc))
    return (tiles, do_ref[rows, :], dd_ref[rows, :],
            scan.cut_tiles(cuts_ref, n, c))

  def chunk(i, carry):
    # The previous chunk's tiles are loaded before this chunk's products, so
    # their latency is hidden (measured faster than Triton's pipelining here,
    # but slower in the forward scan).
    ds, ((q, k, w, g, g_end), d_o, dd, (cuts, cuts_first, cuts_end)) = carry
    n = n_chunks - 1 - i
    next_tiles = load(jnp.maximum(n - 1, 0))
    if seq_ref is not None:
      seq, first, last = scan.boundaries(seq_ref, n, n_chunks)
      ds = lax.cond(last, lambda: dfinal_ref[seq].astype(acc), lambda: ds)
    d_next_ref[n] = ds.astype(d_next_ref.dtype)
    d_o = d_o.astype(dtype)
    if decayed:
      d_delta = dd + dot(k, ds.astype(dtype))
      read = scale * dot(q, d_o, trans_a=True)
    else:
      d_delta = dd + core.decayed_dot(core.to_end(g, g_end, cuts, cuts_end),
                                      k, ds, dot)
      read = dot((q.astype(acc) * core.on_keys(
          scale * core.from_start(g, cuts))).astype(dtype), d_o, trans_a=True)
    d_delta_ref[pl.ds(n * c, c), :] = d_delta
    # dS_in = (scale Q e^g)^T dO + e^{g_C} dS - W^T dDelta
    ds = scan.entered(
        read + core.on_state(core.over_chunk(g_end, cuts_end)) * ds
        - dot(w, d_delta.astype(dtype), trans_a=True), cuts_first)
    if seq_ref is not None:
      @pl.when(first)
      def _():
        d_initial_ref[seq] = ds
    return ds, next_tiles

  ds0 = (dfinal_ref[...].astype(acc) if seq_ref is None
         else jnp.zeros(d_initial_ref.shape[-2:], acc))
  ds, _ = lax.fori_loop(0, n_chunks, chunk, (ds0, load(n_chunks - 1)))
  if seq_ref is None:
    d_initial_ref[...] = ds


def backward(*, q, k, w, g, cuts, chunk_seq, d_o, d_delta_local, d_final,
             chunk_size, scale, launch, interpret, dot, decayed=None):
  """Reverse scan for the state cotangent.

  With ``dS`` the cotangent of a chunk's exit state::

    dDelta = dDelta_local + (K e^{g_C - g}) dS
    dS_in  = (scale Q e^g)^T dO + e^{g_C} dS - W^T dDelta

  Args:
    q, k: ``[B, T, H, K]``; w: ``[B, T, HV, K]``; g: ``[B, HV, T]`` (per
    channel ``[B, HV, T / C, K]``, the gate at each chunk's end); cuts: ``[B, HV, T]`` int32 or None; chunk_seq: ``[T /
    C]`` int32 or None; d_o: ``[B, T, HV, V]``; d_delta_local: ``[B, T, HV,
    V]`` float32, the output's share of dDelta; d_final: ``[N, HV, K, V]``;
    decayed: for a per-channel gate, ``(Q e^g, K e^{g_C - g})``, ``[B, T,
    HV, K]`` in k's dtype (:func:`intra.chunk_gates`; q and k are then not
    read).

  Returns:
    ``(d_delta [B, T, HV, V], d_next [B, HV, T / C, K, V] in k's dtype,
    d_initial [N, HV, K, V])``; with chunk_seq, a sequence without chunks
    has an undefined d_initial.
  """
  bsz, t_len, h, dk = q.shape
  heads, dv = d_o.shape[2:]
  bv = min(dv, launch.block_v)
  n = t_len // chunk_size
  acc = d_final.dtype
  sp = scan.scan_specs(bsz, t_len, heads, heads // h, dk, bv, n,
                   None if chunk_seq is None else d_final.shape[0], g)
  qg, kd = decayed or (None, None)
  if decayed is not None:
    q = k = None
  return core.call(
      _backward_kernel, grid=(bsz, heads, dv // bv),
      inputs=dict(
          q_ref=(q, sp["qk"]), k_ref=(k, sp["qk"]), w_ref=(w, sp["keys"]),
          g_ref=(g, sp["g"]), cuts_ref=(cuts, sp["gate"]),
          seq_ref=(chunk_seq, sp["chunk_seq"]), do_ref=(d_o, sp["vals"]),
          dd_ref=(d_delta_local, sp["vals"]),
          dfinal_ref=(d_final, sp["state"]),
          qg_ref=(qg, sp["keys"]), kd_ref=(kd, sp["keys"])),
      outputs=dict(
          d_delta_ref=(jax.ShapeDtypeStruct(d_o.shape, acc), sp["vals"]),
          d_next_ref=(jax.ShapeDtypeStruct((bsz, heads, n, dk, dv), w.dtype),
                      sp["states"]),
          d_initial_ref=(jax.ShapeDtypeStruct(d_final.shape, acc),
                         sp["state"])),
      # Chunk n's dDelta_local is read before chunk n's dDelta is written.
      aliases=dict(dd_ref="d_delta_ref"),
      launch=launch, interpret=interpret, name="deltajax_state_backward",
      chunk_size=chunk_size, scale=scale, dot=dot)
