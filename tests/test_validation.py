"""Bad input raises ValueError or TypeError with a message that says what is wrong."""

import jax.numpy as jnp
import numpy as np
import pytest

import deltajax

B, T, H, K, V = 2, 6, 3, 4, 5


def _args(**changes):
  """Valid rank-4 float32 arguments (scalar gate) with ``changes`` applied."""
  args = dict(q=jnp.ones((B, T, H, K), jnp.float32),
              k=jnp.ones((B, T, H, K), jnp.float32),
              v=jnp.ones((B, T, H, V), jnp.float32),
              a=jnp.zeros((B, T, H), jnp.float32),
              b=jnp.ones((B, T, H), jnp.float32))
  args.update(changes)
  return args


def _zeros(*shape, dtype=jnp.float32):
  return jnp.zeros(shape, dtype)


BAD_CALLS = {
    "q rank 3": (ValueError, r"q has rank 3", dict(q=_zeros(B, T, K))),
    "k shape": (ValueError, r"k must have shape",
                dict(k=_zeros(B, T, H, K + 1))),
    "v batch": (ValueError, r"v must have shape \[B, T, HV, V\]",
                dict(v=_zeros(B + 1, T, H, V))),
    "v length": (ValueError, r"v must have shape \[B, T, HV, V\]",
                 dict(v=_zeros(B, T + 1, H, V))),
    "v heads": (ValueError, r"HV a multiple of H = 3",
                dict(v=_zeros(B, T, H + 1, V))),
    "v rank": (ValueError, r"v must have shape", dict(v=_zeros(B, T, H))),
    "a shape": (ValueError, r"a must have shape \[B, T, HV\]",
                dict(a=_zeros(B, T, H, K + 1))),
    "a length": (ValueError, r"a must have shape", dict(a=_zeros(B, T - 1, H))),
    "b shape": (ValueError, r"b must have shape \[B, T, HV\]",
                dict(b=_zeros(B, T, H, 1))),
    "state shape": (ValueError, r"initial_state must have shape \[N, HV, K, V\]",
                    dict(initial_state=_zeros(B, H, V, K))),
    "empty T": (ValueError, r"T, K and V must be positive",
                dict(q=_zeros(B, 0, H, K), k=_zeros(B, 0, H, K),
                     v=_zeros(B, 0, H, V), a=_zeros(B, 0, H),
                     b=_zeros(B, 0, H))),
    "integer q": (TypeError, r"q must be a floating-point array",
                  dict(q=jnp.ones((B, T, H, K), jnp.int32))),
    "integer state": (TypeError, r"initial_state must be a floating-point",
                      dict(initial_state=jnp.ones((B, H, K, V), jnp.int32))),
    "chunk 48": (ValueError, r"chunk_size must be a power of two",
                 dict(chunk_size=48)),
    "chunk 0": (ValueError, r"chunk_size must be a power of two",
                dict(chunk_size=0)),
    "chunk float": (TypeError, r"chunk_size must be an int; got float",
                    dict(chunk_size=64.0)),
    "chunk bool": (TypeError, r"chunk_size must be an int; got bool",
                   dict(chunk_size=True)),
    "pallas chunk 8": (ValueError, r"impl='pallas' cannot run this call: "
                       r"chunk_size must be one of \(16, 32, 64\)",
                       dict(chunk_size=8, impl="pallas")),
    "string scale": (TypeError, r"scale must be a Python or numpy real number",
                     dict(scale="x")),
    "segment_ids float": (TypeError, r"segment_ids must be an integer array",
                          dict(segment_ids=_zeros(B, T))),
    "segment_ids shape": (ValueError, r"segment_ids must have shape \[B, T\]",
                          dict(segment_ids=_zeros(B, T + 1, dtype=jnp.int32))),
    "cu_seqlens batch": (ValueError, r"with cu_seqlens, q must have batch "
                         r"size 1", dict(cu_seqlens=jnp.array([0, T]))),
    "cu_seqlens float": (TypeError, r"cu_seqlens must be an integer array",
                         dict(cu_seqlens=jnp.array([0.0, T]))),
    "cu_seqlens and segment_ids": (
        ValueError, r"segment_ids or cu_seqlens, not both",
        dict(cu_seqlens=jnp.array([0, T]),
             segment_ids=_zeros(B, T, dtype=jnp.int32))),
    "A_log shape": (ValueError, r"A_log must have shape \[HV\]",
                    dict(A_log=_zeros(H + 1))),
    "dt_bias without A_log": (ValueError, r"dt_bias needs A_log",
                              dict(dt_bias=_zeros(H))),
    "kda dt_bias shape": (ValueError, r"dt_bias must have shape \[HV, K\]",
                          dict(a=_zeros(B, T, H, K), A_log=_zeros(H),
                               dt_bias=_zeros(H))),
    "unknown impl": (ValueError, r"impl must be one of .*'fast'",
                     dict(impl="fast")),
    "array scale": (TypeError, r"scale must be a Python or numpy real number",
                    dict(scale=jnp.float32(0.5))),
    "rank-2 v": (ValueError, r"k and v must be \[T, K\] and \[T, V\]",
                 dict(q=_zeros(T, K), k=_zeros(T, K), v=_zeros(B, T, H, V))),
    "rank-2 gate": (ValueError, r"a must be \[T\] or \[T, K\] and b \[T\]",
                    dict(q=_zeros(T, K), k=_zeros(T, K), v=_zeros(T, V),
                         a=_zeros(T, 1, 1), b=_zeros(T))),
    "rank-2 state": (ValueError, r"initial_state must be \[K, V\]",
                     dict(q=_zeros(T, K), k=_zeros(T, K), v=_zeros(T, V),
                          a=_zeros(T), b=_zeros(T),
                          initial_state=_zeros(1, K, V))),
}


