"""Bad input raises ValueError or TypeError with a message that says what is wrong."""

import dataclasses
import re

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import common

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
    "empty T": (ValueError, r"T, H, HV, K and V must be positive",
                dict(q=_zeros(B, 0, H, K), k=_zeros(B, 0, H, K),
                     v=_zeros(B, 0, H, V), a=_zeros(B, 0, H),
                     b=_zeros(B, 0, H))),
    "no heads": (ValueError, r"T, H, HV, K and V must be positive; got q "
                 r"\(2, 6, 0, 4\)",
                 dict(q=_zeros(B, T, 0, K), k=_zeros(B, T, 0, K),
                      v=_zeros(B, T, 0, V), a=_zeros(B, T, 0),
                      b=_zeros(B, T, 0))),
    "no value heads": (ValueError, r"T, H, HV, K and V must be positive; got "
                       r".* v \(2, 6, 0, 5\)",
                       dict(v=_zeros(B, T, 0, V), a=_zeros(B, T, 0),
                            b=_zeros(B, T, 0))),
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
    "NaN scale": (ValueError, r"scale must be finite; got nan",
                  dict(scale=float("nan"))),
    "infinite scale": (ValueError, r"scale must be finite; got -inf",
                       dict(scale=-np.inf)),
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


@pytest.mark.parametrize("scale", (np.nan, np.inf))
@pytest.mark.parametrize("rule", ("kda", "gdn2"))
def test_kda_and_gdn2_refuse_a_non_finite_scale(rule, scale):
  args = _args(a=_zeros(B, T, H, K), scale=scale)
  if rule == "gdn2":  # the erase and write gates
    args |= dict(b=_zeros(B, T, H, K), w=_zeros(B, T, H, V))
  with pytest.raises(ValueError, match=r"scale must be finite"):
    getattr(deltajax, rule)(**args)


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
    "NaN scale": (ValueError, r"scale must be finite; got nan",
                  dict(scale=np.nan)),
    "no heads": (ValueError, r"H, HV, K and V must be positive; got q "
                 r"\(2, 0, 4\)",
                 dict(state=_zeros(B, 0, K, V), q=_zeros(B, 0, K),
                      k=_zeros(B, 0, K), v=_zeros(B, 0, V), a=_zeros(B, 0),
                      b=_zeros(B, 0))),
    "no value heads": (ValueError, r"H, HV, K and V must be positive; got .* "
                       r"v \(2, 0, 5\)",
                       dict(state=_zeros(B, 0, K, V), v=_zeros(B, 0, V),
                            a=_zeros(B, 0), b=_zeros(B, 0))),
    "K = 0": (ValueError, r"H, HV, K and V must be positive",
              dict(state=_zeros(B, H, 0, V), q=_zeros(B, H, 0),
                   k=_zeros(B, H, 0))),
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


# --- Values ------------------------------------------------------------------
#
# A concrete cu_seqlens is checked on the host; the values of the arrays (and
# a traced cu_seqlens) by checkify debug checks, which only checkify turns on.

T_PACKED = 40
CU_RULE = (r"cu_seqlens must start at 0, be non-decreasing and end at T = 40; "
           r"got ")
BAD_CU_SEQLENS = {
    "decreasing": ([0, 30, 20, 40], r"cu_seqlens\[2\] = 20"),
    "last is not T": ([0, 10, 30], r"cu_seqlens\[2\] = 30"),
    "first is not 0": ([5, 10, 40], r"cu_seqlens\[0\] = 5"),
}


def _packed(**changes):
  """Valid arguments of two packed sequences, B = 1, T = 40."""
  args = dict(q=jnp.full((1, T_PACKED, H, K), 0.5),
              k=jnp.full((1, T_PACKED, H, K), 0.5),
              v=jnp.ones((1, T_PACKED, H, V)),
              a=jnp.full((1, T_PACKED, H), -0.1),
              b=jnp.full((1, T_PACKED, H), 0.5),
              cu_seqlens=jnp.array([0, 15, T_PACKED]))
  args.update(changes)
  return args


def _checkify_error(fn, *args):
  """The user-check error message of ``jit(fn)(*args)`` traced inside
  ``value_checks``, under checkify, or None."""
  with deltajax.value_checks():
    error, _ = checkify.checkify(jax.jit(fn),
                                 errors=checkify.user_checks)(*args)
  return error.get()


