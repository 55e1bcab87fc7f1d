"""impl="mosaic" in the Mosaic GPU interpreter on the CPU (the GPU run:
tests/test_gpu.py, benchmarks/mosaic_check.py).

The interpreter checks the kernels' data movement and arithmetic, not their
register layouts or wgmma operand forms (deltajax/mosaic/compat.py). The
products take 16-bit operands, so every check is at fla's tolerances against
float64 on the same rounded inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import pallas
from deltajax import mosaic
from deltajax.mosaic import chunk_backward
from deltajax.mosaic import compat
from deltajax.mosaic import intra
from deltajax.mosaic import ops
from deltajax.mosaic import output
from deltajax.mosaic import reverse
from deltajax.mosaic import scan
from deltajax.mosaic import ut
from deltajax.mosaic import ut_backward
import reference
import utils

pytestmark = pytest.mark.skipif(
    pallas.gpu_capability() is not None,
    reason="interpreter checks; on a GPU run tests/test_gpu.py")

TOLERANCES = dict(o=0.005, s=0.005, dq=0.008, dk=0.008, dv=0.008, da=0.02,
                  db=0.02, dh0=0.008)


def _value_and_grads(impl, args, cts):
  """``{name: float64 numpy}``: outputs and gradients, under one jit."""
  def run(args, cts):
    f = lambda *x: deltajax.gated_delta(
        *x[:5], initial_state=x[5], impl=impl, return_final_state=True)
    out, vjp = jax.vjp(f, *args)
    return out, vjp(tuple(c.astype(x.dtype) for c, x in zip(cts, out)))
  out, grads = jax.jit(run)(args, tuple(jnp.asarray(c) for c in cts))
  return {n: np.asarray(x, np.float64)
          for n, x in zip(TOLERANCES, (*out, *grads))}


def _check(x, dtype=jnp.bfloat16, tolerances=TOLERANCES, x64=True):
  """Mosaic on q, k, v in ``dtype`` against float64 on the same values;
  under ``jax_enable_x64`` (``x64``: the kernels' int32 indexing holds
  there, and the scan takes one warpgroup) or outside it (as ``"auto"``
  runs: three warpgroups)."""
  cts = utils.random_cotangents(1, x)
  args = (tuple(jnp.asarray(t, dtype) for t in x[:3])
          + tuple(jnp.asarray(t, jnp.float32) for t in x[3:]))
  with jax.enable_x64(x64):
    got = _value_and_grads("mosaic", args, cts)
  with jax.enable_x64(True):
    ref = _value_and_grads(
        "chunked", tuple(jnp.asarray(t, jnp.float64) for t in args), cts)
  for name, tol in tolerances.items():
    assert np.all(np.isfinite(got[name])), name
    err = utils.relative_rms_error(got[name], ref[name])
    assert err < tol, (name, err)


# (B, T, H, HV, K, V): T not a multiple of the chunk with head dims padded
# (48 -> 64); two chunks with V = 128 (two V blocks of the scans); grouped
# value heads (K = 100 -> 128); K = V = 32 (padded to 64, forward and
# backward).
@pytest.mark.parametrize("shape", [(1, 100, 2, 2, 48, 48),
                                   (1, 128, 1, 1, 64, 128),
                                   (1, 40, 1, 2, 100, 64),
                                   (1, 70, 1, 1, 32, 32)])
def test_mosaic_matches_float64(shape):
  bsz, t, h, hv, dk, dv = shape
  _check(utils.random_inputs(sum(shape), batch=bsz, length=t, heads=h,
                             value_heads=hv, key_dim=dk, value_dim=dv,
                             gate_scale=0.25, state_scale=0.1))


@pytest.mark.parametrize("gate_scale", [10.0, 0.1])
def test_mosaic_float16_fla_gdn_grid(gate_scale):
  """float16 q, k, v, beta = 1 and gates scaled as fla's GDN grid (which
  impl="auto" sends here on Hopper), with half of the gates zeroed."""
  x = utils.random_inputs(11, batch=1, length=100, heads=2, key_dim=100,
                          value_dim=64, gate_scale=gate_scale, beta_one=True,
                          state_scale=0.1)
  a = x.a.copy()
  a[:, :, :1] = 0
  _check(x._replace(a=a), dtype=jnp.float16)


def test_mosaic_full_forgets():
  """a = -inf (clamped at the floor) inside a chunk, at a chunk's first
  token and at the last token: the state is forgotten there, as in float64
  (impl="auto" sends such calls here on Hopper)."""
  x = utils.random_inputs(5, batch=1, length=100, heads=1, key_dim=64,
                          value_dim=64, gate_scale=0.25, state_scale=0.1)
  a = x.a.copy()
  a[:, [30, 64, 99]] = -np.inf
  _check(x._replace(a=a))


def test_mosaic_strong_gates_stay_finite():
  """a = -5 on every token of the first chunk and -30 on single tokens, b
  near 2, nearly aligned keys: every exponent is <= 0, nothing overflows.
  The bf16 roundings cost more here (impl="pallas" has the same errors: o
  7e-3, da 3.5e-2)."""
  x = utils.strong_kda_inputs(5, length=128, key_dim=64, value_dim=64)
  a = np.where(np.arange(128)[None, :, None] < 64, -5.0, x.a[..., 0])
  a[:, 70] = a[:, 100] = -30.0
  _check(x._replace(a=a, initial_state=0.1 * x.initial_state),
         tolerances=dict.fromkeys(TOLERANCES, 0.05))


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
def test_mosaic_pieces_match_float64(per_channel, monkeypatch):
  """The forward's scan cut into four pieces (``"auto"``'s choice where the
  scan's CTAs leave most multiprocessors idle, forced here): the map pass
  of the first three, their composition, the scan from each piece's entry
  state, and the backward on the states it saves. T = 250 (four chunks,
  the last padded), grouped value heads, K != V."""
  monkeypatch.setattr(ops, "_default_pieces", lambda ctas, n_chunks: 4)
  x = utils.random_inputs(31, batch=1, length=250, heads=1, value_heads=2,
                          key_dim=64, value_dim=128, per_channel=per_channel,
                          gate_scale=0.25, state_scale=0.1)
  if per_channel:
    x = x._replace(a=x.a * np.geomspace(1e-3, 0.3, 64))
  _check(x)


def test_pieces_in_the_specialized_scan():
  """The three-warpgroup scan in three pieces (its map pass in two
  warpgroups) gives the outputs and gradients of one piece, up to the
  rounding of the entry states to bf16 in the products: K = 128, V = 64,
  so that the map pass's identity takes two of its three value blocks."""
  args, cts = _contract_inputs(17, length=192, value_heads=1, key_dim=128,
                               value_dim=64)
  leaves = [jax.tree.leaves(_mosaic_vjp(args, cts, schedule="specialized",
                                        pieces=n)) for n in (3, 1)]
  for i, (got, want) in enumerate(zip(*leaves)):
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    assert utils.relative_rms_error(got, want) < 5e-3, i
  for pieces in (2, 0, 1.0):
    with pytest.raises(ValueError, match="pieces must be a positive int "
                       "dividing the 3 chunks"):
      _mosaic_vjp(args, cts, pieces=pieces)


def _compiled_inputs(monkeypatch, t, kv_heads, value_heads, dim,
                     per_channel):
  """Traces the default path as compiled for the GPU (the interpreter
  off): abstract ``(q, k, v, a, b, h0)`` at ``[1, t, ., dim]``."""
  monkeypatch.setattr(ops, "_mosaic_gpu",
                      lambda: compat.Mosaic(interpret=False))
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  f32 = lambda *s: shape(*s, dtype=jnp.float32)
  keys = shape(1, t, kv_heads, dim)
  return (keys, keys, shape(1, t, value_heads, dim),
          f32(1, t, value_heads, dim if per_channel else 1),
          f32(1, t, value_heads), f32(1, value_heads, dim, dim))


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
def test_pieces_lower_for_the_gpu(per_channel, monkeypatch):
  """The whole forward and backward in two pieces lowers for CUDA under
  ``jax_enable_x64`` (as the GPU tests run it): the arrays the wrappers
  create between the kernels (the map pass's identity, the local reverse
  pass's zero cotangent) stay float32, which the interpreter does not
  check (a float64 one failed every GPU test of the pieces)."""
  args = _compiled_inputs(monkeypatch, 256, 1, 2, 128, per_channel)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x, None, None, scale=0.1,
                                         chunk_size=64, pieces=2)
    return o.astype(jnp.float32).sum() + final.sum()

  with jax.enable_x64(True):
    jax.jit(jax.grad(loss, argnums=range(6))).trace(*args).lower(
        lowering_platforms=("cuda",))