@pytest.mark.parametrize("name", tuple(BAD_CALLS))
def test_gated_delta_rejects(name):
  error, message, changes = BAD_CALLS[name]
  with pytest.raises(error, match=message):
    deltajax.gated_delta(**_args(**changes))


def test_kda_needs_per_channel_gate():
  with pytest.raises(ValueError, match=r"kda needs the per-channel gate"):
    deltajax.kda(**_args())


BAD_STEPS = {
    "q rank": (ValueError, r"q must have shape \[B, H, K\]",
               dict(q=_zeros(B, K))),
    "k shape": (ValueError, r"k must have shape", dict(k=_zeros(B, H, K + 1))),
    "v heads": (ValueError, r"v must have shape \[B, HV, V\]",
                dict(v=_zeros(B, H + 1, V))),
    "a shape": (ValueError, r"a must have shape \[B, HV\]",
                dict(a=_zeros(B, H, V + K))),
    "b shape": (ValueError, r"b must have shape", dict(b=_zeros(B, H, 1))),
    "state shape": (ValueError, r"state must have shape \[B, HV, K, V\]",
                    dict(state=_zeros(B, H, V, K))),
    "integer v": (TypeError, r"v must be a floating-point array",
                  dict(v=jnp.ones((B, H, V), jnp.int32))),
    "impl": (ValueError, r"impl must be one of \('auto', 'jnp', 'pallas'\)",
             dict(impl="scan")),
}


@pytest.mark.parametrize("name", tuple(BAD_STEPS))
def test_gated_delta_step_rejects(name):
  error, message, changes = BAD_STEPS[name]
  args = dict(state=_zeros(B, H, K, V), q=_zeros(B, H, K), k=_zeros(B, H, K),
              v=_zeros(B, H, V), a=_zeros(B, H), b=_zeros(B, H))
  args.update(changes)
  with pytest.raises(error, match=message):
    deltajax.gated_delta_step(**args)


def test_numpy_numbers_are_accepted():
  o = deltajax.gated_delta(**_args(chunk_size=np.int64(16),
                                   scale=np.float32(0.5)))
  assert o.shape == (B, T, H, V)


def test_valid_arguments_are_accepted():
  """The arguments the tests above corrupt are themselves valid."""
  o = deltajax.gated_delta(**_args(initial_state=_zeros(B, H, K, V)))
  assert o.shape == (B, T, H, V)
  o, state = deltajax.gated_delta_step(
      _zeros(B, H, K, V), _zeros(B, H, K), _zeros(B, H, K), _zeros(B, H, V),
      _zeros(B, H), _zeros(B, H))
  assert o.shape == (B, H, V) and state.shape == (B, H, K, V)