def _gated_delta_error(args):
  """:func:`_checkify_error` of ``gated_delta(**args)``, its arrays traced."""
  arrays = {n: x for n, x in args.items() if isinstance(x, jax.Array)}
  options = {n: x for n, x in args.items() if n not in arrays}
  return _checkify_error(
      lambda arrays: deltajax.gated_delta(**arrays, **options), arrays)


@pytest.mark.parametrize("kind", ("list", "numpy", "jax"))
@pytest.mark.parametrize("name", tuple(BAD_CU_SEQLENS))
def test_concrete_cu_seqlens_is_checked(name, kind):
  values, position = BAD_CU_SEQLENS[name]
  cu_seqlens = {"list": values, "numpy": np.array(values),
                "jax": jnp.array(values)}[kind]
  with pytest.raises(ValueError, match=CU_RULE + position):
    deltajax.gated_delta(**_packed(cu_seqlens=cu_seqlens))


def test_kda_checks_concrete_cu_seqlens():
  values, position = BAD_CU_SEQLENS["decreasing"]
  with pytest.raises(ValueError, match=CU_RULE + position):
    deltajax.kda(**_packed(a=jnp.zeros((1, T_PACKED, H, K)),
                           cu_seqlens=np.array(values)))


@pytest.mark.parametrize("name", tuple(BAD_CU_SEQLENS))
def test_traced_cu_seqlens_is_checked_under_checkify(name):
  values, position = BAD_CU_SEQLENS[name]
  message = _gated_delta_error(_packed(cu_seqlens=jnp.array(values)))
  assert re.search(CU_RULE + position, message), message


def test_traced_bad_cu_seqlens_stays_in_bounds():
  """Unchecked, a bad traced cu_seqlens gives garbage, never out-of-range indices."""
  for values in ([0, 30, 20, 40], [0, 40, -100, 40], [40, 0, 0, 40],
                 [-64, 0, 100, 40], [0, 10, 20, 30]):
    layout = jax.jit(common.chunk_layout, static_argnums=(1, 2))(
        jnp.array(values), T_PACKED, 16)
    assert np.all((layout.chunk_seq >= 0) & (layout.chunk_seq < 3)), values
    assert np.all((layout.source >= 0) & (layout.source <= T_PACKED)), values
    o = jax.jit(lambda cu: deltajax.gated_delta(
        **_packed(cu_seqlens=cu)))(jnp.array(values))
    assert o.shape == (1, T_PACKED, H, V)


def test_segment_ids_need_no_order():
  """Only changes of the id count: an id that comes back starts a new segment."""
  args = _packed(cu_seqlens=None)
  repeated = jnp.array([[0] * 15 + [1] * 10 + [0] * 15])
  numbered = jnp.array([[0] * 15 + [1] * 10 + [2] * 15])
  np.testing.assert_array_equal(
      deltajax.gated_delta(**args, segment_ids=repeated),
      deltajax.gated_delta(**args, segment_ids=numbered))
  assert _gated_delta_error(args | dict(segment_ids=repeated)) is None


def _nan_at(x, index):
  return x.at[index].set(jnp.nan)


