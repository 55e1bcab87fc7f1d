"""deltajax.parallel.gated_delta_in_pieces: T cut into pieces run side by
side on one device, against one call of the rule, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import parallel
import utils

TOLERANCE = 1e-12  # float64: max abs error / max abs of the one-call value


def _values_and_grads(fn, args, cotangents):
  """``fn``'s outputs and the gradients of ``<outputs, cotangents>`` with
  respect to every argument."""
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in args)
    out, vjp = jax.vjp(fn, *args)
    return (*out, *vjp(tuple(jnp.asarray(c, jnp.float64)
                             for c in cotangents)))


def _assert_same(got, want):
  for x, y in zip(got, want, strict=True):
    err = utils.max_abs_error(x, y) / max(np.max(np.abs(np.asarray(y))),
                                          1e-30)
    assert err < TOLERANCE, err


def _w(x, seed):
  """Gated DeltaNet-2's write gate for ``x``'s values, uniform in (0, 1)."""
  return np.random.default_rng(seed).uniform(size=x.v.shape)


@pytest.mark.parametrize("gate", ["head", "channel", "gdn2"])
@pytest.mark.parametrize("pieces,length", [(3, 77), utils.slow(4, 64),
                                           utils.slow(1, 40)])
def test_pieces_match_one_call(gate, pieces, length):
  """Outputs, final state and every gradient: grouped value heads, K != V,
  an initial state, T not a multiple of pieces * chunk_size."""
  x = utils.random_inputs(pieces + length, batch=2, length=length, heads=2,
                          value_heads=4, key_dim=8, value_dim=6,
                          per_channel=gate != "head")
  args = tuple(x)
  if gate == "gdn2":  # b: the erase gate per key channel
    args = (*x[:4], np.abs(x.a) / 4, _w(x, 1), x.initial_state)

  def one_call(q, k, v, a, b, *rest):
    *w, s0 = rest
    rule = deltajax.gdn2 if w else deltajax.gated_delta
    return rule(q, k, v, a, b, *w, initial_state=s0, impl="scan",
                return_final_state=True)

  def in_pieces(q, k, v, a, b, *rest):
    *w, s0 = rest
    return parallel.gated_delta_in_pieces(
        q, k, v, a, b, pieces=pieces, initial_state=s0, impl="chunked",
        chunk_size=16, return_final_state=True, w=w[0] if w else None)

  cotangents = utils.random_cotangents(7, x)
  _assert_same(_values_and_grads(in_pieces, args, cotangents),
               _values_and_grads(one_call, args, cotangents))


def test_documents_across_and_at_piece_boundaries():
  """``segment_ids``: a document spanning pieces, one starting at a piece's
  first token (its entry state must not enter), one ending mid-piece."""
  x = utils.random_inputs(3, batch=2, length=64, heads=2, key_dim=8,
                          value_dim=8)
  ids = np.repeat(np.array([[0] * 10 + [1] * 22 + [2] * 32]), 2, axis=0)
  ids[1, 40:] = 3  # a document starting mid-piece in the second row
  cotangents = utils.random_cotangents(4, x)
  run = lambda fn: _values_and_grads(
      lambda *a: fn(*a[:5], initial_state=a[5], segment_ids=jnp.asarray(ids),
                    return_final_state=True),
      tuple(x), cotangents)
  _assert_same(
      run(lambda *a, **o: parallel.gated_delta_in_pieces(
          *a, pieces=4, impl="chunked", chunk_size=16, **o)),
      run(lambda *a, **o: deltajax.gated_delta(*a, impl="scan", **o)))


@pytest.mark.parametrize("pieces", [0, 2.0, None])
def test_pieces_must_be_a_positive_int(pieces):
  x = utils.random_inputs(0, length=32)
  with pytest.raises(ValueError, match="pieces must be a positive int"):
    parallel.gated_delta_in_pieces(*x[:5], pieces=pieces)


def test_bad_inputs_are_refused_as_gated_delta_refuses_them():
  x = utils.random_inputs(0, length=32)
  with pytest.raises(ValueError, match="chunk_size"):
    parallel.gated_delta_in_pieces(*x[:5], pieces=2, chunk_size=3)
