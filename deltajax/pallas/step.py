"""The decoding step: one token of the gated delta rule in one kernel.

One program per (batch, value head, V block) reads its ``[K, BV]`` block of
the state ``S^T`` once and writes the decayed, corrected block and the
block's outputs. Columns of ``S^T`` are independent (column ``v`` needs only
its own K entries, ``k``, ``q`` and ``v_v``), so V splits into blocks with no
communication: more programs than the B HV heads (64 at B = 4, H = 16, on
132 SMs of the H200). The new state is written into the old one's buffer
(``input_output_aliases``): in place inside a loop, or when the caller
donates the state; otherwise XLA copies the state first.

K and V are padded with zeros to :func:`core.padded_dim` (the padding stays
0), which copies the state every step; head dims that need no padding
(:func:`supported`) run on the state as it is.
"""

from __future__ import annotations

import jax
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


def _step_kernel(*, s_ref, q_ref, k_ref, v_ref, a_ref, erase_ref, write_ref,
                 o_ref, new_s_ref, scale):
  """``r = w v - S'^T (e k)`` (beta: ``e = w = b``), ``S = S' + k r^T``."""
  dtype = new_s_ref.dtype
  q = q_ref[...].astype(dtype)[:, None] * scale
  k = k_ref[...].astype(dtype)[:, None]
  a = _per_row(a_ref, dtype)
  # A full forget (a at the floor) discards the state by selection, as
  # common.token_step does: a non-finite state does not survive it.
  s = jnp.where(a <= common.LOG_DECAY_FLOOR, 0,
                s_ref[...].astype(dtype)) * jnp.exp(common.floored(a))
  prediction = jnp.sum(s * (_per_row(erase_ref, dtype) * k), axis=0)
  write = (write_ref[...] if write_ref.shape[0] > 1 else write_ref[0])
  residual = write.astype(dtype) * v_ref[...].astype(dtype) - prediction
  # o = q^T (S + k r^T) = q^T S + (q . k) r: both reductions read the decayed
  # state, so neither waits for the other.
  o = jnp.sum(q * s, axis=0) + jnp.sum(q * k) * residual
  o_ref[...] = o.astype(o_ref.dtype)
  new_s_ref[...] = s + k * residual[None, :]


def _launch(state, q, k, v, a, erase, write, *, scale, config):
  """The kernel on padded inputs: a ``[B, HV, W]``, erase ``[B, HV, 1]`` or
  ``[B, HV, K]``, write ``[B, HV, 1]`` or ``[B, HV, V]``."""
  bsz, heads, dk, dv = state.shape
  groups = heads // q.shape[1]
  bv = min(dv, config.step.block_v)
  head = core.block(None, None, dk)(
      lambda i, j, n: (i, core.qk_head(j, groups), 0))
  cols = core.block(None, None, bv)(lambda i, j, n: (i, j, n))
  tile = core.block(None, None, dk, bv)(lambda i, j, n: (i, j, 0, n))
  return core.call(
      _step_kernel, grid=(bsz, heads, dv // bv),
      inputs=dict(
          s_ref=(state, tile), q_ref=(q, head), k_ref=(k, head),
          v_ref=(v, cols),
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
      interpret=bool(config.interpret), name="deltajax_step", scale=scale)


def gated_delta_step_pallas(state, q, k, v, a, b, *, scale, config=None):
  """One decoding step (:func:`common.token_step`) as a Pallas kernel.

  Args:
    state: ``[B, HV, K, V]`` in the compute dtype (float32, float64 for
      float64 inputs), the dtype of the new state.
    q, k: ``[B, H, K]``; v: ``[B, HV, V]`` (``HV = G H``, value head ``j``
      reads q/k head ``j // G`` through the index maps); any float dtypes,
      read as they are and computed in the state's dtype.
    a: ``[B, HV]`` or ``[B, HV, K]`` log decay, clamped at
      :data:`common.LOG_DECAY_FLOOR` (there a full forget, which discards
      the state's rows); b: ``[B, HV]``, or Gated DeltaNet-2's
      ``(erase [B, HV, K], write [B, HV, V])`` (a per channel).
    scale: Python float multiplying q.
    config: :class:`core.Config` (None: the defaults); its ``step``
      launch sets ``num_warps`` and the V block.

  Returns:
    ``(o [B, HV, V] in v's dtype, new_state)``, not differentiable (api
    differentiates through the jnp step).
  """
  config = (config or core.Config()).resolve()
  dk, dv = state.shape[2:]
  pk, pv = core.padded_dim(dk), core.padded_dim(dv)
  a = a[..., None] if a.ndim == 2 else common.pad_axis(a, 2, pk)
  erase, write = ((common.pad_axis(b[0], 2, pk), common.pad_axis(b[1], 2, pv))
                  if isinstance(b, tuple) else (b[..., None],) * 2)
  o, new_state = _launch(
      common.pad_axis(common.pad_axis(state, 2, pk), 3, pv),
      *(common.pad_axis(x, 2, pk) for x in (q, k)), common.pad_axis(v, 2, pv),
      a, erase, write, scale=scale, config=config)
  if supported(dk, dv):
    return o, new_state
  return o[..., :dv], new_state[:, :, :dk, :dv]