BAD_VALUES = {
    "a = 1": (dict(a=jnp.ones((B, T, H))),
              r"a must be <= 0 \(a log decay; -inf forgets fully\); "
              r"got a\[0, 0, 0\] = 1"),
    "a NaN": (dict(a=_nan_at(jnp.zeros((B, T, H)), (1, 2, 0))),
              r"a must be <= 0 .*; got a\[1, 2, 0\] = nan"),
    "kda a > 0": (dict(a=jnp.zeros((B, T, H, K)).at[0, 1, 2, 3].set(0.5)),
                  r"a must be <= 0 .*; got a\[0, 1, 2, 3\] = 0.5"),
    "b = 3": (dict(b=jnp.full((B, T, H), 3.0)),
              r"b must be in \[0, 2\]; got b\[0, 0, 0\] = 3"),
    "b = -0.5": (dict(b=jnp.ones((B, T, H)).at[1, 5, 2].set(-0.5)),
                 r"b must be in \[0, 2\]; got b\[1, 5, 2\] = -0.5"),
    "b NaN": (dict(b=_nan_at(jnp.ones((B, T, H)), (0, 3, 1))),
              r"b must be in \[0, 2\]; got b\[0, 3, 1\] = nan"),
    "doubled b = 1.5": (
        dict(b=jnp.full((B, T, H), 1.5), allow_neg_eigval=True),
        r"b must be in \[0, 1\] \(allow_neg_eigval doubles it\); got "
        r"b\[0, 0, 0\] = 1.5"),
    "logit b NaN": (dict(b=_nan_at(jnp.ones((B, T, H)), (0, 0, 0)),
                         beta_sigmoid=True),
                    r"b must not be NaN; got b\[0, 0, 0\] = nan"),
    "gate input NaN": (dict(a=_nan_at(jnp.ones((B, T, H)), (1, 0, 0)),
                            A_log=jnp.zeros(H)),
                       r"a must not be NaN; got a\[1, 0, 0\] = nan"),
    "A_log NaN": (dict(A_log=_nan_at(jnp.zeros(H), 1)),
                  r"A_log must not be NaN; got A_log\[1\] = nan"),
    "q NaN": (dict(q=_nan_at(jnp.ones((B, T, H, K)), (1, 2, 0, 3))),
              r"q must be finite; got q\[1, 2, 0, 3\] = nan"),
    "k inf": (dict(k=jnp.ones((B, T, H, K)).at[0, 0, 1, 0].set(jnp.inf)),
              r"k must be finite; got k\[0, 0, 1, 0\] = inf"),
    "v NaN": (dict(v=_nan_at(jnp.ones((B, T, H, V)), (0, 1, 2, 3))),
              r"v must be finite; got v\[0, 1, 2, 3\] = nan"),
    "initial_state NaN": (
        dict(initial_state=_nan_at(jnp.zeros((B, H, K, V)), (1, 0, 0, 0))),
        r"initial_state must be finite; got initial_state\[1, 0, 0, 0\] = "
        r"nan"),
}


@pytest.mark.parametrize("name", tuple(BAD_VALUES))
def test_bad_values_are_named_under_checkify(name):
  changes, message = BAD_VALUES[name]
  got = _gated_delta_error(_args(**changes))
  assert got is not None and re.search(message, got), got


STEP_BAD_VALUES = {
    "a = 1": (dict(a=jnp.ones((B, H))),
              r"a must be <= 0 .*; got a\[0, 0\] = 1"),
    "b = 3": (dict(b=jnp.full((B, H), 3.0)),
              r"b must be in \[0, 2\]; got b\[0, 0\] = 3"),
    "state NaN": (dict(state=_nan_at(jnp.zeros((B, H, K, V)), (0, 1, 2, 3))),
                  r"state must be finite; got state\[0, 1, 2, 3\] = nan"),
}


@pytest.mark.parametrize("name", tuple(STEP_BAD_VALUES))
def test_step_bad_values_are_named_under_checkify(name):
  changes, message = STEP_BAD_VALUES[name]
  args = dict(state=_zeros(B, H, K, V), q=_zeros(B, H, K), k=_zeros(B, H, K),
              v=_zeros(B, H, V), a=_zeros(B, H), b=_zeros(B, H)) | changes
  got = _checkify_error(lambda args: deltajax.gated_delta_step(**args), args)
  assert got is not None and re.search(message, got), got


VALID_VALUES = {
    "a = -inf, b = 0 and 2": _args(
        a=jnp.zeros((B, T, H)).at[:, 2].set(-jnp.inf),
        b=jnp.zeros((B, T, H)).at[:, 3].set(2.0)),
    "state": _args(initial_state=jnp.ones((B, H, K, V))),
    "kda": _args(a=jnp.full((B, T, H, K), -0.5)),
    "gate input and logits": _args(
        a=jnp.full((B, T, H), 50.0), A_log=jnp.zeros(H), dt_bias=jnp.ones(H),
        b=jnp.full((B, T, H), -30.0), beta_sigmoid=True,
        allow_neg_eigval=True),
    "doubled b = 1": _args(b=jnp.ones((B, T, H)), allow_neg_eigval=True),
    "packed, an empty sequence": _packed(
        cu_seqlens=jnp.array([0, 0, 17, T_PACKED])),
}


