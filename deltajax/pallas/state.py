"""The state scan over chunks, forward and backward: the only sequential kernels.

One program per (batch, value head, V block) walks the chunks with the state
``[K, BV]`` in registers, in float32. Only what depends on the carried state
stays on this path (ANCHORS: the sequential path is latency-bound): forward,
``Delta`` and the state update; backward, the state cotangent.

A per-channel gate comes as decayed keys and queries (``K e^g``, ``K e^{g_C -
g}``, ``Q e^g``, in k's dtype, from :func:`intra.chunk_gates`, parallel over
chunks: the scans take no ``[C, K]`` exponentials) and decays the state's rows
by ``e^{g_C}`` (``[K]``, :func:`core.on_state`); a scalar gate's per-token
decays scale the products' rows (:func:`core.decayed_dot`).

Optional inputs, each a static branch (none of their work without them):
``cuts`` (the chunk-local cumulative cut count: the decays of :mod:`core` are
0 across a cut) and ``chunk_seq`` (packed sequences, B = 1: chunk m belongs to
sequence ``chunk_seq[m]``; the state entering a sequence's first chunk is its
initial state, its final state is the one leaving its last chunk; backward,
the final state's cotangent enters at the last chunk and the carried
cotangent leaves at the first chunk as the initial state's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core


def _boundaries(seq_ref, n, n_chunks):
  """``(sequence of chunk n, whether n is its first chunk, its last chunk)``."""
  seq = seq_ref[n]
  first = (n == 0) | (seq_ref[jnp.maximum(n - 1, 0)] != seq)
  last = (n == n_chunks - 1) | (seq_ref[jnp.minimum(n + 1, n_chunks - 1)]
                                != seq)
  return seq, first, last


def _cut_tiles(cuts_ref, n, c):
  """The chunk's cut counts and the count at its end (None without cuts)."""
  if cuts_ref is None:
    return None, None
  return cuts_ref[pl.ds(n * c, c)], cuts_ref[n * c + c - 1]


def _gate_at(g_ref, idx, ks, acc):
  """The gate at ``idx`` (tokens): ``[...]`` for a scalar gate, ``[..., k]``
  (the channels ``ks``) for a per-channel one."""
  return (g_ref[idx, ks] if len(g_ref.shape) == 2 else g_ref[idx]).astype(acc)


def _scalar_gate_keys(g_ref, k_ref, n, c, cuts, cuts_end, dot):
  """Chunk n's keys under a scalar gate: ``(X -> (K e^g) X, X -> (K e^{g_C -
  g})^T X, e^{g_C})``, the per-token decays applied to the products' rows."""
  rows = pl.ds(n * c, c)
  acc = core.accumulator(k_ref.dtype)
  g = g_ref[rows].astype(acc)
  g_end = g_ref[n * c + c - 1].astype(acc)
  k = k_ref[rows, :]
  e_in, e_out = core.from_start(g, cuts), core.to_end(g, g_end, cuts, cuts_end)
  return (lambda x: core.decayed_dot(e_in, k, x, dot),
          lambda x: core.decayed_dot_t(e_out, k, x, dot),
          core.over_chunk(g_end, cuts_end))


