"""Decoding kernels: one token of the gated delta rule (the step), and T
draft tokens from one state (speculative decoding's verification).

One program per (batch, value head, V block) reads its ``[K, BV]`` block of
the state ``S^T`` once and writes the decayed, corrected block and the
block's outputs. Columns of ``S^T`` are independent (column ``v`` needs only
its own K entries, ``k``, ``q`` and ``v_v``), so V splits into blocks with no
communication: more programs than the B HV heads (64 at B = 4, H = 16, on
132 SMs of the H100). The new state is written into the old one's buffer
(``input_output_aliases``), in the state's own dtype (computed in the
compute dtype): in place inside a loop, or when the caller donates the
state; otherwise XLA copies the state first.

With ``state_indices`` the state is a pool ``[P, HV, K, V]`` and program
``(i, j, n)`` reads and writes the block of slot ``state_indices[i]``
directly: no gather or scatter of the B slots around the step, so a pooled
step moves the same bytes as a dense one. A negative slot is a padding row:
it writes nothing and outputs zeros.

The verification kernel runs the same programs over a row's T tokens: it
reads its state block once, keeps it in registers across the tokens and
writes the block after each token into ``[B, T, HV, K, V]`` (the state or
pool is only read: the caller commits the accepted state), in one launch
rather than T steps and T copies of the state.

K and V are padded with zeros to :func:`core.padded_dim` (the padding stays
0), which copies the state every step; head dims that need no padding
(:func:`supported`) run on the state as it is.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from deltajax import common
from deltajax.pallas import core


def supported(dk: int, dv: int) -> bool:
  """Whether the kernel runs on a ``[..., K, V]`` state as it is (no padding)."""
  return core.padded_dim(dk) == dk and core.padded_dim(dv) == dv


def _column(x, dtype):
  """A per-head value ``[1]`` as a scalar, or ``[D]`` as a column ``[D, 1]``."""
  x = x.astype(dtype)
  return x[:, None] if x.shape[0] > 1 else x[0]


def _state_block(slot_ref, block_v):
  """The index of this program's ``[K, BV]`` state block in ``s_ref``: the
  whole (blocked) ref, or slot ``state_indices[i]``'s block of the pool
  (slot 0's for a padding row, which then writes nothing)."""
  if slot_ref is None:
    return (...,)
  slot = jnp.maximum(slot_ref[...], 0)
  return (slot, pl.program_id(1), slice(None),
          pl.ds(pl.program_id(2) * block_v, block_v))


def _token(s, q, k, v, a, erase, write, *, scale, dtype):
  """One token on a ``[K, BV]`` block ``s`` of ``S^T`` (in ``dtype``), from
  its ``[K]`` q, k, ``[BV]`` v, ``[1]`` or ``[K]`` a and erase gate, ``[1]``
  or ``[BV]`` write gate: ``(o [BV], new block)``. ``r = w v - S'^T (e
  k)`` (beta: ``e = w = b``), ``S = S' + k r^T``."""
  q = q.astype(dtype)[:, None] * scale
  k = k.astype(dtype)[:, None]
  a = _column(a, dtype)
  # A full forget (a at the floor) discards the state by selection, as
  # common.token_step does: a non-finite state does not survive it.
  s = jnp.where(a <= common.LOG_DECAY_FLOOR, 0, s) * jnp.exp(
      common.floored(a))
  prediction = jnp.sum(s * (_column(erase, dtype) * k), axis=0)
  write = write.astype(dtype) if write.shape[0] > 1 else write[0].astype(
      dtype)
  residual = write * v.astype(dtype) - prediction
  # o = q^T (S + k r^T) = q^T S + (q . k) r: both reductions read the decayed
  # state, so neither waits for the other.
  o = jnp.sum(q * s, axis=0) + jnp.sum(q * k) * residual
  return o, s + k * residual[None, :]


def _step_kernel(*, s_ref, slot_ref, q_ref, k_ref, v_ref, a_ref, erase_ref,
                 write_ref, o_ref, new_s_ref, scale, dtype, block_v):
  """One token; the new block written over the old one."""
  at = _state_block(slot_ref, block_v)
  o, new_s = _token(s_ref[at].astype(dtype), q_ref[...], k_ref[...],
                    v_ref[...], a_ref[...], erase_ref[...], write_ref[...],
                    scale=scale, dtype=dtype)
  new_s = new_s.astype(new_s_ref.dtype)
  if slot_ref is None:
    o_ref[...] = o.astype(o_ref.dtype)
    new_s_ref[...] = new_s
    return
  real = slot_ref[...] >= 0
  o_ref[...] = jnp.where(real, o, 0).astype(o_ref.dtype)

  @pl.when(real)
  def _():
    new_s_ref[at] = new_s


def _verify_kernel(*, s_ref, slot_ref, q_ref, k_ref, v_ref, a_ref, erase_ref,
                   write_ref, o_ref, states_ref, scale, dtype, block_v):
  """The row's T tokens (refs ``[T, ...]``) from one read of its block, the
  block after each token written to ``states_ref`` ``[T, K, BV]`` (zeros
  for a padding row); the state itself is not written."""
  s = s_ref[_state_block(slot_ref, block_v)].astype(dtype)
  real = True if slot_ref is None else slot_ref[...] >= 0
  for t in range(q_ref.shape[0]):  # T is small: speculative drafts
    o, s = _token(s, q_ref[t], k_ref[t], v_ref[t], a_ref[t], erase_ref[t],
                  write_ref[t], scale=scale, dtype=dtype)
    o_ref[t] = jnp.where(real, o, 0).astype(o_ref.dtype)
    states_ref[t] = jnp.where(real, s, 0).astype(states_ref.dtype)


def _launch(state, state_indices, q, k, v, a, erase, write, *, scale, dtype,
            config, states_dtype=None):
  """A kernel on padded inputs, per token ``[B, ...]`` (the step) or ``[B,
  T, ...]`` (verify, with ``states_dtype``, the dtype of the states it
  returns): a ``[..., HV, W]``, erase ``[..., HV, 1]`` or ``[..., HV, K]``,
  write ``[..., HV, 1]`` or ``[..., HV, V]``; ``state`` ``[B, HV, K, V]``,
  or a pool ``[P, HV, K, V]`` with ``state_indices``."""
  dv, dk = v.shape[-1], q.shape[-1]
  bsz, heads = v.shape[0], v.shape[-2]
  groups = heads // q.shape[-2]
  bv = min(dv, config.step.block_v)
  verify = states_dtype is not None
  tokens = (v.shape[1],) if verify else ()

  def per_token(*shape):
    """A spec over a per-token array's block (all T tokens in verify's)."""
    lead = (None, *tokens)
    return lambda index: core.block(*lead, *shape)(
        lambda i, j, n: (i, *(0,) * len(tokens), *index(j, n)))

  head = per_token(None, dk)(lambda j, n: (core.qk_head(j, groups), 0))
  cols = per_token(None, bv)(lambda j, n: (j, n))
  whole = lambda x: per_token(None, x.shape[-1])(lambda j, n: (j, 0))
  if state_indices is None:
    tile = core.block(None, None, dk, bv)(lambda i, j, n: (i, j, 0, n))
    slots = None
  else:  # the whole pool; the kernel indexes its slot's block
    tile = core.block(*state.shape)(lambda i, j, n: (0, 0, 0, 0))
    slots = (state_indices.astype(jnp.int32),
             core.block(None)(lambda i, j, n: (i,)))
  outputs = dict(o_ref=(jax.ShapeDtypeStruct(v.shape, v.dtype), cols))
  if verify:
    outputs["states_ref"] = (
        jax.ShapeDtypeStruct((*v.shape[:-1], dk, dv), states_dtype),
        per_token(None, dk, bv)(lambda j, n: (j, 0, n)))
  else:
    outputs["new_s_ref"] = (jax.ShapeDtypeStruct(state.shape, state.dtype),
                            tile)
  return core.call(
      _verify_kernel if verify else _step_kernel,
      grid=(bsz, heads, dv // bv),
      inputs=dict(
          s_ref=(state, tile), slot_ref=slots or (None, None),
          q_ref=(q, head), k_ref=(k, head), v_ref=(v, cols),
          a_ref=(a, whole(a)), erase_ref=(erase, whole(erase)),
          write_ref=(write, cols if write.shape[-1] > 1 else whole(write))),
      outputs=outputs, aliases=None if verify else dict(s_ref="new_s_ref"),
      launch=config.step, interpret=bool(config.interpret),
      name="deltajax_verify" if verify else "deltajax_step", scale=scale,
      dtype=jnp.dtype(dtype), block_v=bv)


def _padded(state, q, k, v, a, b):
  """The inputs padded to the kernels' head dims, the gates as ``(a,
  erase, write)`` with a trailing axis (size 1 for a per-head value)."""
  pk, pv = (core.padded_dim(d) for d in state.shape[2:])
  last = lambda x, size: common.pad_axis(x, x.ndim - 1, size)
  per_head = a.ndim == q.ndim - 1
  a = a[..., None] if per_head else last(a, pk)
  erase, write = ((last(b[0], pk), last(b[1], pv)) if isinstance(b, tuple)
                  else (b[..., None],) * 2)
  state = common.pad_axis(last(state, pv), 2, pk)
  return state, last(q, pk), last(k, pk), last(v, pv), a, erase, write


def gated_delta_step_pallas(state, q, k, v, a, b, *, scale, state_indices=None,
                            dtype=None, config=None):
  """One decoding step (:func:`common.token_step`) as a Pallas kernel.

  Args:
    state: ``[B, HV, K, V]``; with ``state_indices``, a pool ``[P, HV, K,
      V]``; any float dtype, the new state's (or pool's).
    q, k: ``[B, H, K]``; v: ``[B, HV, V]`` (``HV = G H``, value head ``j``
      reads q/k head ``j // G`` through the index maps); any float dtypes,
      read as they are.
    a: ``[B, HV]`` or ``[B, HV, K]`` log decay, clamped at
      :data:`common.LOG_DECAY_FLOOR` (there a full forget, which discards
      the state's rows); b: ``[B, HV]``, or Gated DeltaNet-2's
      ``(erase [B, HV, K], write [B, HV, V])`` (a per channel).
    scale: Python float multiplying q.
    state_indices: None, or int ``[B]``: row ``i`` steps the pool's slot
      ``state_indices[i]``, negative for a padding row (distinct slots:
      two rows naming one slot race).
    dtype: the compute dtype (None: the state's).
    config: :class:`core.Config` (None: the defaults); its ``step``
      launch sets ``num_warps`` and the V block.

  Returns:
    ``(o [B, HV, V] in v's dtype, new_state)`` (zeros in padding rows' o),
    not differentiable (api differentiates through the jnp step).
  """
  config = (config or core.Config()).resolve()
  dtype = dtype or state.dtype
  dk, dv = state.shape[2:]
  if state_indices is not None and not supported(dk, dv):
    # Padding would copy the pool: pad the B slots' states instead.
    o, rows = gated_delta_step_pallas(
        common.pool_rows(state, state_indices), q, k, v, a, b, scale=scale,
        dtype=dtype, config=config)
    return (common.zero_padding_rows(o, state_indices),
            common.with_pool_rows(state, state_indices, rows))
  padded = _padded(state, q, k, v, a, b)
  o, new_state = _launch(padded[0], state_indices, *padded[1:], scale=scale,
                         dtype=dtype, config=config)
  if supported(dk, dv):
    return o, new_state
  return o[..., :dv], new_state[:, :, :dk, :dv]


def gated_delta_verify_pallas(state, q, k, v, a, b, *, scale,
                              state_indices=None, dtype=None,
                              states_dtype=None, config=None):
  """T tokens of every row from its state in one kernel: speculative
  decoding's verification (:func:`gated_delta_step_pallas` per token, each
  state block read once and kept in registers across the tokens).

  Args:
    state, scale, state_indices, dtype, config: as in
      :func:`gated_delta_step_pallas`; the state (or pool) is read, not
      written.
    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; a: ``[B, T, HV]`` or
      ``[B, T, HV, K]``; b: ``[B, T, HV]`` or Gated DeltaNet-2's ``(erase
      [B, T, HV, K], write [B, T, HV, V])``.
    states_dtype: the dtype of the returned states (None: the state's).

  Returns:
    ``(o [B, T, HV, V] in v's dtype, states [B, T, HV, K, V])``,
    ``states[:, t]`` the state after token ``t``; zeros in padding rows.
    Not differentiable (api differentiates through the jnp step).
  """
  config = (config or core.Config()).resolve()
  dtype = dtype or state.dtype
  states_dtype = jnp.dtype(states_dtype or state.dtype)
  dk, dv = state.shape[2:]
  if state_indices is not None and not supported(dk, dv):
    o, states = gated_delta_verify_pallas(
        common.pool_rows(state, state_indices), q, k, v, a, b, scale=scale,
        dtype=dtype, states_dtype=states_dtype, config=config)
    return (common.zero_padding_rows(o, state_indices),
            common.zero_padding_rows(states, state_indices))
  padded = _padded(state, q, k, v, a, b)
  o, states = _launch(padded[0], state_indices, *padded[1:], scale=scale,
                      dtype=dtype, config=config, states_dtype=states_dtype)
  if supported(dk, dv):
    return o, states
  return o[..., :dv], states[..., :dk, :dv]