@pytest.mark.parametrize("name", tuple(VALID_VALUES))
def test_valid_values_pass_checkify(name):
  assert _gated_delta_error(VALID_VALUES[name]) is None


def test_value_checks_run_eagerly_and_through_gradients():
  """checkify without an outer jit, and of a gradient (a training step)."""
  args = _args(b=jnp.full((B, T, H), 3.0))
  with deltajax.value_checks():
    error, _ = checkify.checkify(deltajax.gated_delta,
                                 errors=checkify.user_checks)(**args)
  with pytest.raises(checkify.JaxRuntimeError, match=r"b must be in \[0, 2\]"):
    error.throw()
  loss = lambda q: jnp.sum(deltajax.gated_delta(**args | dict(q=q)) ** 2)
  assert "b must be in [0, 2]" in _checkify_error(jax.grad(loss), args["q"])


def _squared_sum(fn):
  return lambda *x: jnp.sum(fn(*x) ** 2)


PROGRAMS = {
    "packed": (lambda q, cu: deltajax.gated_delta(**_packed(
        q=q, cu_seqlens=cu, initial_state=jnp.zeros((2, H, K, V)))),
               (jnp.ones((1, T_PACKED, H, K)), jnp.array([0, 15, T_PACKED]))),
    "gradient, A_log and logits": (
        jax.grad(_squared_sum(lambda q: deltajax.gated_delta(
            **_args(q=q, A_log=jnp.zeros(H), beta_sigmoid=True)))),
        (jnp.ones((B, T, H, K)),)),
    "step": (lambda a: deltajax.gated_delta_step(
        _zeros(B, H, K, V), _zeros(B, H, K), _zeros(B, H, K), _zeros(B, H, V),
        a, _zeros(B, H)), (_zeros(B, H),)),
}


@pytest.mark.parametrize("name", tuple(PROGRAMS))
def test_value_checks_are_off_outside_value_checks(name):
  """Outside ``value_checks`` a call has no effect, so that its jitted
  caller keeps JAX's fast dispatch path; inside, the checks are there (in
  a fresh function: jit caches the trace of ``fn``)."""
  fn, args = PROGRAMS[name]
  assert not jax.make_jaxpr(fn)(*args).effects
  with deltajax.value_checks():
    assert jax.make_jaxpr(lambda *x: fn(*x))(*args).effects


# Each backend's config validates its fields when built: (constructor,
# keyword arguments, the field the ValueError names).
BAD_CONFIGS = {
    "mosaic pieces 0": (lambda: deltajax.mosaic.Config(pieces=0),
                        r"Config\.pieces must be None or a positive int"),
    "mosaic pieces float": (lambda: deltajax.mosaic.Config(pieces=2.0),
                            r"Config\.pieces"),
    "mosaic pieces bool": (lambda: deltajax.mosaic.Config(pieces=True),
                           r"Config\.pieces"),
    "pallas precision": (lambda: deltajax.pallas.Config(precision="tf16"),
                         r"Config\.precision must be one of"),
    "pallas interpret": (lambda: deltajax.pallas.Config(interpret="yes"),
                         r"Config\.interpret"),
    "pallas launch": (lambda: deltajax.pallas.Config(inverse=4),
                      r"Config\.inverse must be a Launch"),
    "pallas channel": (lambda: deltajax.pallas.Config(
        channel=(("scan", deltajax.pallas.Launch()),)), r"Config\.channel"),
    "launch warps": (lambda: deltajax.pallas.Launch(num_warps=3),
                     r"Launch\.num_warps must be a power of two"),
    "launch stages": (lambda: deltajax.pallas.Launch(num_stages=0),
                      r"Launch\.num_stages"),
    "launch block": (lambda: deltajax.pallas.Launch(block_v=8),
                     r"Launch\.block_v must be None or a power of two"),
}


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_configs_validate_their_fields(name):
  build, message = BAD_CONFIGS[name]
  with pytest.raises(ValueError, match=message):
    build()