def test_default_pieces(monkeypatch):
  """One piece unless the scan's CTAs fill at most half of the
  multiprocessors; then the largest power of two that fits, divides the
  chunks and leaves 16 chunks a piece at least (off the GPU, one)."""
  assert ops._default_pieces(32, 1024) == 1  # no GPU here
  monkeypatch.setattr(ops.pallas_core, "multiprocessors", lambda: 132)
  assert ops._default_pieces(32, 1024) == 4  # (1, 65536, 16, 128)
  assert ops._default_pieces(64, 256) == 2  # (2, 16384, 16, 128)
  assert ops._default_pieces(192, 128) == 1  # (1, 8192, 96, 128)
  assert ops._default_pieces(8, 64) == 4  # 16 chunks a piece
  assert ops._default_pieces(8, 96) == 4  # 4 x 24 chunks, not 8 x 12
  assert ops._default_pieces(8, 95) == 1


# (B, T, H, HV, K, V) of KDA (a per-channel gate): grouped value heads; K = 128
# with V = 64 over three chunks; T not a multiple of the chunk with head dims
# padded (100 -> 128, 48 -> 64).
@pytest.mark.parametrize("shape", [(1, 128, 1, 2, 64, 64),
                                   (1, 192, 1, 2, 128, 64),
                                   (1, 100, 1, 1, 100, 48)])
def test_mosaic_per_channel_matches_float64(shape):
  """The gates' scales spread over the key channels, from a state kept over
  many chunks to one forgotten within a chunk, so that the state's decay
  per row matters (channel 0's decay on every row took the final state to
  0.41 relative RMS error, o to 0.055; in the reverse pass, dk to 0.23, the
  next chunk's decay dh0 to 2.4e-2: impl="pallas" has the same errors as
  this one, o 3.1e-3, da 4.4e-3)."""
  bsz, t, h, hv, dk, dv = shape
  x = utils.random_inputs(sum(shape), batch=bsz, length=t, heads=h,
                          value_heads=hv, key_dim=dk, value_dim=dv,
                          per_channel=True, state_scale=0.1)
  _check(x._replace(a=x.a * np.geomspace(1e-3, 0.3, dk)))


def test_mosaic_per_channel_strong_gates_stay_finite():
  """KDA with a = -5 on every token and channel (the state forgotten within
  a few tokens), b near 2 and nearly aligned keys: nothing overflows, and
  the results keep fla's tolerances (as impl="pallas": o 2.3e-3, da
  3.5e-3)."""
  x = utils.strong_kda_inputs(7, length=128, key_dim=64, value_dim=64)
  _check(x._replace(a=np.full_like(x.a, -5.0),
                    initial_state=0.1 * x.initial_state))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_mosaic_per_channel_16_bit_gates_past_float16(dtype):
  """KDA in float16 and bfloat16 at fla's KDA gates (logsigmoid(N(0, 1)),
  half of them 0): on some channel each chunk's gate falls by 35 to 40,
  within the span that the scores' backward factors through the midpoint
  gate (so the Mosaic kernel takes every chunk), with factors up to e^20,
  past float16's 65504 = e^11.1 (float16 operands there gave Inf dq, dk,
  da and db). Against the plain scan in float64 at fla's tolerances."""
  x = utils.random_inputs(24, batch=1, length=128, heads=1, key_dim=64,
                          value_dim=64, per_channel=True)
  rng = np.random.default_rng(24)
  a = np.where(rng.uniform(size=x.a.shape) < 0.5, 0.0, x.a)
  g = np.cumsum(a.reshape(2, ut.C, 64), axis=1)
  falls = np.max(g[:, 0] - g[:, -1], axis=-1)
  assert np.all((falls > 35) & (falls <= pallas.intra.SPAN)), falls
  args = (*(jnp.asarray(t, dtype) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x._replace(a=a)[3:]))
  d_o, d_s = utils.random_cotangents(25, x)
  cts = (np.asarray(jnp.asarray(d_o, dtype), np.float64), d_s)
  scale = 64 ** -0.5
  got = jax.tree.leaves(utils.vjp(
      lambda *z: deltajax.kda(*z[:5], scale=scale, initial_state=z[5],
                              return_final_state=True, impl="mosaic"),
      args, cts))
  with jax.enable_x64(True):
    want = jax.tree.leaves(utils.vjp(
        lambda q, *z: reference.plain_scan(q * scale, *z),
        tuple(jnp.asarray(t, jnp.float64) for t in args), cts))
  for name, y, ref in zip(TOLERANCES, got, want):
    y = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y)), name
    err = utils.relative_rms_error(y, ref)
    assert err < TOLERANCES[name], (name, err)


def _reverse_reference(qg, kd, w, g_end, d_o, d_delta_local, d_final, scale):
  """:func:`reverse.backward`'s per-channel contract in float64: ``(d_delta,
  d_next, d_initial)``."""
  qg, kd, w, g_end, d_o, ds = (np.asarray(x, np.float64) for x in (
      qg, kd, w, g_end, d_o, d_final))
  c = scan.C
  d_delta = np.array(d_delta_local, np.float64)
  d_next = np.empty((*g_end.shape, ds.shape[-1]))
  for n in reversed(range(g_end.shape[2])):
    rows = slice(n * c, n * c + c)
    d_next[:, :, n] = ds
    d_delta[:, rows] += np.einsum("bthk,bhkv->bthv", kd[:, rows], ds)
    ds = (np.exp(g_end[:, :, n])[..., None] * ds
          + scale * np.einsum("bthk,bthv->bhkv", qg[:, rows], d_o[:, rows])
          - np.einsum("bthk,bthv->bhkv", w[:, rows], d_delta[:, rows]))
  return d_delta, d_next, ds


@pytest.mark.parametrize("dk,dv", [(64, 128), (128, 64)])
def test_reverse_per_channel_matches_float64(dk, dv):
  """The reverse pass on a per-channel gate's decayed operands, three chunks
  of strong gates (:func:`utils.strong_kda_inputs`: some channels forgotten
  within the first chunk, others at single tokens, the rest kept), against
  float64 on the same 16-bit operands (2.3e-3 relative RMS error at most;
  dS's rows decayed by channel 0's e^{g_C} took dDelta to 3.8e-2, by the
  next chunk's e^{g_C} d_initial to 5.3e-2); the transposed pass refuses
  them."""
  x = utils.strong_kda_inputs(dk + dv, length=192, heads=2, key_dim=dk,
                              value_dim=dv)
  c, rng = scan.C, np.random.default_rng(dk)
  g = np.cumsum(x.a.reshape(1, -1, c, 2, dk), axis=2).reshape(x.a.shape)
  g_end = g[:, c - 1::c]
  bf16 = lambda y: jnp.asarray(y, jnp.bfloat16)
  normal = lambda *shape: rng.standard_normal(shape)
  args = (bf16(x.q * np.exp(g)),
          bf16(x.k * np.exp(np.repeat(g_end, c, axis=1) - g)),
          bf16(0.1 * normal(1, 192, 2, dk)),
          jnp.asarray(np.moveaxis(g_end, 1, 2), jnp.float32),
          bf16(0.1 * normal(1, 192, 2, dv)),
          jnp.asarray(0.1 * normal(1, 192, 2, dv), jnp.float32),
          jnp.asarray(normal(1, 2, dk, dv), jnp.float32))
  mg = compat.Mosaic(interpret=True)
  got = reverse.backward(mg, *args, scale=0.1, per_channel=True)
  for name, x, want in zip(("d_delta", "d_next", "d_initial"), got,
                           _reverse_reference(*args, scale=0.1)):
    err = utils.relative_rms_error(np.asarray(x, np.float64), want)
    assert err < 5e-3, (name, err)
  with pytest.raises(ValueError, match="per-head gate"):
    reverse.backward(mg, *args, scale=0.1, transposed=True, per_channel=True)


