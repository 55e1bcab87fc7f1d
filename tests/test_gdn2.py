"""Gated DeltaNet-2 (``deltajax.gdn2``): the erase and write gates, against the
paper's rule in float64 (tests/reference.py), its gradients, and the rules it
generalises."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
import reference
import utils

IMPLS = ("scan", "chunked", "pallas")  # pallas: interpret mode on the CPU
ARGS = ("q", "k", "v", "a", "b", "w", "initial_state")
SCALE = 0.5


def _inputs(seed, *, batch=2, length=21, heads=2, value_heads=None, key_dim=6,
            value_dim=5, gates=(0.0, 1.0)):
  """float64 numpy ``(q, k, v, a, b, w, initial_state)``: unit keys, per
  channel decays, erase and write gates uniform in ``gates``."""
  rng = np.random.default_rng(seed)
  hv = value_heads or heads
  q = rng.standard_normal((batch, length, heads, key_dim))
  k = rng.standard_normal((batch, length, heads, key_dim))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((batch, length, hv, value_dim))
  a = -rng.uniform(0.0, 0.7, (batch, length, hv, key_dim))
  b = rng.uniform(*gates, (batch, length, hv, key_dim))
  w = rng.uniform(*gates, (batch, length, hv, value_dim))
  s0 = rng.standard_normal((batch, hv, key_dim, value_dim))
  return q, k, v, a, b, w, s0


def _gdn2(impl, q, k, v, a, b, w, s0, **options):
  return deltajax.gdn2(q, k, v, a, b, w, initial_state=s0, scale=SCALE,
                       impl=impl, return_final_state=True, **options)


def _chunk(impl, c):
  """The chunk size c, at least the Pallas kernels' 16 for "pallas"."""
  return max(c, 16) if impl == "pallas" else c


def _by_value_head(x, groups):
  """q/k heads repeated for grouped value heads."""
  return np.repeat(x, groups, axis=2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(21, 2, 2, 6, 5, 8), (50, 1, 2, 48, 40, 16),
                                   (33, 2, 4, 8, 8, 16)],
                         ids=["T21_C8", "K48_V40", "GVA_2_4"])
def test_gdn2_matches_the_paper_rule(impl, shape):
  """Outputs and final states, float64: T not a multiple of the chunk, K !=
  V, grouped value heads, an initial state."""
  t, h, hv, dk, dv, c = shape
  x = _inputs(1 + t + dk, batch=1 if dk > 40 else 2, length=t, heads=h,
              value_heads=hv, key_dim=dk, value_dim=dv)
  with jax.enable_x64(True):
    o, s = _gdn2(impl, *x, chunk_size=_chunk(impl, c))
  q, k = (_by_value_head(y, hv // h) for y in x[:2])
  ro, rs = reference.ref_gdn2(q * SCALE, k, *x[2:])
  assert utils.relative_max_error(o, ro) < 1e-12
  assert utils.relative_max_error(s, rs) < 1e-12


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn2_gradients_match_autodiff_of_the_rule(impl):
  """All seven gradients, float64, against autodiff of a plain scan of the
  paper's rule."""
  x = _inputs(7, length=10, key_dim=4, value_dim=3)
  cts = utils.random_cotangents(8, utils.Inputs(*x[:5], x[6]))
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(y) for y in x)
    _, grads = utils.vjp(
        functools.partial(_gdn2, impl, chunk_size=_chunk(impl, 4)), args, cts)
    _, ref = utils.vjp(lambda q, *r: reference.plain_scan_gdn2(q * SCALE, *r),
                       args, cts)
  for name, g, r in zip(ARGS, grads, ref):
    assert g.shape == r.shape, name
    assert utils.relative_max_error(g, r) < 1e-10, (
        name, utils.relative_max_error(g, r))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gates", [(0.0, 1e-4), (0.9999, 1.0), (1.9, 2.0)],
                         ids=["near0", "near1", "near2"])
