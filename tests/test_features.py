"""The implementation-by-feature matrix: packed sequences, grouped value heads,
fused gates, against float64 references run sequence by sequence.

Every implementation in ``deltajax.registry.REGISTRY`` that runs compiled
on this backend is checked for each feature it declares; a feature it does
not declare must be refused by name and never picked by "auto". (The
Pallas kernels run here only in interpret mode: tests/test_pallas.py checks
them at smaller shapes.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import common
from deltajax import registry
import reference
import utils

# Compared in float64 at TOL: those with 16-bit products ("mosaic") are
# checked at fla's tolerances (tests/test_mosaic.py, tests/test_gpu.py).
NATIVE = tuple(name for name, impl in registry.REGISTRY.items()
               if impl.runs_natively() and impl.wide)
TOL = 1e-9  # relative max error, float64
# And the kernels that run emulated (Pallas interpret mode), for the checks
# small enough to run there.
RUNNABLE = tuple(name for name, impl in registry.REGISTRY.items()
                 if impl.wide and (impl.runs_natively() or impl.emulated))


def _supporting(feature, impls=NATIVE):
  return tuple(n for n in impls if getattr(registry.REGISTRY[n], feature))


def _assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape
    assert utils.relative_max_error(g, w) < TOL, utils.relative_max_error(g, w)


_REFERENCES = {}  # the reference's values and gradients, shared by the impls


def _check_vjp(fn, ref, args, seed, key):
  """Outputs and every gradient of ``fn`` equal ``ref``'s (float64).

  ``key`` names the reference computation (the same for every
  implementation), which runs once.
  """
  if key not in _REFERENCES:
    outputs, ref_pullback = jax.vjp(ref, *args)
    cotangents = tuple(jnp.asarray(np.random.default_rng(seed).standard_normal(
        o.shape)) for o in outputs)
    _REFERENCES[key] = outputs, cotangents, ref_pullback(cotangents)
  outputs, cotangents, grads = _REFERENCES[key]
  got, pullback = jax.vjp(fn, *args)
  _assert_close(got, outputs)
  _assert_close(pullback(cotangents), grads)


# Long sequences (slow), a sequence of one token, an empty sequence.
CU_SEQLENS = (utils.slow([0, 15, 100, 300, 1200, 2000]),
              utils.slow([0, 122, 229, 400, 1000]), [0, 1], [0, 5, 5, 70])


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("gate", ("gdn", "kda"))
@pytest.mark.parametrize("cu_seqlens", CU_SEQLENS, ids=str)
@pytest.mark.parametrize("impl", _supporting("packed"))
def test_cu_seqlens_equal_sequence_by_sequence(impl, cu_seqlens, gate):
  cu = np.asarray(cu_seqlens)
  x = utils.random_inputs(len(cu) + cu[-1], batch=1, length=int(cu[-1]),
                          heads=1, value_heads=2, key_dim=6, value_dim=5,
                          per_channel=gate == "kda", states=len(cu) - 1)
  args = tuple(jnp.asarray(t) for t in x)

  def fn(*args):
    return utils.gated_delta(impl, *args, scale=1.0, cu_seqlens=jnp.asarray(cu),
                             chunk_size=16)

  ref = functools.partial(reference.sequence_by_sequence, cu_seqlens=cu)
  _check_vjp(fn, lambda *a: ref(*a), args, seed=1,
             key=("cu_seqlens", tuple(cu_seqlens), gate))


def test_the_chunk_layout_is_a_pair_of_gathers():
  """Sequences of 0, 5, 70 and 1 tokens in chunks of 16: to_layout puts each
  token at its slot and zeros between the sequences, from_layout takes them
  back, and each one's VJP is the other, so that neither direction nor its
  gradient scatters (a scatter into the layout took XLA on an H200 five
  times the Mosaic GPU scan's time)."""
  cu = jnp.array([0, 0, 5, 75, 76])
  layout = common.chunk_layout(cu, 76, 16)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 76, 2, 3)), jnp.float32)
  y = common.to_layout(x, layout)
  scattered = jnp.zeros_like(y).at[:, layout.slot].set(x)
  np.testing.assert_array_equal(y, scattered)
  np.testing.assert_array_equal(common.from_layout(y, layout), x)
  dy = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
  dx = jax.vjp(lambda x: common.to_layout(x, layout), x)[1](dy)[0]
  np.testing.assert_array_equal(dx, dy[:, layout.slot])
  dy_back = jax.vjp(lambda y: common.from_layout(y, layout), y)[1](x)[0]
  np.testing.assert_array_equal(dy_back, scattered)
  loss = lambda x: jnp.sum(common.from_layout(
      jnp.sin(common.to_layout(x, layout)), layout))
  assert "scatter" not in str(jax.make_jaxpr(jax.grad(loss))(x))


