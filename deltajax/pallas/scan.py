"""The forward state scan over chunks: the forward's only sequential kernel.

One program per (batch, value head, V block) walks the chunks with the state
``[K, BV]`` in registers, in float32. Only what depends on the carried state
stays on this path (the sequential path is latency-bound): ``Delta`` and the
state update. The reverse pass (:mod:`reverse`) walks the chunks the same
way for the state cotangent, with this module's helpers (:func:`boundaries`,
:func:`cut_tiles`, :func:`entered`, :func:`scan_specs`).

A per-channel gate comes as decayed keys and queries (``K e^g``, ``K e^{g_C -
g}``, ``Q e^g``, in k's dtype, from :func:`intra.forward` or
:func:`intra.chunk_gates`, parallel over chunks: the scans take no ``[C, K]``
exponentials) with the gate at each chunk's end, and decays the state's rows
by ``e^{g_C}`` (``[K]``, :func:`core.on_state`); a scalar gate's per-token
decays scale the products' rows (:func:`core.decayed_dot`).

Optional inputs, each a static branch (none of their work without them):
``cuts`` (the chunk-local cumulative cut count: the decays of :mod:`core` are
0 across a cut; a cut at a chunk's first token discards the state by
selection, :func:`entered`) and ``chunk_seq`` (packed sequences, B = 1:
chunk m belongs to sequence ``chunk_seq[m]``; the state entering a
sequence's first chunk is its initial state, its final state is the one
leaving its last chunk).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core


def boundaries(seq_ref, n, n_chunks):
  """``(sequence of chunk n, whether n is its first chunk, its last chunk)``."""
  seq = seq_ref[n]
  first = (n == 0) | (seq_ref[jnp.maximum(n - 1, 0)] != seq)
  last = (n == n_chunks - 1) | (seq_ref[jnp.minimum(n + 1, n_chunks - 1)]
                                != seq)
  return seq, first, last


def cut_tiles(cuts_ref, n, c):
  """The chunk's cut counts ``[C]`` and the counts at its first and last
  token (None without cuts)."""
  if cuts_ref is None:
    return None, None, None
  return (cuts_ref[pl.ds(n * c, c)], cuts_ref[n * c],
          cuts_ref[n * c + c - 1])


def entered(s, cuts_first):
  """The state a chunk uses: 0 where a cut at its first token discards it,
  by selection (NaN * 0 is NaN: a non-finite state does not cross the
  cut); backward, the cotangent that leaves the chunk for its entry state.

  A cut inside a chunk still multiplies the state by zero decays: Delta =
  T diag(b) (V - (K e^g) S) mixes the tokens on both sides of the cut in
  one product with T, whose zeros across the cut do not stop a non-finite
  value."""
  return s if cuts_first is None else jnp.where(cuts_first > 0, 0, s)


def _keys(g_ref, k_ref, kg_ref, kd_ref, n, c, cuts, cuts_end, dot):
  """Chunk n's keys: ``(X -> (K e^g) X, X -> (K e^{g_C - g})^T X, e^{g_C})``.
  A per-channel gate's keys come decayed (kg, kd; ``e^{g_C}`` is ``[K]``); a
  scalar gate's per-token decays scale the products' rows."""
  rows, end = pl.ds(n * c, c), n * c + c - 1
  acc = core.accumulator(g_ref.dtype)
  if kg_ref is not None:
    g_end = g_ref[n, :].astype(acc)
    dtype = kg_ref.dtype
    return (lambda x: dot(kg_ref[rows, :], x.astype(dtype)),
            lambda x: dot(kd_ref[rows, :], x.astype(dtype), trans_a=True),
            core.over_chunk(g_end, cuts_end))
  g, g_end = g_ref[rows].astype(acc), g_ref[end].astype(acc)
  k = k_ref[rows, :]
  e_in, e_out = core.from_start(g, cuts), core.to_end(g, g_end, cuts, cuts_end)
  return (lambda x: core.decayed_dot(e_in, k, x, dot),
          lambda x: core.decayed_dot_t(e_out, k, x, dot),
          core.over_chunk(g_end, cuts_end))


def _forward_kernel(*, t_ref, k_ref, v_ref, g_ref, b_ref, cuts_ref, seq_ref,
                    s0_ref, kg_ref, kd_ref, delta_ref, states_ref, final_ref,
                    chunk_size, dot):
  """A per-channel gate comes as its decayed keys ``K e^g`` (kg) and ``K
  e^{g_C - g}`` (kd), and k_ref is None."""
  c = chunk_size
  n_chunks = v_ref.shape[0] // c
  dtype, acc = v_ref.dtype, final_ref.dtype

  def chunk(n, s):
    rows = pl.ds(n * c, c)
    if seq_ref is not None:
      seq, first, last = boundaries(seq_ref, n, n_chunks)
      s = lax.cond(first, lambda: s0_ref[seq].astype(acc), lambda: s)
    cuts, cuts_first, cuts_end = cut_tiles(cuts_ref, n, c)
    s = entered(s, cuts_first)
    states_ref[n] = s.astype(states_ref.dtype)
    beta = b_ref[rows].astype(acc)
    from_start, to_end, decay = _keys(g_ref, k_ref, kg_ref, kd_ref, n, c,
                                      cuts, cuts_end, dot)
    # Delta = U - W S = T diag(b) (V - (K e^g) S): W and U are never formed.
    y = v_ref[rows, :].astype(acc) - from_start(s)
    delta = dot(t_ref[rows, :], (beta[:, None] * y).astype(dtype))
    delta_ref[rows, :] = delta.astype(delta_ref.dtype)
    s = core.on_state(decay) * s + to_end(delta)
    if seq_ref is not None:
      @pl.when(last)
      def _():
        final_ref[seq] = s
    return s

  if seq_ref is None:
    final_ref[...] = lax.fori_loop(0, n_chunks, chunk,
                                   s0_ref[...].astype(acc))
  else:
    lax.fori_loop(0, n_chunks, chunk, jnp.zeros(final_ref.shape[-2:], acc))


def _pipeline_stages(stage_bytes, most=3, budget=176 * 1024):
  """Pipeline depth for a chunk loop: Triton keeps one copy of each step's
  loaded tiles per stage in shared memory (232 KB on the H200; the rest of
  the kernel took 32 KB at K = 256)."""
  return max(1, min(most, budget // stage_bytes))


def scan_specs(bsz, t_len, heads, groups, dk, bv, n_chunks, n_seq, g):
  """BlockSpec makers for grid ``(B, HV, V blocks)``: whole sequences."""
  seq = lambda d: core.block(None, t_len, None, d)
  specs = dict(
      g=core.gate_spec(g, g.shape[2], lambda i, j, x: (i, j, 0)),
      qk=seq(dk)(lambda i, j, x: (i, 0, core.qk_head(j, groups), 0)),
      keys=seq(dk)(lambda i, j, x: (i, 0, j, 0)),
      vals=seq(bv)(lambda i, j, x: (i, 0, j, x)),
      gate=core.block(None, None, t_len)(lambda i, j, x: (i, j, 0)),
      states=core.block(None, None, n_chunks, dk, bv)(
          lambda i, j, x: (i, j, 0, 0, x)),
      chunk_seq=core.block(n_chunks)(lambda i, j, x: (0,)))
  if n_seq is None:   # one state per batch row
    specs["state"] = core.block(None, None, dk, bv)(
        lambda i, j, x: (i, j, 0, x))
  else:               # the table of all sequences' states
    specs["state"] = core.block(n_seq, None, dk, bv)(
        lambda i, j, x: (0, j, 0, x))
  return specs


def forward(*, t, k, v, g, b, cuts, chunk_seq, initial_state, chunk_size,
            launch, interpret, dot, decayed=None):
  """``Delta = T diag(b) (V - e^g K S)`` (= ``U - W S``) and
  ``S' = e^{g_C} S + (K e^{g_C - g})^T Delta``, chunk by chunk (per
  channel, ``e^{g_C}`` decays the rows of ``S [K, V]``).

  Args:
    t: ``[B, HV, T, C]`` from :func:`ut.inverse`; k: ``[B, T, H, K]``;
    v: ``[B, T, HV, V]``; g: ``[B, HV, T]`` (per channel ``[B, HV, T / C,
    K]``, the gate at each chunk's end);
    b: ``[B, HV, T]``; cuts: ``[B, HV, T]`` int32 or None; chunk_seq: ``[T /
    C]`` int32 or None (then B = 1); initial_state: ``[N, HV, K, V]`` float32
    (float64 in interpret mode), N = B without chunk_seq; decayed: for a
    per-channel gate, ``(K e^g, K e^{g_C - g})``, ``[B, T, HV, K]`` in k's
    dtype (:func:`intra.forward`; k itself is then not read).

  Returns:
    ``(delta [B, T, HV, V] float32 (float64), states [B, HV, T / C, K, V] (each
    chunk's entry state, in k's dtype), final_state [N, HV, K, V])``; with
    chunk_seq, a sequence without chunks has an undefined final state.
  """
  bsz, t_len, h, dk = k.shape
  heads, dv = v.shape[2:]
  bv, c = min(dv, launch.block_v), chunk_size
  n = t_len // c
  acc = initial_state.dtype
  num_stages = launch.num_stages
  if num_stages is None:  # T, V and key tiles of one chunk
    key_tiles = 1 if decayed is None else 2
    # With more programs than multiprocessors, two stages let two programs
    # share one; three stages are faster with one program per
    # multiprocessor (on the H200: benchmarks/RESULTS.md).
    sms = core.multiprocessors()
    crowded = sms is not None and bsz * heads * (dv // bv) > sms
    num_stages = _pipeline_stages(
        c * (c + key_tiles * dk + bv) * k.dtype.itemsize,
        most=2 if crowded else 3)
  launch = core.Launch(num_warps=launch.num_warps, num_stages=num_stages)
  sp = scan_specs(bsz, t_len, heads, heads // h, dk, bv, n,
                   None if chunk_seq is None else initial_state.shape[0], g)
  kg, kd = decayed or (None, None)
  return core.call(
      _forward_kernel, grid=(bsz, heads, dv // bv),
      inputs=dict(
          t_ref=(t, core.block(None, None, t_len, c)(
              lambda i, j, x: (i, j, 0, 0))),
          k_ref=(k if decayed is None else None, sp["qk"]),
          v_ref=(v, sp["vals"]), g_ref=(g, sp["g"]),
          b_ref=(b, sp["gate"]), cuts_ref=(cuts, sp["gate"]),
          seq_ref=(chunk_seq, sp["chunk_seq"]),
          s0_ref=(initial_state, sp["state"]),
          kg_ref=(kg, sp["keys"]), kd_ref=(kd, sp["keys"])),
      outputs=dict(
          delta_ref=(jax.ShapeDtypeStruct(v.shape, acc), sp["vals"]),
          states_ref=(jax.ShapeDtypeStruct((bsz, heads, n, dk, dv), k.dtype),
                      sp["states"]),
          final_ref=(jax.ShapeDtypeStruct(initial_state.shape, acc),
                     sp["state"])),
      launch=launch, interpret=interpret, name="deltajax_state_forward",
      chunk_size=c, dot=dot)