def test_gdn2_at_the_gates_edges(impl, gates):
  """Erase and write gates near 0, 1 and 2, with strong decays on a few
  channels, float64 against the rule."""
  x = list(_inputs(11, length=24, key_dim=8, value_dim=4, gates=gates))
  x[3][..., :2] = -30.0
  with jax.enable_x64(True):
    o, s = _gdn2(impl, *x, chunk_size=_chunk(impl, 8))
  ro, rs = reference.ref_gdn2(x[0] * SCALE, *x[1:])
  assert np.all(np.isfinite(np.asarray(o)))
  assert utils.relative_max_error(o, ro) < 1e-10
  assert utils.relative_max_error(s, rs) < 1e-10


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn2_with_beta_gates_is_kda_and_gated_delta(impl):
  """``b = w = beta`` broadcast gives :func:`deltajax.kda`; with a per-head
  decay broadcast over the channels too, :func:`deltajax.gated_delta`."""
  q, k, v, a, _, _, s0 = _inputs(3)
  beta = np.random.default_rng(4).uniform(0, 1, a.shape[:3])
  b = np.broadcast_to(beta[..., None], a.shape)
  w = np.broadcast_to(beta[..., None], v.shape)
  head = a[..., 0]
  with jax.enable_x64(True):
    run = lambda f, *y: f(*y, initial_state=s0, scale=SCALE, impl=impl,
                          chunk_size=_chunk(impl, 8))
    got = run(deltajax.gdn2, q, k, v, a, b, w)
    np.testing.assert_allclose(got, run(deltajax.kda, q, k, v, a, beta),
                               rtol=1e-12, atol=1e-12)
    got = run(deltajax.gdn2, q, k, v,
              np.broadcast_to(head[..., None], a.shape), b, w)
    np.testing.assert_allclose(
        got, run(deltajax.gated_delta, q, k, v, head, beta), rtol=1e-12,
        atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn2_packed_sequences(impl):
  """cu_seqlens and segment_ids: each sequence as if run alone, from its
  own initial state (cu_seqlens) or from zero after a segment change."""
  q, k, v, a, b, w, _ = _inputs(5, batch=1, length=30)
  cu = [0, 7, 7, 30]
  s0 = np.random.default_rng(6).standard_normal((3, 2, 6, 5))
  with jax.enable_x64(True):
    o, s = _gdn2(impl, q, k, v, a, b, w, s0, cu_seqlens=np.array(cu),
                 chunk_size=_chunk(impl, 8))
    for n in range(3):
      part = slice(cu[n], cu[n + 1])
      if cu[n] == cu[n + 1]:
        np.testing.assert_allclose(s[n], s0[n], rtol=1e-12)
        continue
      ro, rs = reference.ref_gdn2(
          q[:, part] * SCALE, *(y[:, part] for y in (k, v, a, b, w)),
          s0[n:n + 1])
      np.testing.assert_allclose(o[:, part], ro, rtol=1e-10, atol=1e-12)
      np.testing.assert_allclose(s[n:n + 1], rs, rtol=1e-10, atol=1e-12)
    ids = np.repeat(np.array([[0, 1]]), [12, 18], axis=1)
    o = deltajax.gdn2(q, k, v, a, b, w, scale=SCALE, segment_ids=ids,
                      impl=impl, chunk_size=_chunk(impl, 8))
    ro, _ = reference.ref_gdn2(q[:, 12:] * SCALE,
                               *(y[:, 12:] for y in (k, v, a, b, w)))
    np.testing.assert_allclose(o[:, 12:], ro, rtol=1e-10, atol=1e-12)


def test_gdn2_implementations_and_errors():
  """"auto" runs it (on the CPU scan or chunked); bad shapes name the
  argument."""
  q, k, v, a, b, w, s0 = (jnp.asarray(y, jnp.float32) for y in _inputs(9))
  assert deltajax.registry.select(
      "auto", gate="gdn2", length=21, chunk_size=64, packed=False,
      grouped=False).name in ("scan", "chunked")
  with pytest.raises(ValueError, match="w must have shape"):
    deltajax.gdn2(q, k, v, a, b, w[..., :-1])
  with pytest.raises(ValueError, match="b must have shape"):
    deltajax.gdn2(q, k, v, a, b[..., 0], w)
  with pytest.raises(ValueError, match="gdn2 needs the per-channel gate"):
    deltajax.gdn2(q, k, v, a[..., 0], b, w)
  with pytest.raises(TypeError, match="w must be a floating-point"):
    deltajax.gdn2(q, k, v, a, b, w.astype(jnp.int32))
  o = deltajax.gdn2(q[0, :, 0], k[0, :, 0], v[0, :, 0], a[0, :, 0],
                    b[0, :, 0], w[0, :, 0])
  np.testing.assert_allclose(o, deltajax.gdn2(q, k, v, a, b, w)[0, :, 0],
                             rtol=1e-5, atol=1e-6)


def test_gdn2_decoding_steps_equal_the_full_call():
  """``gated_delta_step(..., w=w)`` token by token, through the jnp step
  and the Pallas kernel (interpret mode; K, V padded), gives gdn2's outputs
  and final state (GVA)."""
  q, k, v, a, b, w, s0 = _inputs(12, length=9, heads=1, value_heads=2)
  with jax.enable_x64(True):
    o_full, s_full = _gdn2("scan", q, k, v, a, b, w, s0)
    for impl in ("jnp", "pallas"):
      state, outs = jnp.asarray(s0), []
      for t in range(q.shape[1]):
        o, state = deltajax.gated_delta_step(
            state, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], w=w[:, t],
            scale=SCALE, impl=impl)
        outs.append(o)
      np.testing.assert_allclose(np.stack(outs, 1), o_full, rtol=1e-12,
                                 atol=1e-12, err_msg=impl)
      np.testing.assert_allclose(state, s_full, rtol=1e-12, atol=1e-12,
                                 err_msg=impl)
    with pytest.raises(ValueError, match="w must have shape"):
      deltajax.gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], a[:, 0],
                                b[:, 0], w=w[:, 0, :, :-1])