def _forward_kernel(*, t_ref, k_ref, v_ref, g_ref, b_ref, cuts_ref, seq_ref,
                    s0_ref, kg_ref, kd_ref, delta_ref, states_ref, final_ref,
                    chunk_size, block_k, dot):
  """A per-channel gate comes as its decayed keys ``K e^g`` (kg) and ``K
  e^{g_C - g}`` (kd); the state is then carried by blocks of ``block_k`` key
  channels (a tuple of ``[k, BV]``)."""
  c = chunk_size
  n_chunks = v_ref.shape[0] // c
  dtype, acc = v_ref.dtype, final_ref.dtype
  dk = final_ref.shape[-2]
  k_blocks = core.blocks(dk, dk if kg_ref is None else block_k)

  def keys(n, rows, cuts, cuts_end):
    """Per key block: ``(X -> (K e^g) X, X -> (K e^{g_C-g})^T X, e^{g_C})``."""
    if kg_ref is None:
      return [_scalar_gate_keys(g_ref, k_ref, n, c, cuts, cuts_end, dot)]
    return [(lambda x, ks=ks: dot(kg_ref[rows, ks], x.astype(dtype)),
             lambda x, ks=ks: dot(kd_ref[rows, ks], x.astype(dtype),
                                  trans_a=True),
             core.over_chunk(_gate_at(g_ref, n * c + c - 1, ks, acc),
                             cuts_end)) for ks in k_blocks]

  def chunk(n, s):
    rows = pl.ds(n * c, c)
    if seq_ref is not None:
      seq, first, last = _boundaries(seq_ref, n, n_chunks)
      s = lax.cond(first, lambda: tuple(s0_ref[seq, ks, :].astype(acc)
                                        for ks in k_blocks), lambda: s)
    for ks, s_k in zip(k_blocks, s):
      states_ref[n, ks, :] = s_k.astype(states_ref.dtype)
    beta = b_ref[rows].astype(acc)
    per_block = keys(n, rows, *_cut_tiles(cuts_ref, n, c))
    # Delta = U - W S = T diag(b) (V - (K e^g) S): W and U are never formed.
    y = v_ref[rows, :].astype(acc)
    for (from_start, _, _), s_k in zip(per_block, s):
      y -= from_start(s_k)
    delta = dot(t_ref[rows, :], (beta[:, None] * y).astype(dtype))
    delta_ref[rows, :] = delta.astype(delta_ref.dtype)
    s = tuple(core.on_state(decay) * s_k + to_end(delta)
              for (_, to_end, decay), s_k in zip(per_block, s))
    if seq_ref is not None:
      @pl.when(last)
      def _():
        for ks, s_k in zip(k_blocks, s):
          final_ref[seq, ks, :] = s_k
    return s

  if seq_ref is None:
    final = lax.fori_loop(0, n_chunks, chunk, tuple(
        s0_ref[ks, :].astype(acc) for ks in k_blocks))
    for ks, s_k in zip(k_blocks, final):
      final_ref[ks, :] = s_k
  else:
    lax.fori_loop(0, n_chunks, chunk, tuple(
        jnp.zeros((ks.size, final_ref.shape[-1]), acc) for ks in k_blocks))


def _backward_kernel(*, q_ref, k_ref, w_ref, g_ref, cuts_ref, seq_ref, do_ref,
                     dd_ref, dfinal_ref, qg_ref, kd_ref, d_delta_ref,
                     d_next_ref, d_initial_ref, chunk_size, scale, block_k,
                     dot):
  """A per-channel gate comes as ``Q e^g`` (qg) and ``K e^{g_C - g}`` (kd);
  the state cotangent is then carried by blocks of ``block_k`` key
  channels."""
  c = chunk_size
  n_chunks = w_ref.shape[0] // c
  dtype, acc = w_ref.dtype, d_initial_ref.dtype
  dk = w_ref.shape[1]
  decayed = qg_ref is not None
  k_blocks = core.blocks(dk, block_k if decayed else dk)

  def load(n):
    """Chunk n's tiles per key block: ``(queries, keys, w, gate, gate at the
    chunk's end)``, the queries and keys decayed (and no gate) per channel."""
    rows, end = pl.ds(n * c, c), n * c + c - 1
    if decayed:
      per_block = tuple((qg_ref[rows, ks], kd_ref[rows, ks], w_ref[rows, ks],
                         None, _gate_at(g_ref, end, ks, acc))
                        for ks in k_blocks)
    else:
      per_block = ((q_ref[rows, :], k_ref[rows, :], w_ref[rows, :],
                    g_ref[rows].astype(acc), g_ref[end].astype(acc)),)
    return (per_block, do_ref[rows, :], dd_ref[rows, :],
            _cut_tiles(cuts_ref, n, c))

  def chunk(i, carry):
    # The previous chunk's tiles are loaded before this chunk's products, so
    # their latency is hidden (measured faster than Triton's pipelining here,
    # but slower in the forward scan).
    ds, (per_block, d_o, dd, (cuts, cuts_end)) = carry
    n = n_chunks - 1 - i
    next_tiles = load(jnp.maximum(n - 1, 0))
    if seq_ref is not None:
      seq, first, last = _boundaries(seq_ref, n, n_chunks)
      ds = lax.cond(last, lambda: tuple(dfinal_ref[seq, ks, :].astype(acc)
                                        for ks in k_blocks), lambda: ds)
    for ks, ds_k in zip(k_blocks, ds):
      d_next_ref[n, ks, :] = ds_k.astype(d_next_ref.dtype)
    d_delta = dd
    for (_, k, _, g, g_end), ds_k in zip(per_block, ds):
      d_delta += (dot(k, ds_k.astype(dtype)) if decayed else
                  core.decayed_dot(core.to_end(g, g_end, cuts, cuts_end), k,
                                   ds_k, dot))
    d_delta_ref[pl.ds(n * c, c), :] = d_delta

    def read(q, g):
      """``(scale Q e^g)^T dO``."""
      if decayed:
        return scale * dot(q, d_o.astype(dtype), trans_a=True)
      return dot((q.astype(acc) * core.on_keys(
          scale * core.from_start(g, cuts))).astype(dtype),
                 d_o.astype(dtype), trans_a=True)
    ds = tuple(
        read(q, g) + core.on_state(core.over_chunk(g_end, cuts_end)) * ds_k
        - dot(w, d_delta.astype(dtype), trans_a=True)
        for (q, _, w, g, g_end), ds_k in zip(per_block, ds))
    if seq_ref is not None:
      @pl.when(first)
      def _():
        for ks, ds_k in zip(k_blocks, ds):
          d_initial_ref[seq, ks, :] = ds_k
    return ds, next_tiles

  ds0 = (tuple(dfinal_ref[ks, :].astype(acc) for ks in k_blocks)
         if seq_ref is None else
         tuple(jnp.zeros((ks.size, d_initial_ref.shape[-1]), acc)
               for ks in k_blocks))
  ds, _ = lax.fori_loop(0, n_chunks, chunk, (ds0, load(n_chunks - 1)))
  if seq_ref is None:
    for ks, ds_k in zip(k_blocks, ds):
      d_initial_ref[ks, :] = ds_k


