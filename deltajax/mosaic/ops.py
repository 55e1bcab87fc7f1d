"""``impl="mosaic"``: the Gated DeltaNet forward as Mosaic GPU kernels (Hopper).

Forward: :func:`ut.inverse` (parallel over chunks) -> :func:`scan.forward`
(the state scan and the output fused, sequential over chunks; on one
warpgroup, or with ``specialized=True`` on three). The
products run on the tensor cores with 16-bit operands, so q, k and v must be
16-bit (the registry refuses float32 and float64 ones: ``wide=False``);
gates, beta, the state and every accumulation are float32.

Backward: the Pallas (Triton) backward of :mod:`deltajax.pallas.ops`, with
its reverse state pass in Mosaic GPU (:func:`reverse.backward`) where the
Pallas kernels' padded head dims are 64 or 128. The forward under
differentiation also writes what that backward keeps from its own forward
(``T``, the chunk-entry states, Delta, at those padded head dims), so nothing
is recomputed.

Supported: the per-head gate, ``chunk_size = 64``, head dims up to 128
(zero-padded to 64 or 128), grouped value heads (the kernels read q/k head
``j // G``); not cuts or packed sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deltajax import common
from deltajax.mosaic import compat
from deltajax.mosaic import reverse
from deltajax.mosaic import scan
from deltajax.mosaic import ut
from deltajax.pallas import core as pallas_core
from deltajax.pallas import ops as pallas_ops
from deltajax.pallas import state as pallas_state

MIN_CAPABILITY = (9, 0)
CHUNK = ut.C
MAX_HEAD_DIM = 128


def gated_delta_mosaic(q, k, v, a, b, initial_state, cut, chunk_seq, *,
                       scale, chunk_size, specialized=False):
  """Gated delta rule with Mosaic GPU kernels (:data:`registry.CONTRACT`).

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, ``HV = G H``; bfloat16 or
      float16 (the products take them as they are). K, V <= 128.
    a: ``[B, T, HV, 1]`` log decay ``<= 0`` (the per-head gate only).
    b: ``[B, T, HV]`` beta.
    initial_state: ``[B, HV, K, V]``.
    cut, chunk_seq: must be None (no packed sequences).
    scale: Python float multiplying q.
    chunk_size: 64.
    specialized: the scan on three warpgroups (state, output, TMA) instead
      of one (:func:`scan.forward`); not the default until timed on the
      H200 (benchmarks/mosaic_check.py).

  Returns:
    ``(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] in
    initial_state's dtype)``, differentiable (custom VJP).
  """
  if chunk_size != CHUNK:
    raise ValueError(f"impl='mosaic' needs chunk_size = {CHUNK}; got "
                     f"{chunk_size}")
  if cut is not None or chunk_seq is not None:
    raise ValueError("impl='mosaic' does not support segment_ids, cu_seqlens "
                     "or a = -inf")
  if isinstance(b, tuple) or a.shape[-1] != 1:
    raise ValueError("impl='mosaic' has only the per-head gate (a [B, T, HV])")
  dims = (q.shape[-1], v.shape[-1])
  if max(dims) > MAX_HEAD_DIM:
    raise ValueError(f"impl='mosaic' supports head dims up to {MAX_HEAD_DIM}; "
                     f"got K = {dims[0]}, V = {dims[1]}")
  dtype = jnp.result_type(q, k, v)
  if jnp.dtype(dtype).itemsize != 2:
    raise ValueError(f"impl='mosaic' takes 16-bit q, k and v; got {dtype}")
  o, final = _mosaic(float(scale), specialized,
                     *(x.astype(dtype) for x in (q, k, v)),
                     a.astype(jnp.float32), b.astype(jnp.float32),
                     initial_state.astype(jnp.float32))
  return o.astype(v.dtype), final.astype(initial_state.dtype)


def _width(d):
  """The kernels' head dim: 64 or 128 (wgmma tiles of 64)."""
  return common.round_up(d, 64)


def _forward(scale, specialized, q, k, v, a, b, initial_state, save):
  mg = compat.Mosaic(interpret=jax.default_backend() != "gpu")
  n_k, n_v = q.shape[-1], v.shape[-1]
  q, k = (common.pad_axis(x, 3, _width(n_k)) for x in (q, k))
  vp = common.pad_axis(v, 3, _width(n_v))
  g, beta, _, _ = pallas_ops.gates(a, b, None, CHUNK, jnp.float32,
                                   q.shape[-1], mg.interpret)
  s0 = pallas_ops.pad_state(initial_state, q.shape[-1], vp.shape[-1])
  t = ut.inverse(mg, k, g, beta, heads=v.shape[2])
  o, final, *saved = scan.forward(mg, q, k, vp, t, g, beta, s0, scale=scale,
                                  save=save, specialized=specialized)
  outputs = o[..., :n_v], final[..., :n_k, :n_v]
  if not save:
    return outputs, None
  # The Pallas backward's layout: head dims padded to its own widths.
  kp, vp = pallas_core.padded_dim(n_k), pallas_core.padded_dim(n_v)
  states, delta = saved
  return outputs, (t, states[..., :kp, :vp], delta[..., :vp], None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mosaic(scale, specialized, q, k, v, a, b, initial_state):
  """:func:`gated_delta_mosaic` on 16-bit q, k, v and float32 a, b and
  initial state; scale and specialized are static."""
  return _forward(scale, specialized, q, k, v, a, b, initial_state,
                  save=False)[0]


def _fwd(scale, specialized, q, k, v, a, b, initial_state):
  outputs, saved = _forward(scale, specialized, q, k, v, a, b, initial_state,
                            save=True)
  return outputs, (q, k, v, a, b, initial_state, None, None, None, saved)


def _backward_scan(*, q, k, w, g, d_o, d_delta_local, d_final, scale,
                   **pallas_only):
  """:func:`reverse.backward` under :func:`pallas_state.backward_scan`'s
  signature (``pallas_only``: its launch and the inputs this implementation
  does not take), or that function where a padded head dim is not 64 or
  128."""
  if q.shape[-1] not in (64, 128) or d_o.shape[-1] not in (64, 128):
    return pallas_state.backward_scan(
        q=q, k=k, w=w, g=g, d_o=d_o, d_delta_local=d_delta_local,
        d_final=d_final, scale=scale, **pallas_only)
  mg = compat.Mosaic(interpret=jax.default_backend() != "gpu")
  return reverse.backward(mg, q, k, w, g, d_o, d_delta_local, d_final,
                          scale=scale)


def _bwd(scale, specialized, residuals, cotangents):
  del specialized  # a forward schedule only
  config = pallas_core.KernelConfig().resolve()
  grads = pallas_ops.backward(scale, CHUNK, config, residuals, cotangents,
                              backward_scan=_backward_scan)
  return grads[:6]  # those of q, k, v, a, b and initial_state


_mosaic.defvjp(_fwd, _bwd)