def _per_channel_ut_inputs(seed, heads, value_heads, dk, dv, length=128):
  """bf16 operands of a per-channel ut_backward (strong gates:
  :func:`utils.strong_kda_inputs`, with a = -5 on every token of a fifth of
  the channels) and float32 g (chunk-local cumulative) and beta."""
  x = utils.strong_kda_inputs(seed, length=length, heads=value_heads,
                              key_dim=dk, value_dim=dv)
  c, rng = ut.C, np.random.default_rng(seed)
  a = x.a.copy()
  a[..., -(dk // 5):] = -5.0
  g = np.cumsum(a.reshape(1, -1, c, value_heads, dk), axis=2)
  g = np.moveaxis(g.reshape(a.shape), 1, 2)
  n = length // c
  bf16 = lambda y: jnp.asarray(y, jnp.bfloat16)
  normal = lambda *shape: rng.standard_normal(shape)
  t = np.tril(0.3 * normal(1, value_heads, n, c, c), -1) + np.eye(c)
  return dict(
      k=bf16(x.k[:, :, :heads]), v=bf16(x.v), g=jnp.asarray(g, jnp.float32),
      b=jnp.asarray(np.moveaxis(x.b, 1, 2), jnp.float32),
      t=bf16(t.reshape(1, value_heads, length, c)),
      states=bf16(normal(1, value_heads, n, dk, dv)),
      d_next=bf16(normal(1, value_heads, n, dk, dv)),
      delta=bf16(normal(1, length, value_heads, dv)),
      d_delta=bf16(normal(1, length, value_heads, dv)))


@pytest.mark.parametrize("heads,value_heads,dk,dv", [(1, 1, 64, 128),
                                                     (1, 2, 128, 64),
                                                     (1, 1, 128, 128)])
def test_ut_backward_per_channel_matches_the_pallas_one(heads, value_heads,
                                                        dk, dv):
  """The per-channel (KDA) Mosaic ut_backward on strong gates against the
  Pallas kernel in float64 on the same 16-bit operands (W and U from T):
  dk, dv, db, the cumulative gate's dg and dM, with grouped value heads in
  one case (1.9e-3 relative RMS error at most: the 16-bit roundings of
  dX, dW and dM's bracket), and the per-channel W of :func:`ut.w_u`;
  impl="mosaic"'s adapter refuses read keys."""
  x = _per_channel_ut_inputs(dk + dv + value_heads, heads, value_heads, dk,
                             dv)
  got = ut_backward.ut_backward(compat.Mosaic(interpret=True), **x)
  got += ut.w_u(compat.Mosaic(interpret=True),
                *(x[n] for n in ("k", "v", "g", "b", "t")), values=False)[:1]
  with jax.enable_x64(True):
    wide = {n: jnp.asarray(y, jnp.float64) for n, y in x.items()}
    config = pallas.core.Config(interpret=True)
    launch = lambda name: config.launch(name, per_channel=True)
    shared = dict(cuts=None, chunk_size=ut.C, interpret=True,
                  dot=config.dot)
    w, u = pallas.ut.w_u(
        **{n: wide[n] for n in ("k", "v", "g", "b", "t")},
        launch=launch("w_u"), **shared)
    want = pallas.ut.ut_backward(**wide, w=w, u=u, dk_out=None, dg_out=None,
                                 launch=launch("ut_backward"), **shared)
  for name, y, ref in zip(("dk", "dv", "db", "dg", "dm", "w"), got,
                          (*want, w)):
    assert y.shape == ref.shape, name
    err = utils.relative_rms_error(np.asarray(y, np.float64),
                                   np.asarray(ref, np.float64))
    assert err < 5e-3, (name, err)
  with pytest.raises(ValueError, match="no read keys"):
    ops._ut(compat.Mosaic(interpret=True), **x, dk_out=None,
                   dg_out=None, kr=x["k"])


def test_per_channel_ut_backward_has_no_races():
  """The interpreter's race detector finds no race in the per-channel
  ut_backward at K = V = 128: the gate's tile, copied in after the value
  blocks, is read once its copy has arrived. (The interpreter copies at
  once and runs a warpgroup as one thread: neither a copy out's wait nor
  a warpgroup barrier is checked.)"""
  x = _per_channel_ut_inputs(5, 1, 1, 128, 128)
  mg = compat.Mosaic(interpret=True, detect_races=True)
  jax.block_until_ready(ut_backward.ut_backward(mg, **x))
  assert not compat.races_found()


def test_chunk_backward_has_no_races():
  """The interpreter's race detector finds no race between chunk_backward's
  three warpgroups at K = V = 128 (tiles one writes and another reads,
  tiles reused: v's for dv once WG0 has read v); it does when WG1 writes dv
  over v without waiting for Delta (checked)."""
  rng = np.random.default_rng(3)
  bf16 = lambda *s: jnp.asarray(0.1 * rng.normal(size=s), jnp.bfloat16)
  g = -np.cumsum(0.1 * rng.random((1, 1, 64)), axis=-1)
  args = (bf16(1, 64, 1, 128), bf16(1, 64, 1, 128), bf16(1, 64, 1, 128),
          jnp.asarray(g, jnp.float32),
          jnp.asarray(rng.random((1, 1, 64)), jnp.float32),
          bf16(1, 1, 64, 64), bf16(1, 1, 1, 128, 128),
          bf16(1, 1, 1, 128, 128), bf16(1, 64, 1, 128))
  mg = compat.Mosaic(interpret=True, detect_races=True)
  jax.block_until_ready(chunk_backward.chunk_backward(mg, *args, scale=0.1))
  assert not compat.races_found()


def _contract_inputs(seed, **shape):
  """``(args, cotangents)`` for :func:`mosaic.gated_delta_mosaic` itself: bf16
  q, k, v, float32 a ``[..., 1]``, b and initial state; the cotangents of
  o (bf16) and of the final state."""
  x = utils.random_inputs(seed, batch=1, heads=1, gate_scale=0.25,
                          state_scale=0.1, **shape)
  q, k, v = (jnp.asarray(t, jnp.bfloat16) for t in x[:3])
  a, b, s0 = (jnp.asarray(t, jnp.float32) for t in x[3:])
  d_o, d_s = utils.random_cotangents(seed + 1, x)
  return ((q, k, v, a[..., None], b, s0),
          (jnp.asarray(d_o, jnp.bfloat16), jnp.asarray(d_s, jnp.float32)))


def _float64_grads(args, cotangents):
  """The gradients of ``impl="chunked"`` in float64 at
  :func:`_contract_inputs`' ``(args, cotangents)``."""
  with jax.enable_x64(True):
    f = lambda q, k, v, a, b, s0: deltajax.gated_delta(
        q, k, v, a[..., 0], b, initial_state=s0, impl="chunked", scale=0.125,
        return_final_state=True)
    return jax.vjp(f, *(jnp.asarray(x, jnp.float64) for x in args))[1](
        tuple(jnp.asarray(c, jnp.float64) for c in cotangents))


def _mosaic_vjp(args, cotangents, **options):
  """``(outputs, gradients)`` of :func:`mosaic.gated_delta_mosaic` with
  ``options``."""
  f = lambda *x: mosaic.gated_delta_mosaic(*x, None, None, scale=0.125,
                                           chunk_size=64, **options)
  out, vjp = jax.vjp(f, *args)
  return out, vjp(cotangents)


def test_per_channel_backward_in_mosaic_gpu():
  """KDA's backward in Mosaic GPU (``backward=BACKWARD``: ut_backward and
  the scores' backward) on the strong gates of
  :func:`utils.strong_kda_inputs` at K = 128, V = 64, three chunks (the
  first's gate falls by 320 over it, so the Pallas pass by blocks rewrites
  it): against float64, within 1.5 times the Pallas kernels' errors
  (``backward=("reverse",)``; beyond fla's tolerances for both on these
  inputs, the forward's too: o 1.1e-2; dq 1.5e-2 against 1.3e-2, da 1.7e-2
  against 1.4e-2: 16-bit operands where the Pallas kernels take TF32
  ones)."""
  x = utils.strong_kda_inputs(3, length=192, key_dim=128, value_dim=64)
  args = (*(jnp.asarray(t, jnp.bfloat16) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x[3:]))
  cts = tuple(jnp.asarray(c, jnp.float32)
              for c in utils.random_cotangents(4, x))
  cts = (cts[0].astype(jnp.bfloat16), cts[1])
  with jax.enable_x64(True):
    f = lambda *z: deltajax.gated_delta(
        *z[:5], initial_state=z[5], impl="chunked", return_final_state=True,
        scale=0.125)
    out, vjp = jax.vjp(f, *(jnp.asarray(t, jnp.float64) for t in args))
    ref = jax.tree.leaves((out, vjp(tuple(jnp.asarray(c, jnp.float64)
                                          for c in cts))))
  errors = [[utils.relative_rms_error(np.asarray(y, np.float64),
                                      np.asarray(r))
             for y, r in zip(jax.tree.leaves(_mosaic_vjp(args, cts,
                                                         backward=names)),
                             ref)]
            for names in (("reverse",), mosaic.BACKWARD)]
  for i, (pallas_err, err) in enumerate(zip(*errors)):
    assert err < 1.5 * pallas_err, (i, err, pallas_err)


def test_default_backward_per_channel(monkeypatch):
  """By default the backward takes every Mosaic GPU kernel (those of a
  per-channel gate among them for KDA, the scores' backward too: RESULTS
  run Z)."""
  seen = []
  monkeypatch.setattr(ops, "_mosaic", lambda scale, plan, backward, *x:
                      seen.append(backward[0]) or (x[0], x[-1]))
  q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  s0 = jnp.zeros((1, 1, 64, 64), jnp.float32)
  for width in (1, 64):
    a = jnp.zeros((1, 64, 1, width), jnp.float32)
    ops.gated_delta_mosaic(q, q, q, a, a[..., 0], s0, None, None,
                           scale=0.125, chunk_size=64)
  assert seen == [mosaic.BACKWARD, mosaic.BACKWARD]


def test_default_schedule():
  """Three warpgroups for the per-head gate (faster on the H200, RESULTS
  run P); one per channel, and under x64, which the interpreter cannot
  trace with three (tests here run the kernels under x64)."""
  assert ops._default_schedule(per_channel=False) == "specialized"
  assert ops._default_schedule(per_channel=True) == "one"
  with jax.enable_x64(True):
    assert ops._default_schedule(per_channel=False) == "one"


def _intra_inputs(seed, heads, value_heads, dk, dv, length=192,
                  dtype=jnp.bfloat16, gate_scale=0.05):
  """Arguments of :func:`deltajax.pallas.intra.backward` (``dtype`` where
  16-bit, else float32) over three chunks: the first two gentle (``a =
  gate_scale logsigmoid(N(0, 1))``; a_0 below the floor on a quarter of
  the channels in the first), the third not (a = -190 on one token of a
  quarter of the channels)."""
  rng = np.random.default_rng(seed)
  c, n = ut.C, length // ut.C
  normal = lambda *shape: rng.standard_normal(shape)
  a = -gate_scale * np.logaddexp(0.0, normal(1, length, value_heads, dk))
  a[:, 0, :, :dk // 4] = -300.0
  a[:, 2 * c + 5, :, dk // 4:dk // 2] = -190.0
  g = np.cumsum(np.maximum(a, -200.0).reshape(1, n, c, value_heads, dk),
                axis=2)
  g = np.moveaxis(g.reshape(a.shape), 1, 2)
  low = lambda y: jnp.asarray(y, dtype)
  f32 = lambda y: jnp.asarray(y, jnp.float32)
  return dict(
      q=low(normal(1, length, heads, dk)),
      k=low(normal(1, length, heads, dk) / np.sqrt(dk)), g=f32(g),
      b=f32(rng.uniform(0.1, 1.99, (1, value_heads, length))), a=f32(a),
      states=low(normal(1, value_heads, n, dk, dv)),
      d_o=low(normal(1, length, value_heads, dv)),
      delta=low(normal(1, length, value_heads, dv)),
      d_m=f32(normal(1, value_heads, length, c)),
      dk=f32(normal(1, length, value_heads, dk)),
      dg=f32(normal(1, value_heads, length, dk)))


# (H, HV, K, V, 16-bit dtype, gate scale): in float16 the gentle chunks'
# gates fall by about 30 on some channel, factors up to e^15 either side of
# the midpoint, past float16's e^11.1 (float16 operands gave Inf and NaN).
_INTRA_CASES = [(1, 1, 64, 128, jnp.bfloat16, 0.05),
                (1, 2, 128, 64, jnp.bfloat16, 0.05),
                (1, 1, 64, 64, jnp.float16, 0.5)]


@pytest.mark.parametrize("heads,value_heads,dk,dv,dtype,gate_scale",
                         _INTRA_CASES)
def test_intra_forward_matches_the_pallas_one(heads, value_heads, dk, dv,
                                              dtype, gate_scale):
  """The forward's first pass of the scores through the Mosaic GPU kernel
  (every chunk through its midpoint gate; the Pallas second pass after it
  where the gate falls steeply) against the Pallas passes in float64 on
  the same 16-bit q and k: A and P to 1e-4 (their operands in two bfloat16
  halves), the decayed operands, and g at the chunks' ends to float32
  accuracy (a's three bfloat16 parts sum to it), with grouped value heads
  in one case, a below the floor at a gentle chunk's first token and a
  chunk that is not gentle."""
  x = _intra_inputs(dk + value_heads, heads, value_heads, dk, dv,
                    dtype=dtype, gate_scale=gate_scale)
  config = pallas.core.Config(interpret=True)
  shared = dict(cuts=None, chunk_size=ut.C, interpret=True, dot=config.dot,
                launch=config.launch("intra", per_channel=True), scale=0.3,
                heads=value_heads, from_start=(x["q"], x["k"]),
                to_end=(x["k"],))
  got = pallas.intra.forward(
      q=x["q"], k=x["k"], a=x["a"], **shared,
      done=intra.forward(compat.Mosaic(interpret=True), x["q"], x["k"],
                         x["a"], heads=value_heads, scale=0.3))
  with jax.enable_x64(True):
    wide = lambda y: jnp.asarray(y, jnp.float64)
    want = pallas.intra.forward(q=wide(x["q"]), k=wide(x["k"]),
                                a=wide(x["a"]), **shared)
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  for name, y, ref in zip(("A", "P", "g_end", "Q e^g", "K e^g",
                           "K e^{g_C - g}"), got, want):
    assert y.shape == ref.shape, name
    err = utils.relative_rms_error(np.asarray(y, np.float64),
                                   np.asarray(ref, np.float64))
    assert err < {"g_end": 1e-6, "A": 1e-4, "P": 1e-4}.get(name, 5e-3), (
        name, err)


def test_mosaic_scores_in_the_forward():
  """KDA with ``scores="mosaic"`` (the first pass of the scores in Mosaic
  GPU) gives the Pallas pass's outputs and gradients up to 16-bit
  rounding: two chunks, K = V = 64, fla-like gates."""
  x = utils.random_inputs(11, batch=1, length=128, heads=1, key_dim=64,
                          value_dim=64, per_channel=True, state_scale=0.1)
  args = (*(jnp.asarray(t, jnp.bfloat16) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x[3:]))
  d_o, d_s = utils.random_cotangents(12, x)
  cts = (jnp.asarray(d_o, jnp.bfloat16), jnp.asarray(d_s, jnp.float32))
  leaves = [jax.tree.leaves(_mosaic_vjp(args, cts, scores=scores))
            for scores in ops.SCORES]
  for i, (want, got) in enumerate(zip(*leaves)):
    got, want = (np.asarray(t, np.float64) for t in (got, want))
    assert utils.relative_rms_error(got, want) < 5e-3, i


@pytest.mark.parametrize("scores", ops.SCORES)
def test_kept_gates(scores):
  """KDA's backward on the forward's g and decayed operands
  (``keep_gates``) gives the gradients of the backward that forms them
  again: to float32 rounding after the Pallas first pass, which writes g
  for every chunk then, and up to 16-bit rounding after the Mosaic one
  (its decayed operands' roundings differ); two value heads on one, K = 64,
  V = 32 (the Pallas backward's padded widths), a gate that is not gentle
  in the second chunk."""
  x = utils.random_inputs(13, batch=1, length=128, heads=1, value_heads=2,
                          key_dim=64, value_dim=32, per_channel=True,
                          state_scale=0.1)
  a = 0.1 * x.a  # gentle, but for the second chunk's first channels
  a[:, 64 + 5, :, :16] = -60.0
  x = x._replace(a=a)
  args = (*(jnp.asarray(t, jnp.bfloat16) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x[3:]))
  d_o, d_s = utils.random_cotangents(14, x)
  cts = (jnp.asarray(d_o, jnp.bfloat16), jnp.asarray(d_s, jnp.float32))
  leaves = [jax.tree.leaves(_mosaic_vjp(args, cts, scores=scores,
                                        keep_gates=keep))
            for keep in (False, True)]
  for i, (want, got) in enumerate(zip(*leaves)):
    got, want = (np.asarray(t, np.float64) for t in (got, want))
    err = utils.relative_rms_error(got, want)
    assert err < (1e-6 if scores == "pallas" else 5e-3), (i, err)


def test_intra_backward_has_no_races():
  """The interpreter's race detector finds no race in the scores' backward
  at K = V = 128: its value blocks' tiles reloaded once read, and dk_in and
  dg_in arriving in their place after the last."""
  x = _intra_inputs(6, 1, 1, 128, 128)
  mg = compat.Mosaic(interpret=True, detect_races=True)
  jax.block_until_ready(intra.backward(
      mg, *(x[n] for n in ops._INTRA_ARGS), scale=0.3))
  assert not compat.races_found()


def test_intra_forward_has_no_races_and_fits_twice():
  """The race detector finds no race in the scores' first pass at K = 128
  (the second block of key channels loaded into the first's tiles once
  they are read; the interpreter copies at once, so the wait for the
  copies out is not checked), and two CTAs fit on a multiprocessor (112
  KB each with bfloat16 or float16 q and k, the decayed operands' staging
  tiles in the scores' place; measured from the lowering for CUDA)."""
  x = _intra_inputs(7, 1, 1, 128, 64)
  mg = compat.Mosaic(interpret=True, detect_races=True)
  jax.block_until_ready(intra.forward(mg, x["q"], x["k"], x["a"], heads=1,
                                      scale=0.3))
  assert not compat.races_found()
  shape = lambda dtype: jax.ShapeDtypeStruct((1, 128, 1, 128), dtype)
  for dtype in (jnp.bfloat16, jnp.float16):
    size = compat.shared_memory_bytes(
        lambda a, q, k: intra.forward(compat.Mosaic(interpret=False), q, k,
                                      a, heads=1, scale=0.3),
        shape(jnp.float32), shape(dtype), shape(dtype))
    assert size <= 113 * 1024, (dtype, size)


@pytest.mark.parametrize("heads,value_heads,dk,dv,dtype,gate_scale",
                         _INTRA_CASES)
def test_intra_backward_matches_the_pallas_one(heads, value_heads, dk, dv,
                                               dtype, gate_scale):
  """The scores' backward through the Mosaic GPU kernel (every chunk through
  its midpoint gate; the Pallas pass by blocks after it where the gate
  falls steeply) against the Pallas kernel in float64 on the same 16-bit
  operands: dq, dk, da, db, with grouped value heads in one case, a below
  the floor at a gentle chunk's first token (its da is 0) and a chunk that
  is not gentle; impl="mosaic"'s adapter refuses read keys."""
  x = _intra_inputs(dk + dv + value_heads, heads, value_heads, dk, dv,
                    dtype=dtype, gate_scale=gate_scale)
  config = pallas.core.Config(interpret=True)
  shared = dict(cuts=None, chunk_size=ut.C, interpret=True, dot=config.dot,
                launch=config.launch("intra_backward", per_channel=True),
                scale=0.3, dkr=None)
  got = ops._intra(compat.Mosaic(interpret=True), **x, **shared, kr=None)
  with jax.enable_x64(True):
    want = pallas.intra.backward(
        **{n: jnp.asarray(y, jnp.float64) for n, y in x.items()}, **shared)
  for name, y, ref in zip(("dq", "dk", "da", "db"), got, want):
    assert y.shape == ref.shape, name
    err = utils.relative_rms_error(np.asarray(y, np.float64),
                                   np.asarray(ref, np.float64))
    assert err < 5e-3, (name, err)
  assert not np.any(np.asarray(got[2])[0, 0, :, :dk // 4])
  with pytest.raises(ValueError, match="no read keys"):
    ops._intra(compat.Mosaic(interpret=True), **x, **shared, kr=x["k"])


def test_scan_schedules_give_the_same_results():
  """The three-warpgroup scan (the interpreter runs its warpgroups and
  checks that every barrier phase is observed) computes what the one
  warpgroup scan does, to float32 rounding: outputs, final state and,
  through the chunk states and Delta it saves (and the reverse pass
  carrying the transposed state), the gradients. K != V, so that a state
  transposed the wrong way fails. The forward alone too (no saves: the
  specialized scan then publishes ``S^T`` and ``Delta^T`` as it carries
  them)."""
  args, cts = _contract_inputs(9, length=192, value_heads=1, key_dim=128,
                               value_dim=64)
  forward = lambda schedule: mosaic.gated_delta_mosaic(
      *args, None, None, scale=0.125, chunk_size=64, schedule=schedule)
  leaves = [jax.tree.leaves((forward("specialized"),
                             _mosaic_vjp(args, cts, schedule="specialized"))),
            jax.tree.leaves((forward("one"),
                             _mosaic_vjp(args, cts, schedule="one")))]
  for i, (got, want) in enumerate(zip(*leaves)):
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    assert utils.relative_rms_error(got, want) < 1e-6, i
  with pytest.raises(ValueError, match="schedule"):
    _mosaic_vjp(args, cts, schedule="two")


def _kernel_names(jaxpr):
  """The names of the kernels a jaxpr launches, in order (nested jaxprs
  too)."""
  names = []
  for eqn in jaxpr.eqns:
    name = str(eqn.params.get("name", ""))
    if name.startswith("deltajax_"):
      names.append(name)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        names += _kernel_names(getattr(inner, "jaxpr", inner))
  return names


def test_interpreter_needs_a_thread_per_warpgroup(monkeypatch):
  """With fewer XLA CPU threads than a kernel's warpgroups and their caller,
  the interpreter would wait forever at the first barrier: refused."""
  monkeypatch.setenv("NPROC", "3")
  with pytest.raises(RuntimeError, match="needs 4; this process has 3"):
    compat._check_interpreter_threads(3)
  compat._check_interpreter_threads(2)


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
def test_default_kernels_are_the_same_compiled_and_interpreted(
    per_channel, monkeypatch):
  """The compiled default forward and backward launch the same kernels
  compiled for the GPU and in the interpreter (the interpreted tests run
  what ``impl="auto"`` runs on Hopper), at K = V = 32 too: every kernel in
  its Mosaic GPU form, the per-head gate's backward through the
  three-warpgroup reverse pass and chunk_backward."""
  args = _compiled_inputs(monkeypatch, 128, 1, 1, 32, per_channel)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x, None, None, scale=0.1,
                                         chunk_size=64)
    return o.astype(jnp.float32).sum() + final.sum()

  def kernels(interpret):
    monkeypatch.setattr(ops, "_mosaic_gpu",
                        lambda: compat.Mosaic(interpret=interpret))
    return _kernel_names(
        jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(*args).jaxpr)

  compiled = kernels(False)
  assert compiled == kernels(True)
  if not per_channel:
    assert {"deltajax_mosaic_reverse_specialized",
            "deltajax_mosaic_chunk_backward"} <= set(compiled)


# (T, K, V, dtype): K = V = 32 in float16 (fla's grid), T not a multiple of
# the chunk, K != V padded (100 -> 128, 40 -> 64).
@pytest.mark.parametrize("shape", [(70, 32, 32, jnp.float16),
                                   (130, 100, 40, jnp.bfloat16)], ids=str)
def test_default_path_matches_float64(shape):
  """``impl="mosaic"`` as ``impl="auto"`` runs it on Hopper, outside
  ``jax_enable_x64``: the three-warpgroup scan, reverse pass and
  chunk_backward."""
  t, dk, dv, dtype = shape
  _check(utils.random_inputs(t + dk, batch=1, length=t, heads=1, key_dim=dk,
                             value_dim=dv, gate_scale=0.25, state_scale=0.1),
         dtype=dtype, x64=False)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fused_grads_by_default_where_fused_reverse_runs(per_channel,
                                                        monkeypatch):
  """Compiled for the GPU, the default backward of the per-head gate runs
  :func:`chunk_backward.chunk_backward` (``fused_grads`` None: on where
  ``fused_reverse`` is); the per-channel gate's does not."""
  args = _compiled_inputs(monkeypatch, 128, 1, 1, 64, per_channel)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x, None, None, scale=0.1,
                                         chunk_size=64)
    return o.astype(jnp.float32).sum() + final.sum()

  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(*args))
  assert ("chunk_backward" in jaxpr) == (not per_channel)


def test_fused_reverse_agrees_with_the_unfused_one():
  """The three-warpgroup reverse pass that forms W and dDelta_local itself
  (``fused_reverse``) gives the unfused backward's gradients to float32
  rounding (the same 16-bit roundings of W and P), over three chunks with
  K != V; one CTA (the interpreter can stall with several three-warpgroup
  CTAs on two cores). Refused without its kernels or schedule."""
  args, cts = _contract_inputs(11, length=192, value_heads=1, key_dim=128,
                               value_dim=64)
  leaves = [jax.tree.leaves(_mosaic_vjp(args, cts, fused_reverse=fused,
                                        fused_grads=False))
            for fused in (True, False)]
  for i, (got, want) in enumerate(zip(*leaves)):
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    assert utils.relative_rms_error(got, want) < 1e-6, i
  for options in (dict(schedule="one"), dict(backward=("reverse",))):
    with pytest.raises(ValueError, match="fused_reverse needs"):
      _mosaic_vjp(args, cts, fused_reverse=True, **options)


@pytest.mark.parametrize("pieces,key_dim", [(1, 64), (2, 64), (1, 128)])
def test_fused_grads_agree_with_the_two_kernels(pieces, key_dim):
  """The output's backward and ut_backward as one kernel
  (``fused_grads``: :func:`chunk_backward.chunk_backward`, Delta and
  dDelta formed again, neither saved by the forward nor written by the
  reverse pass) give the two kernels' gradients (with a float32 share of dk
  from the output's: ``narrow_dk=False``) to float32 rounding, over four
  chunks, whole or in two pieces, K = V and K != V (dq and dW then in
  tiles of their own); one CTA a pass (the interpreter can stall with
  several three-warpgroup CTAs on two cores). Refused where it does not
  run."""
  args, cts = _contract_inputs(11, length=256, value_heads=1,
                               key_dim=key_dim, value_dim=64)
  leaves = [jax.tree.leaves(_mosaic_vjp(args, cts, fused_reverse=True,
                                        pieces=pieces, **options))
            for options in (dict(fused_grads=True),
                            dict(fused_grads=False, narrow_dk=False))]
  for i, (got, want) in enumerate(zip(*leaves)):
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    assert utils.relative_rms_error(got, want) < 1e-6, i
  for options in (dict(fused_reverse=False), dict(schedule="one")):
    with pytest.raises(ValueError, match="fused_grads needs"):
      _mosaic_vjp(args, cts, fused_grads=True, **options)


def test_fused_grads_match_float64():
  """``fused_grads`` with grouped value heads (dq and dk per value head in
  16 bits, summed in float32) and K padded (48 -> 64): every gradient
  within fla's tolerances of float64."""
  args, cts = _contract_inputs(12, length=128, value_heads=2, key_dim=48,
                               value_dim=64)
  ref = _float64_grads(args, cts)
  got = _mosaic_vjp(args, cts, fused_reverse=True, fused_grads=True)[1]
  for name, x, want in zip(("dq", "dk", "dv", "da", "db", "dh0"), got, ref):
    err = utils.relative_rms_error(np.asarray(x, np.float64),
                                   np.asarray(want, np.float64))
    assert err < TOLERANCES[name], (name, err)


def test_backward_kernels_agree_with_the_pallas_ones():
  """Each backward kernel in Mosaic GPU alone, and all of them, against the
  Pallas backward on the same saved values (``backward=()``): the gradients
  agree to their 16-bit roundings; unknown kernel names are refused."""
  args, cts = _contract_inputs(4, length=128, value_heads=2, key_dim=64,
                               value_dim=128)
  grads = lambda backward: _mosaic_vjp(args, cts, backward=backward)[1]
  want = grads(())
  for backward in [*((name,) for name in mosaic.BACKWARD), mosaic.BACKWARD]:
    for name, got, ref in zip(("dq", "dk", "dv", "da", "db", "dh0"),
                              grads(backward), want):
      err = utils.relative_rms_error(np.asarray(got, np.float64),
                                     np.asarray(ref, np.float64))
      assert err < 1e-2, (backward, name, err)
  with pytest.raises(ValueError, match="unknown kernels"):
    grads(("scan",))


def test_ut_backward_without_w_and_u_agrees_with_the_pallas_one():
  """The Mosaic ut_backward forms dM from ``Z = dX_v V^T`` and ``dX_k K^T``
  (W and U never formed) where the Pallas one reads W and U: over five
  chunks, where the state's share of dM matters (dropping ``dX_k W^T``
  takes da and db to 2e-3), the gradients agree to their roundings."""
  args, cts = _contract_inputs(4, length=320, value_heads=2, key_dim=64,
                               value_dim=128)
  grads = lambda backward: _mosaic_vjp(args, cts, backward=backward)[1]
  names = ("dq", "dk", "dv", "da", "db", "dh0")
  bounds = dict(dq=1e-6, dk=2e-3, dv=1e-6, da=6e-4, db=6e-4, dh0=1e-6)
  for name, got, want in zip(names, grads(("ut",)), grads(())):
    err = utils.relative_rms_error(np.asarray(got, np.float64),
                                   np.asarray(want, np.float64))
    assert err < bounds[name], (name, err)


def test_narrow_dk_matches_float64():
  """The output's share of dk handed on in bf16 (``narrow_dk``, on by
  default): every gradient within fla's tolerances of float64, dk changed
  by the extra rounding (the option runs); it needs the two kernels in
  Mosaic GPU."""
  args, cts = _contract_inputs(8, length=256, value_heads=2, key_dim=128,
                               value_dim=128)
  ref = _float64_grads(args, cts)
  grads = lambda **options: _mosaic_vjp(args, cts, **options)[1]
  names = ("dq", "dk", "dv", "da", "db", "dh0")
  got = dict(zip(names, grads()))
  for name, want in zip(names, ref):
    err = utils.relative_rms_error(np.asarray(got[name], np.float64),
                                   np.asarray(want, np.float64))
    assert err < TOLERANCES[name], name
  assert np.any(got["dk"] != grads(narrow_dk=False)[1])
  with pytest.raises(ValueError, match="narrow_dk needs"):
    grads(narrow_dk=True, backward=("output", "reverse"))


def test_inverses_agree():
  """The forward with the Mosaic GPU UT inverse against the default (the
  Pallas one): outputs and final state agree to their 16-bit roundings;
  an unknown inverse is refused."""
  args, _ = _contract_inputs(6, length=128, value_heads=2, key_dim=64,
                             value_dim=64)
  run = lambda inverse: mosaic.gated_delta_mosaic(
      *args, None, None, scale=0.125, chunk_size=64, inverse=inverse)
  for got, want in zip(run("mosaic"), run("pallas")):
    err = utils.relative_rms_error(np.asarray(got, np.float64),
                                   np.asarray(want, np.float64))
    assert err < 1e-2, err
  with pytest.raises(ValueError, match="inverse"):
    run("triton")


@pytest.mark.parametrize("keys,beta", [("aligned", 1.0), ("aligned", 1.99),
                                       ("random", 1.5)])
def test_inverse_matches_float64(keys, beta):
  """T against float64 to its bf16 rounding: identical keys without decay
  (where a power series of A would cancel catastrophically), and random
  keys with a decaying gate."""
  c = ut.C
  rng = np.random.default_rng(3)
  k = rng.standard_normal((1 if keys == "aligned" else c, 64))
  k = np.tile(k, (c // len(k), 1))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  k = np.asarray(jnp.asarray(k, jnp.bfloat16), np.float64)
  g = (np.zeros(c) if keys == "aligned"
       else np.cumsum(-rng.uniform(0.0, 0.1, c)))
  b = np.full(c, beta) if keys == "aligned" else rng.uniform(0.0, 2.0, c)
  a = np.tril(np.exp(g[:, None] - g[None, :]) * (k @ k.T), -1)
  expected = np.linalg.inv(np.eye(c) + b[:, None] * a)
  t = ut.inverse(compat.Mosaic(interpret=True),
                 jnp.asarray(k[None, :, None], jnp.bfloat16),
                 jnp.asarray(g[None, None], jnp.float32),
                 jnp.asarray(b[None, None], jnp.float32), heads=1)
  got = np.asarray(t[0, 0], np.float64)
  assert np.max(np.abs(got - expected)) < 2 ** -8 * np.max(np.abs(expected))


@pytest.mark.parametrize("option,message", [
    (dict(chunk_size=32), "chunk_size must be one of"),
    (dict(segment_ids=jnp.zeros((1, 64), jnp.int32)), "segment_ids"),
    (dict(key_dim=256), "head dims up to 128"),
    (dict(dtype=jnp.float32), "q, k and v must be bfloat16 or float16"),
])
def test_mosaic_refuses_what_it_lacks(option, message):
  option = dict(option)
  dtype = option.pop("dtype", jnp.bfloat16)
  shape = dict(key_dim=option.pop("key_dim", 64),
               per_channel=option.pop("per_channel", False))
  x = utils.random_inputs(0, batch=1, length=64, heads=1, value_dim=64,
                          **shape)
  with pytest.raises(ValueError, match=message):
    deltajax.gated_delta(*(jnp.asarray(t, dtype) for t in x[:3]),
                         *(jnp.asarray(t, jnp.float32) for t in x[3:5]),
                         impl="mosaic", **option)


def test_mosaic_refuses_what_it_lacks_per_channel():
  """Gated DeltaNet-2's gates; a per-channel gate in the scan's schedules
  other than "one" or with the Mosaic GPU UT inverse."""
  with pytest.raises(ValueError, match="no 'gdn2' gate"):
    deltajax.registry.select("mosaic", gate="gdn2", length=64, chunk_size=64,
                             packed=False, grouped=False)
  x = utils.random_inputs(0, batch=1, length=64, heads=1, key_dim=64,
                          value_dim=64, per_channel=True)
  args = (*(jnp.asarray(t, jnp.bfloat16) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x[3:]))
  for option in (dict(schedule="specialized"), dict(inverse="mosaic")):
    with pytest.raises(ValueError, match="per-channel gate runs schedule"):
      mosaic.gated_delta_mosaic(*args, None, None, scale=0.125,
                                chunk_size=64, **option)


@pytest.mark.parametrize("schedule", ["one", "specialized"])
def test_kernels_lower_for_the_gpu(schedule):
  """The kernels lower to Mosaic GPU for CUDA here, without a GPU: Mosaic
  GPU's layout inference and wgmma operand checks run (what the interpreter
  skips); grouped value heads, K = V = 128 with two V blocks, the saved
  states, the per-channel scan and reverse pass ("one": K = 64 and 128,
  their decays of the state's rows a [K] vector of the row layout), the
  backward's kernels (with and without narrow_dk; the reverse pass as the
  schedule takes it), the last of them under vmap too. Lowering also checks
  that each kernel's shared memory fits in 227 KB (the per-channel scan at
  K = 128: 218 KB, the per-channel reverse pass 217 KB, the per-channel
  ut_backward 111 KB, the scores' backward 200 KB with grouped value
  heads, chunk_backward 226 KB). Under ``jax_enable_x64``, as the other tests run
  them: an array the wrappers create (the map pass's identity, say) must
  not come out float64."""
  mg = compat.Mosaic(interpret=False)
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  keys, vec = shape(1, 128, 1, 128), shape(1, 2, 128, dtype=jnp.float32)
  forward = lambda *x: scan.forward(mg, *x, scale=0.1, save=True,
                                    schedule=schedule)
  # Per channel: Q e^g, K e^g and K e^{g_C - g} per value head, g at the
  # chunks' ends, P.
  per_channel = lambda *x: scan.forward(mg, *x[:7], scale=0.1, save=True,
                                        channel=x[7:])
  decayed = lambda dk: shape(1, 128, 2, dk)
  f32 = lambda *s: shape(*s, dtype=jnp.float32)
  unsaved = lambda *x: scan.forward(mg, *x, scale=0.1, save=False,
                                    schedule=schedule)
  scan_args = (keys, keys, shape(1, 128, 2, 128), shape(1, 2, 128, 64), vec,
               vec, shape(1, 2, 128, 128, dtype=jnp.float32))
  for fn, args in [
      (lambda *x: ut.inverse(mg, *x, heads=2), (keys, vec, vec)),
      (forward, scan_args),
      (unsaved, scan_args),
      # The states saved without Delta (for chunk_backward).
      (lambda *x: scan.forward(mg, *x, scale=0.1, save=True, deltas=False,
                               schedule=schedule), scan_args),
      # The scan in two pieces, and the map pass of the first.
      (lambda *x: scan.forward(mg, *x, scale=0.1, save=True,
                               schedule=schedule, pieces=scan.Pieces(2, 1)),
       (keys, keys, shape(1, 128, 2, 128), shape(1, 2, 128, 64), vec, vec,
        shape(2, 2, 128, 128, dtype=jnp.float32))),
      (lambda *x: scan.piece_maps(mg, *x, pieces=scan.Pieces(1, 1),
                                  schedule=schedule),
       (keys, shape(1, 128, 2, 128), shape(1, 2, 128, 64), vec, vec)),
      *((per_channel, (decayed(dk), decayed(dk), shape(1, 128, 2, 128),
                       shape(1, 2, 128, 64), f32(1, 2, 2, dk), vec,
                       f32(1, 2, dk, 128), decayed(dk), f32(1, 2, 128, 64)))
        for dk in ((64, 128) if schedule == "one" else ())),
      *((lambda *x: scan.piece_maps(mg, *x[:5], pieces=scan.Pieces(1, 1),
                                    channel=x[5:]),
         (decayed(dk), shape(1, 128, 2, 128), shape(1, 2, 128, 64),
          f32(1, 2, 2, dk), vec, decayed(dk), f32(1, 2, 128, 64)))
        for dk in ((64, 128) if schedule == "one" else ())),
      *((lambda *x, narrow=narrow: output.output_backward(
          mg, *x, scale=0.1, narrow_dk=narrow),
         (keys, keys, vec, shape(1, 2, 2, 128, 128), shape(1, 128, 2, 128),
          shape(1, 128, 2, 128))) for narrow in (False, True)),
      *((lambda *x, v=values: ut.w_u(mg, *x, values=v),
         (keys, shape(1, 128, 2, 128), vec, vec, shape(1, 2, 128, 64)))
        for values in (True, False)),
      # W per channel ("one"): g [B, HV, T, K].
      *((lambda *x: ut.w_u(mg, *x, values=False),
         (shape(1, 128, 1, dk), shape(1, 128, 2, 128), f32(1, 2, 128, dk),
          vec, shape(1, 2, 128, 64)))
        for dk in ((64, 128) if schedule == "one" else ())),
      # ut_backward with a float32 and a bfloat16 dk_out (narrow_dk).
      *((lambda *x: ut_backward.ut_backward(mg, *x),
         (keys, shape(1, 128, 2, 128), vec, vec, shape(1, 2, 128, 64),
          shape(1, 2, 2, 128, 128), shape(1, 2, 2, 128, 128),
          shape(1, 128, 2, 128), shape(1, 128, 2, 128),
          shape(1, 128, 2, 128, dtype=dtype), vec))
        for dtype in (jnp.float32, jnp.bfloat16)),
      # The per-channel ut_backward ("one"): g [B, HV, T, K].
      *((lambda *x: ut_backward.ut_backward(mg, *x),
         (shape(1, 128, 1, dk), shape(1, 128, 2, 128), f32(1, 2, 128, dk),
          vec, shape(1, 2, 128, 64), shape(1, 2, 2, dk, 128),
          shape(1, 2, 2, dk, 128), shape(1, 128, 2, 128),
          shape(1, 128, 2, 128)))
        for dk in ((64, 128) if schedule == "one" else ())),
      # The scores' first pass per channel ("one"): a, q, k.
      *((lambda a, q, k: intra.forward(mg, q, k, a, heads=2, scale=0.1),
         (f32(1, 128, 2, dk), shape(1, 128, 1, dk), shape(1, 128, 1, dk)))
        for dk in ((64, 128) if schedule == "one" else ())),
      # The scores' backward per channel ("one"): q, k, g, b, a, S, dO,
      # Delta, dM, dk_in, dg_in.
      *((lambda *x: intra.backward(mg, *x, scale=0.1),
         (shape(1, 128, 1, dk), shape(1, 128, 1, dk), f32(1, 2, 128, dk),
          vec, f32(1, 128, 2, dk), shape(1, 2, 2, dk, 128),
          shape(1, 128, 2, 128), shape(1, 128, 2, 128), f32(1, 2, 128, 64),
          f32(1, 128, 2, dk), f32(1, 2, 128, dk)))
        for dk in ((64, 128) if schedule == "one" else ())),
      # The per-channel reverse pass ("one"): Q e^g, K e^{g_C - g}, g at
      # the chunks' ends.
      *((lambda *x: reverse.backward(mg, *x, scale=0.1, per_channel=True),
         (decayed(dk), decayed(dk), decayed(dk), f32(1, 2, 2, dk),
          shape(1, 128, 2, 128), f32(1, 128, 2, 128), f32(1, 2, dk, 128)))
        for dk in ((64, 128) if schedule == "one" else ())),
      # The three-warpgroup reverse pass forming W and dDelta_local.
      *((lambda *x: reverse.specialized(mg, *x, scale=0.1),
         (keys, keys, shape(1, 2, 128, 64), vec, vec, shape(1, 128, 2, 128),
          shape(1, 2, 128, 128, dtype=jnp.float32)))
        for _ in ((0,) if schedule != "one" else ())),
      # Without dDelta, and the chunk-parallel backward in one kernel
      # (K, V in {64, 128}; 226 KB of shared memory at K = V = 128).
      *((lambda *x: reverse.specialized(mg, *x, scale=0.1, deltas=False),
         (keys, keys, shape(1, 2, 128, 64), vec, vec, shape(1, 128, 2, 128),
          shape(1, 2, 128, 128, dtype=jnp.float32)))
        for _ in ((0,) if schedule != "one" else ())),
      *((lambda *x: chunk_backward.chunk_backward(mg, *x, scale=0.1),
         (shape(1, 128, 1, dk), shape(1, 128, 1, dk), shape(1, 128, 2, dv),
          vec, vec, shape(1, 2, 128, 64), shape(1, 2, 2, dk, dv),
          shape(1, 2, 2, dk, dv), shape(1, 128, 2, dv)))
        for dk, dv in (((64, 64), (128, 128), (128, 64), (64, 128))
                       if schedule != "one" else ())),
      # The reverse passes in two pieces, and the second's local pass.
      *((lambda *x, local=local: reverse.specialized(
          mg, *x, scale=0.1, local=local,
          pieces=scan.Pieces(1, 1, start=1) if local else scan.Pieces(2, 1)),
         (keys, keys, shape(1, 2, 128, 64), vec, vec, shape(1, 128, 2, 128),
          shape(2 - local, 2, 128, 128, dtype=jnp.float32)))
        for local in ((False, True) if schedule != "one" else ())),
      *((lambda *x, local=local: reverse.backward(
          mg, *x, scale=0.1, transposed=schedule != "one", local=local,
          pieces=scan.Pieces(1, 1, start=1) if local else scan.Pieces(2, 1)),
         (keys, keys, shape(1, 128, 2, 128), vec, shape(1, 128, 2, 128),
          shape(1, 128, 2, 128, dtype=jnp.float32),
          shape(2 - local, 2, 128, 128, dtype=jnp.float32)))
        for local in (False, True)),
      # The reverse pass carrying dS^T with the transposed scans.
      (lambda *x: reverse.backward(mg, *x, scale=0.1,
                                   transposed=schedule != "one"),
       (keys, keys, shape(1, 128, 2, 128), vec, shape(1, 128, 2, 128),
        shape(1, 128, 2, 128, dtype=jnp.float32),
        shape(1, 2, 128, 128, dtype=jnp.float32)))]:
    with jax.enable_x64(True):
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  # Under vmap (impl="auto" takes these kernels on Hopper): a grid axis more.
  batched = [jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in args]
  jax.jit(jax.vmap(fn)).trace(*batched).lower(lowering_platforms=("cuda",))


def test_ut_backward_shared_memory():
  """At K = V = 128 two CTAs of ut_backward fit on an H200 multiprocessor
  (228 KB, 1 KB of it reserved per CTA: 113 KB each) per channel, the
  gate's tile loaded after the value blocks, in the place of their tiles
  (103 KB with dM staged in 16 bits; 143 KB beside them), and per head as
  before: 97 KB with bfloat16 dk_out and dk, 121 KB with float32 ones
  (grouped value heads); so do two of the scores' backward. Measured from
  the lowering for CUDA."""
  mg = compat.Mosaic(interpret=False)
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  fn = lambda *x: ut_backward.ut_backward(mg, *x)
  vec, values = shape(1, 2, 128, dtype=jnp.float32), shape(1, 128, 2, 128)
  # t, states, d_next, delta, d_delta.
  chunks = (shape(1, 2, 128, 64), shape(1, 2, 2, 128, 128),
            shape(1, 2, 2, 128, 128), values, values)
  per_channel = compat.shared_memory_bytes(
      fn, shape(1, 128, 1, 128), values,
      shape(1, 2, 128, 128, dtype=jnp.float32), vec, *chunks)
  assert per_channel <= 103 * 1024 + 64, per_channel
  per_head = lambda heads, dtype: compat.shared_memory_bytes(
      fn, shape(1, 128, heads, 128), values, vec, vec, *chunks,
      shape(1, 128, 2, 128, dtype=dtype), vec)
  assert per_head(2, jnp.bfloat16) <= 99_352
  assert per_head(1, jnp.float32) <= 123_928
  # The scores' backward per channel (64 key channels a CTA, its value
  # blocks' tiles then dk_in and dg_in in one region): 111 KB with 16-bit
  # dq and dk, two CTAs; 127 KB with grouped value heads' float32 ones;
  # the same with float16 inputs (bfloat16 operands).
  f32 = lambda *s: shape(*s, dtype=jnp.float32)
  for dtype in (jnp.bfloat16, jnp.float16):
    low = lambda *s, dtype=dtype: shape(*s, dtype=dtype)
    intra_bytes = lambda heads, low=low: compat.shared_memory_bytes(
        lambda *x: intra.backward(mg, *x, scale=0.1), low(1, 128, 1, 128),
        low(1, 128, 1, 128), f32(1, heads, 128, 128), f32(1, heads, 128),
        f32(1, 128, heads, 128), low(1, heads, 2, 128, 128),
        low(1, 128, heads, 128), low(1, 128, heads, 128),
        f32(1, heads, 128, 64), f32(1, 128, heads, 128),
        f32(1, heads, 128, 128))
    assert intra_bytes(1) <= 113 * 1024, (dtype, intra_bytes(1))
    assert intra_bytes(2) <= 127 * 1024 + 64, (dtype, intra_bytes(2))
