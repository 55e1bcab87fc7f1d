"""The decoding step: one token of the gated delta rule in one kernel.

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


def _per_row(ref, dtype):
  """A per-head value ``[1]`` as a scalar, or ``[D]`` as a column ``[D, 1]``."""
  x = ref[...][:, None] if ref.shape[0] > 1 else ref[0]
  return x.astype(dtype)


def _state_block(slot_ref, block_v):
  """The index of this program's ``[K, BV]`` state block in ``s_ref``: the
  whole (blocked) ref, or slot ``state_indices[i]``'s block of the pool
  (slot 0's for a padding row, which then writes nothing)."""
  if slot_ref is None:
    return (...,)
  slot = jnp.maximum(slot_ref[...], 0)
  return (slot, pl.program_id(1), slice(None),
          pl.ds(pl.program_id(2) * block_v, block_v))


def _step_kernel(*, s_ref, slot_ref, q_ref, k_ref, v_ref, a_ref, erase_ref,
                 write_ref, o_ref, new_s_ref, scale, dtype, block_v):
  """``r = w v - S'^T (e k)`` (beta: ``e = w = b``), ``S = S' + k r^T``."""
  at = _state_block(slot_ref, block_v)
  q = q_ref[...].astype(dtype)[:, None] * scale
  k = k_ref[...].astype(dtype)[:, None]
  a = _per_row(a_ref, dtype)
  # A full forget (a at the floor) discards the state by selection, as
  # common.token_step does: a non-finite state does not survive it.
  s = jnp.where(a <= common.LOG_DECAY_FLOOR, 0,
                s_ref[at].astype(dtype)) * jnp.exp(common.floored(a))
  prediction = jnp.sum(s * (_per_row(erase_ref, dtype) * k), axis=0)
  write = (write_ref[...] if write_ref.shape[0] > 1 else write_ref[0])
  residual = write.astype(dtype) * v_ref[...].astype(dtype) - prediction
  # o = q^T (S + k r^T) = q^T S + (q . k) r: both reductions read the decayed
  # state, so neither waits for the other.
  o = jnp.sum(q * s, axis=0) + jnp.sum(q * k) * residual
  new_s = (s + k * residual[None, :]).astype(new_s_ref.dtype)
  if slot_ref is None:
    o_ref[...] = o.astype(o_ref.dtype)
    new_s_ref[...] = new_s
    return
  real = slot_ref[...] >= 0
  o_ref[...] = jnp.where(real, o, 0).astype(o_ref.dtype)

  @pl.when(real)
  def _():
    new_s_ref[at] = new_s


def _launch(state, state_indices, q, k, v, a, erase, write, *, scale, dtype,
            config):
  """The kernel on padded inputs: a ``[B, HV, W]``, erase ``[B, HV, 1]`` or
  ``[B, HV, K]``, write ``[B, HV, 1]`` or ``[B, HV, V]``; ``state``
  ``[B, HV, K, V]``, or a pool ``[P, HV, K, V]`` with ``state_indices``."""
  bsz, heads, dv = v.shape
  dk = q.shape[2]
  groups = heads // q.shape[1]
  bv = min(dv, config.step.block_v)
  head = core.block(None, None, dk)(
      lambda i, j, n: (i, core.qk_head(j, groups), 0))
  cols = core.block(None, None, bv)(lambda i, j, n: (i, j, n))
  if state_indices is None:
    tile = core.block(None, None, dk, bv)(lambda i, j, n: (i, j, 0, n))
    slots = None
  else:  # the whole pool; the kernel indexes its slot's block
    tile = core.block(*state.shape)(lambda i, j, n: (0, 0, 0, 0))
    slots = (state_indices.astype(jnp.int32),
             core.block(None)(lambda i, j, n: (i,)))
  return core.call(
      _step_kernel, grid=(bsz, heads, dv // bv),
      inputs=dict(
          s_ref=(state, tile), slot_ref=slots or (None, None),
          q_ref=(q, head), k_ref=(k, head), v_ref=(v, cols),
          a_ref=(a, core.block(None, None, a.shape[2])(
              lambda i, j, n: (i, j, 0))),
          erase_ref=(erase, core.block(None, None, erase.shape[2])(
              lambda i, j, n: (i, j, 0))),
          write_ref=(write, cols if write.shape[2] > 1 else core.block(
              None, None, 1)(lambda i, j, n: (i, j, 0)))),
      outputs=dict(o_ref=(jax.ShapeDtypeStruct(v.shape, v.dtype), cols),
                   new_s_ref=(jax.ShapeDtypeStruct(state.shape, state.dtype),
                              tile)),
      aliases=dict(s_ref="new_s_ref"), launch=config.step,
      interpret=bool(config.interpret), name="deltajax_step", scale=scale,
      dtype=jnp.dtype(dtype), block_v=bv)


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
  pk, pv = core.padded_dim(dk), core.padded_dim(dv)
  a = a[..., None] if a.ndim == 2 else common.pad_axis(a, 2, pk)
  erase, write = ((common.pad_axis(b[0], 2, pk), common.pad_axis(b[1], 2, pv))
                  if isinstance(b, tuple) else (b[..., None],) * 2)
  o, new_state = _launch(
      common.pad_axis(common.pad_axis(state, 2, pk), 3, pv), state_indices,
      *(common.pad_axis(x, 2, pk) for x in (q, k)), common.pad_axis(v, 2, pv),
      a, erase, write, scale=scale, dtype=dtype, config=config)
  if supported(dk, dv):
    return o, new_state
  return o[..., :dv], new_state[:, :, :dk, :dv]