def test_configs_are_frozen_and_hashable():
  """Static under ``jit``: equal configs hash alike; fields cannot be set."""
  for config in (deltajax.mosaic.Config(pieces=2), deltajax.pallas.Config(
      inverse=deltajax.pallas.Launch(num_warps=2))):
    assert hash(config) == hash(type(config)(**vars(config)))
    with pytest.raises(AttributeError):
      config.interpret = True
  assert deltajax.mosaic.Config(pieces=np.int64(4)).pieces == 4


@pytest.mark.parametrize("impl,config,message", [
    ("pallas", deltajax.mosaic.Config(),
     r"config=Config\(pieces=None\) is impl='mosaic''s; impl='pallas' takes "
     r"deltajax\.pallas\.core\.Config"),
    ("mosaic", deltajax.pallas.Config(), r"is impl='pallas''s; "
     r"impl='mosaic' takes deltajax\.mosaic\.ops\.Config"),
    ("chunked", deltajax.pallas.Config(), r"impl='chunked' takes no config"),
    ("auto", {"pieces": 2}, r"config must be None or one of "
     r"deltajax\.pallas\.core\.Config \(impl='pallas'\), "
     r"deltajax\.mosaic\.ops\.Config \(impl='mosaic'\)"),
], ids=("mosaic-to-pallas", "pallas-to-mosaic", "pallas-to-chunked",
        "not-a-config"))
def test_config_of_another_implementation_is_refused(impl, config, message):
  for rule, args in ((deltajax.gated_delta, _args()),
                     (deltajax.kda, _args(a=_zeros(B, T, H, K)))):
    with pytest.raises(TypeError, match=message):
      rule(**args, impl=impl, config=config)


def _spy(monkeypatch, impl):
  """Replaces ``impl``'s function in the registry by one that records the
  config it gets and returns zeros; returns the list of configs."""
  seen = []
  entry = deltajax.registry.REGISTRY[impl]

  def fn(q, k, v, a, b, initial_state, cut, chunk_seq, *, scale, chunk_size,
         config):
    seen.append(config)
    return jnp.zeros_like(v), initial_state
  monkeypatch.setitem(deltajax.registry.REGISTRY, impl,
                      dataclasses.replace(entry, fn=fn))
  return seen


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_pallas_config_reaches_its_kernels(impl, monkeypatch):
  """``config=deltajax.pallas.Config(...)`` is passed to impl="pallas",
  which it picks under "auto" (the shapes are this test's own: no trace of
  another test's is reused)."""
  config = deltajax.pallas.Config(precision="tf32")
  seen = _spy(monkeypatch, "pallas")
  deltajax.gated_delta(**_args(q=_zeros(1, 32, 1, 24), k=_zeros(1, 32, 1, 24),
                               v=_zeros(1, 32, 1, 40), a=_zeros(1, 32, 1),
                               b=_zeros(1, 32, 1)), impl=impl, config=config)
  assert seen == [config]


@pytest.mark.parametrize("rule", ["gated_delta", "kda", "gdn2"])
def test_mosaic_config_picks_mosaic_under_auto(rule, monkeypatch):
  """``config=deltajax.mosaic.Config(...)`` with impl="auto" runs
  impl="mosaic" (with that config) for each rule, Gated DeltaNet-2 too
  (which "auto" alone sends to "pallas"), and refuses a call that
  impl="mosaic" cannot run (float32 q, k, v) with a ValueError that names
  the config, rather than picking another implementation."""
  config = deltajax.mosaic.Config(pieces=2)
  seen = _spy(monkeypatch, "mosaic")
  bf16 = lambda *s: jnp.zeros(s, jnp.bfloat16)
  per_channel = _zeros(1, 128, 2, 32)
  gates = {"gated_delta": (_zeros(1, 128, 2), _zeros(1, 128, 2)),
           "kda": (per_channel, _zeros(1, 128, 2)),
           "gdn2": (per_channel, per_channel, _zeros(1, 128, 2, 48))}[rule]
  getattr(deltajax, rule)(bf16(1, 128, 2, 32), bf16(1, 128, 2, 32),
                          bf16(1, 128, 2, 48), *gates, config=config)
  assert seen == [config]
  with pytest.raises(ValueError, match=r"config=Config\(pieces=2\) is "
                     r"impl='mosaic''s, which cannot run this call: its "
                     r"products are 16-bit"):
    deltajax.gated_delta(**_args(), config=config)