SEGMENT_IDS = np.array([[0] * 7 + [1] * 30 + [2] * 1 + [3] * 12,
                        [5] * 16 + [6] * 16 + [9] * 18])


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("gate", ("gdn", "kda"))
@pytest.mark.parametrize("impl", _supporting("packed"))
def test_segment_ids_equal_segment_by_segment(impl, gate):
  x = utils.random_inputs(11, batch=2, length=SEGMENT_IDS.shape[1], heads=2,
                          key_dim=5, value_dim=4, per_channel=gate == "kda")
  args = tuple(jnp.asarray(t) for t in x)

  def fn(*args):
    return utils.gated_delta(impl, *args, scale=1.0, chunk_size=16,
                             segment_ids=jnp.asarray(SEGMENT_IDS))

  ref = functools.partial(reference.segment_by_segment,
                          segment_ids=SEGMENT_IDS)
  _check_vjp(fn, lambda *a: ref(*a), args, seed=2, key=("segment_ids", gate))


# Three documents, cut at token 16 and at ``second`` in chunks of 16, with a
# NaN in the middle one: name -> (the cuts' kind, second, the tokens that
# keep their values).
BOUNDARIES = {
    "segment_ids": ("segment_ids", 32, np.r_[0:16, 32:64]),
    "a=-inf": ("a=-inf", 32, np.r_[0:16, 32:64]),
    # The chunk of a cut carries a non-finite value across it (its products
    # with T and the scores): the last document keeps the tokens past it.
    "segment_ids inside a chunk": ("segment_ids", 40, np.r_[0:16, 48:64]),
}
# What the Pallas kernels do not (yet) isolate.
PALLAS_LEAKS = {
    "a=-inf": "a floored gate is not a cut in the Pallas kernels",
    "segment_ids inside a chunk": "the scan kernel applies T to the state's "
                                  "read: Delta = T diag(b) (V - (K e^g) S)",
}


def _boundary_cases():
  """(impl, boundary) pairs of the test below."""
  for impl in _supporting("packed", RUNNABLE):
    for boundary in BOUNDARIES:
      marks = ()
      if impl == "pallas" and boundary in PALLAS_LEAKS:
        # What is known to leak is checked to leak with -m slow.
        marks = (pytest.mark.xfail(strict=True,
                                   reason=PALLAS_LEAKS[boundary]),
                 pytest.mark.slow)
      yield pytest.param(impl, boundary, marks=marks, id=f"{impl}-{boundary}")


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("gate", ("gdn", "kda"))
@pytest.mark.parametrize("impl,boundary", _boundary_cases())
def test_a_non_finite_document_leaves_the_others_alone(impl, boundary, gate):
  """A NaN in the middle one of three documents (:data:`BOUNDARIES`): the
  outputs of the others, the final state and the gradients of their
  inputs and of the initial state (a loss over every output, so that the
  middle document's cotangents are NaN too) are those of clean inputs. The
  documents are cut by segment_ids, or by full forgets (a = -inf at their
  first token)."""
  kind, second, others = BOUNDARIES[boundary]
  x = utils.random_inputs(40, batch=1, length=64, heads=1, value_heads=2,
                          key_dim=8, value_dim=8, per_channel=gate == "kda")
  ids = (np.arange(64) >= 16).astype(int) + (np.arange(64) >= second)
  options = dict(segment_ids=jnp.asarray(ids[None]))
  if kind == "a=-inf":
    x = x._replace(a=x.a.copy())
    x.a[:, [16, second]] = -np.inf
    options = {}

  @jax.jit
  def value_and_grads(*args):
    def loss(*args):
      o, s = utils.gated_delta(impl, *args, chunk_size=16, **options)
      return jnp.sum(o * o) + jnp.sum(s), (o, s)
    return jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(*args)

  args = tuple(jnp.asarray(t) for t in x)
  clean = value_and_grads(*args)
  got = value_and_grads(*args[:2], args[2].at[0, 20, 1, 3].set(jnp.nan),
                        *args[3:])
  for g, c in zip(jax.tree.leaves(got), jax.tree.leaves(clean)):
    if g.ndim > 1 and g.shape[1] == 64:  # per token
      g, c = g[:, others], c[:, others]
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, c, rtol=1e-12, atol=1e-12)