def _pipeline_stages(stage_bytes, most=3, budget=176 * 1024):
  """Pipeline depth for a chunk loop: Triton keeps one copy of each step's
  loaded tiles per stage in shared memory (232 KB on the H200; the rest of
  the kernel took 32 KB at K = 256)."""
  return max(1, min(most, budget // stage_bytes))


def _scan_specs(bsz, t_len, heads, groups, dk, bv, n_chunks, n_seq, g):
  """BlockSpec makers for grid ``(B, HV, V blocks)``: whole sequences."""
  seq = lambda d: core.block(None, t_len, None, d)
  specs = dict(
      g=core.gate_spec(g, t_len, lambda i, j, x: (i, j, 0)),
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


def forward_scan(*, t, k, v, g, b, cuts, chunk_seq, initial_state, chunk_size,
                 launch, interpret, dot, decayed=None):
  """``Delta = T diag(b) (V - e^g K S)`` (= ``U - W S``) and
  ``S' = e^{g_C} S + (K e^{g_C - g})^T Delta``, chunk by chunk (per
  channel, ``e^{g_C}`` decays the rows of ``S [K, V]``).

  Args:
    t: ``[B, HV, T, C]`` from :func:`ut.inverse`; k: ``[B, T, H, K]``;
    v: ``[B, T, HV, V]``; g: ``[B, HV, T]`` (``[B, HV, T, K]`` per channel);
    b: ``[B, HV, T]``; cuts: ``[B, HV, T]`` int32 or None; chunk_seq: ``[T /
    C]`` int32 or None (then B = 1); initial_state: ``[N, HV, K, V]`` float32
    (float64 in interpret mode), N = B without chunk_seq; decayed: for a
    per-channel gate, ``(K e^g, K e^{g_C - g})``, ``[B, T, HV, K]`` in k's
    dtype (:func:`intra.chunk_gates`; k itself is then not read).

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
    num_stages = _pipeline_stages(c * (c + key_tiles * dk + bv)
                                  * k.dtype.itemsize)
  launch = core.Launch(num_warps=launch.num_warps, num_stages=num_stages,
                       block_k=launch.block_k)
  sp = _scan_specs(bsz, t_len, heads, heads // h, dk, bv, n,
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
      chunk_size=c, block_k=launch.block_k or dk, dot=dot)


def backward_scan(*, q, k, w, g, cuts, chunk_seq, d_o, d_delta_local,
                  d_final, chunk_size, scale, launch, interpret, dot,
                  decayed=None):
  """Reverse scan for the state cotangent.

  With ``dS`` the cotangent of a chunk's exit state::

    dDelta = dDelta_local + (K e^{g_C - g}) dS
    dS_in  = (scale Q e^g)^T dO + e^{g_C} dS - W^T dDelta

  Args:
    q, k: ``[B, T, H, K]``; w: ``[B, T, HV, K]``; g: ``[B, HV, T]`` or
    ``[B, HV, T, K]``; cuts: ``[B, HV, T]`` int32 or None; chunk_seq: ``[T /
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
  sp = _scan_specs(bsz, t_len, heads, heads // h, dk, bv, n,
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
      launch=launch, interpret=interpret, name="deltajax_state_backward",
      chunk_size=chunk_size, scale=scale, block_k=launch.block_k or dk,
      dot=dot)