def test_cu_seqlens_may_be_traced_without_recompiling():
  x = utils.random_inputs(3, batch=1, length=40, heads=1, states=3)
  args = tuple(jnp.asarray(t, jnp.float32) for t in x)
  traces = []

  @jax.jit
  def fn(cu, *args):
    traces.append(1)
    return utils.gated_delta("chunked", *args, cu_seqlens=cu, chunk_size=16)

  for cu in ([0, 3, 20, 40], [0, 17, 18, 40]):
    got = fn(jnp.asarray(cu), *args)
    scale = args[0].shape[-1] ** -0.5
    want = reference.sequence_by_sequence(args[0] * scale, *args[1:],
                                          np.asarray(cu))
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
  assert len(traces) == 1


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("heads", ((2, 4), utils.slow((2, 8)),
                                   utils.slow((4, 8))), ids=str)
@pytest.mark.parametrize("gate", ("gdn", "kda"))
@pytest.mark.parametrize("impl", _supporting("grouped"))
def test_grouped_value_heads_equal_repeated_keys(impl, gate, heads):
  h, hv = heads
  x = utils.random_inputs(20 + hv, batch=2, length=37, heads=h, value_heads=hv,
                          key_dim=6, value_dim=5, per_channel=gate == "kda")
  args = tuple(jnp.asarray(t) for t in x)
  fn = functools.partial(utils.gated_delta, impl, scale=1.0, chunk_size=16)
  _check_vjp(fn, reference.plain_scan_grouped, args, seed=3,
             key=("grouped", heads, gate))


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("gate", ("gdn", "kda"))
@pytest.mark.parametrize("impl", NATIVE)
def test_fused_options_equal_their_unfused_form(impl, gate):
  x = utils.random_inputs(30, batch=2, length=21, heads=2, key_dim=6,
                          value_dim=5, per_channel=gate == "kda")
  q, k, v, raw_a, raw_b, s0 = (jnp.asarray(t) for t in x)
  rng = np.random.default_rng(31)
  a_log = jnp.asarray(rng.standard_normal((2,)))
  dt_bias = jnp.asarray(rng.standard_normal(raw_a.shape[2:]))

  def fused(q, k, v, raw_a, raw_b, s0, a_log, dt_bias):
    return utils.gated_delta(impl, 3 * q, 2 * k, v, raw_a, raw_b, s0,
                             use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias,
                             beta_sigmoid=True, allow_neg_eigval=True,
                             chunk_size=16)

  def unfused(q, k, v, raw_a, raw_b, s0, a_log, dt_bias):
    norm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    rate = jnp.exp(a_log) if raw_a.ndim == 3 else jnp.exp(a_log)[:, None]
    a = -rate * jax.nn.softplus(raw_a + dt_bias)
    return utils.gated_delta("scan", norm(3 * q), norm(2 * k), v, a,
                             2 * jax.nn.sigmoid(raw_b), s0, chunk_size=16)

  _check_vjp(fused, unfused, (q, k, v, raw_a, raw_b, s0, a_log, dt_bias),
             seed=4, key=("fused", gate))


@pytest.mark.parametrize("feature", ("packed", "grouped", "wide"))
def test_auto_never_picks_an_implementation_without_the_feature(feature):
  call = dict(gate="head", length=4096, chunk_size=64, packed=False,
              grouped=False)
  call[feature] = True
  chosen = registry.select("auto", **call)
  assert getattr(chosen, feature)
  for name, impl in registry.REGISTRY.items():
    if not getattr(impl, feature):
      with pytest.raises(ValueError, match=f"impl={name!r} cannot run"):
        registry.select(name, **call)


@pytest.mark.parametrize("gate", registry.GATES)
def test_auto_picks_an_implementation_that_supports_the_gate(gate):
  for length in (16, 4096):
    chosen = registry.select("auto", gate=gate, length=length, chunk_size=64,
                             packed=False, grouped=False)
    assert gate in chosen.gates and chosen.runs_natively()


@pytest.mark.parametrize("call,expected", [
    (dict(), "mosaic"),
    (dict(wide=True), "pallas"),
    (dict(head_dim=256), "pallas"),
    (dict(packed=True), "mosaic"),
    (dict(chunk_size=32), "pallas"),
    (dict(gate="channel"), "mosaic"),
    (dict(gate="channel", packed=True), "mosaic"),
    (dict(gate="gdn2"), "mosaic"),
    (dict(gate="gdn2", packed=True), "mosaic"),
])
def test_auto_on_hopper_takes_the_fastest_kernels_that_can_run(
    call, expected, monkeypatch):
  """On a Hopper GPU (faked here), "auto" takes impl="mosaic" for what it
  supports (every gate, 16-bit q, k, v, head dims up to 128, chunks of 64;
  packed calls too: the same kernels on a gate with the cuts folded in),
  else "pallas"."""
  monkeypatch.setattr(registry.Implementation, "runs_natively",
                      lambda self: True)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  call = dict(dict(gate="head", length=4096, chunk_size=64, packed=False,
                   grouped=True, head_dim=128), **call)
  assert registry.select("auto", **call).name == expected
