"""Multi-device checks of deltajax.parallel on 8 CPU devices, one JSON line each.

Run by tests/test_parallel.py in a fresh process, because the device count
must be set before JAX initialises:

    PYTHONPATH=. python tests/parallel_checks.py

Each line is ``{"group": ..., "name": ..., ...}`` with measured errors (max
abs error over max abs of the single-device value) or HLO facts; the test
file holds the assertions.

Keep the shapes small: jaxlib 0.10's batched LAPACK triangular solve (impl
"chunked" on CPU) splits large batches over the intra-op thread pool and
waits inside it, which deadlocks when several CPU devices run it at once on
a machine with few cores.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import deltajax
from deltajax import parallel

NAMES = ("o", "final_state", "dq", "dk", "dv", "da", "db", "d_initial_state")
GATHERS = ("all-gather", "all-to-all")
COLLECTIVES = GATHERS + ("all-reduce", "collective-permute", "reduce-scatter")


def emit(group, name, **fields):
  print(json.dumps({"group": group, "name": name, **fields}), flush=True)


def inputs(seed, *, b=2, t=96, h=2, dk=8, dv=12, per_channel=False):
  """float32 inputs with unit-norm keys and mild gates (segments interact)."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.normal(size=s).astype(np.float32)
  k = normal(b, t, h, dk)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  gate_shape = (b, t, h, dk) if per_channel else (b, t, h)
  return dict(
      q=normal(b, t, h, dk), k=k, v=normal(b, t, h, dv),
      a=-rng.uniform(0.01, 0.2, gate_shape).astype(np.float32),
      b=rng.uniform(0.1, 0.9, (b, t, h)).astype(np.float32),
      initial_state=normal(b, h, dk, dv),
      d_o=normal(b, t, h, dv), d_final=normal(b, h, dk, dv))


def values_and_grads(fn, x):
  """``(o, final_state, *grads)`` of ``fn`` under a fixed linear loss."""

  def loss(q, k, v, a, b, s0):
    o, final_state = fn(q, k, v, a, b, initial_state=s0,
                        return_final_state=True)
    return jnp.sum(o * x["d_o"]) + jnp.sum(final_state * x["d_final"]), (
        o, final_state)

  args = [x[n] for n in ("q", "k", "v", "a", "b", "initial_state")]
  grads, (o, final_state) = jax.jit(
      jax.grad(loss, argnums=range(6), has_aux=True))(*args)
  return (o, final_state, *grads)


def relative_errors(got, want):
  return {n: float(np.max(np.abs(np.asarray(g) - np.asarray(w)))
                   / np.max(np.abs(np.asarray(w))))
          for n, g, w in zip(NAMES, got, want)}


def mesh_of(shape, names, axis_type=AxisType.Explicit):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n],
                       axis_types=(axis_type,) * len(shape))


def check_sequence_parallel():
  for devices in (2, 4, 8):
    mesh = mesh_of((devices,), ("sp",))
    for impl in ("scan", "chunked"):
      for gate in ("gdn", "kda"):
        x = inputs(devices, per_channel=gate == "kda")
        options = dict(impl=impl, chunk_size=8)
        want = values_and_grads(
            lambda *a, **kw: deltajax.gated_delta(*a, **kw, **options), x)
        got = values_and_grads(
            lambda *a, **kw: parallel.gated_delta_sequence_parallel(
                *a, **kw, mesh=mesh, axis_name="sp", **options), x)
        emit("sequence", f"{devices}-{impl}-{gate}", devices=devices,
             errors=relative_errors(got, want))


def check_sequence_parallel_variants():
  """2-D meshes (one axis splitting B or H, or unused), an Auto mesh, and
  the plain call."""
  x = inputs(10, b=4)
  want = values_and_grads(
      lambda *a, **kw: deltajax.gated_delta(*a, **kw, chunk_size=8), x)
  for name, mesh, extra in (
      ("batch2-seq4", mesh_of((2, 4), ("data", "sp")),
       dict(batch_axis="data")),
      ("seq4-head2", mesh_of((4, 2), ("sp", "heads")), dict(head_axis="heads")),
      ("seq4-replicated2", mesh_of((2, 4), ("data", "sp")), {}),
      ("auto-mesh-seq8", mesh_of((8,), ("sp",), AxisType.Auto), {})):
    got = values_and_grads(
        lambda *a, **kw: parallel.gated_delta_sequence_parallel(
            *a, **kw, mesh=mesh, axis_name="sp", chunk_size=8, **extra), x)
    emit("sequence", name, devices=8, errors=relative_errors(got, want))
  mesh = mesh_of((4,), ("sp",))
  o = parallel.gated_delta_sequence_parallel(
      x["q"], x["k"], x["v"], x["a"], x["b"], mesh=mesh, axis_name="sp")
  o_want = deltajax.gated_delta(x["q"], x["k"], x["v"], x["a"], x["b"])
  emit("sequence", "no-initial-state", devices=4,
       errors=relative_errors([o], [o_want]))


def check_sequence_parallel_features():
  """Packed documents (one starting exactly at a device boundary, one
  spanning devices) and grouped value heads, against the plain call."""
  x = inputs(20)
  ids = np.zeros((2, 96), np.int32)
  ids[0, 24:] = 1  # starts at device 2's first token of 8 (12 tokens each)
  ids[0, 50:] = 2  # spans devices 4-7
  ids[1, 5:] = 3
  ids[1, 37:] = 4
  mesh = mesh_of((8,), ("sp",))
  for impl in ("scan", "chunked"):
    options = dict(impl=impl, chunk_size=8, segment_ids=ids)
    want = values_and_grads(
        lambda *a, **kw: deltajax.gated_delta(*a, **kw, **options), x)
    got = values_and_grads(
        lambda *a, **kw: parallel.gated_delta_sequence_parallel(
            *a, **kw, mesh=mesh, axis_name="sp", **options), x)
    emit("sequence", f"segments-{impl}", devices=8,
         errors=relative_errors(got, want))
  rng = np.random.default_rng(21)
  grouped = dict(x, v=rng.normal(size=(2, 96, 4, 12)).astype(np.float32),
                 a=x["a"].repeat(2, axis=2), b=x["b"].repeat(2, axis=2),
                 initial_state=rng.normal(size=(2, 4, 8, 12)).astype(
                     np.float32),
                 d_o=rng.normal(size=(2, 96, 4, 12)).astype(np.float32),
                 d_final=rng.normal(size=(2, 4, 8, 12)).astype(np.float32))
  want = values_and_grads(
      lambda *a, **kw: deltajax.gated_delta(*a, **kw, chunk_size=8), grouped)
  got = values_and_grads(
      lambda *a, **kw: parallel.gated_delta_sequence_parallel(
          *a, **kw, mesh=mesh_of((4, 2), ("sp", "heads")), axis_name="sp",
          head_axis="heads", chunk_size=8), grouped)
  emit("sequence", "grouped-heads", devices=8,
       errors=relative_errors(got, want))


def check_errors():
  x = inputs(0, t=90)
  mesh = mesh_of((8,), ("sp",))
  args = [x[n] for n in ("q", "k", "v", "a", "b")]
  cases = {
      "indivisible-T": lambda: parallel.gated_delta_sequence_parallel(
          *args, mesh=mesh, axis_name="sp"),
      "unknown-axis": lambda: parallel.gated_delta_sequence_parallel(
          *args, mesh=mesh, axis_name="seq"),
      "batch-not-divisible": lambda: parallel.gated_delta_sharded(
          *args, mesh=mesh, batch_axis="sp"),
      "rank-2": lambda: parallel.gated_delta_sequence_parallel(
          *(y[0, :88, 0] for y in args), mesh=mesh, axis_name="sp"),
  }
  for name, call in cases.items():
    try:
      call()
      message = None
    except (ValueError, TypeError) as e:
      message = str(e)
    emit("errors", name, message=message)


def collectives(fn, args, shardings):
  """``{op: [result types]}`` of the collectives in ``fn``'s compiled HLO."""
  text = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text()
  found = {}
  for op in COLLECTIVES:
    for m in re.finditer(rf"= (.+?) {op}(?:-start)?\(", text):
      found.setdefault(op, []).append(m.group(1))
  return found


def loss_of(fn):
  return jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=range(5))


def jit_cases():
  """(mesh axis type, layout, mesh shape, B/T/H spec, impls, gates, passes).

  Auto axes are where XLA's sharding propagation could insert gathers, so
  they get every case; Explicit axes the 2-D one; sharding T is the control
  that shows the HLO scan finds gathers.
  """
  impls, gates, passes = ("scan", "chunked"), ("gdn", "kda"), ("fwd", "grad")
  return (
      (AxisType.Auto, "B", (8,), ("x", None, None), impls, gates, passes),
      (AxisType.Auto, "H", (8,), (None, None, "x"), impls, gates, passes),
      (AxisType.Auto, "BxH", (2, 4), ("x", None, "y"), impls, gates, passes),
      (AxisType.Explicit, "BxH", (2, 4), ("x", None, "y"), impls, gates,
       passes),
      (AxisType.Auto, "T-control", (8,), (None, "x", None), impls, ("gdn",),
       ("fwd",)))


def check_batch_head_sharding():
  """jit with inputs sharded over B and/or H: no gather in the compiled program."""
  for axis_type, layout, mesh_shape, spec, impls, gates, passes in jit_cases():
    mesh = mesh_of(mesh_shape, ("x", "y")[:len(mesh_shape)], axis_type)
    for impl in impls:
      for gate in gates:
        x = inputs(0, b=8, t=64, h=8, per_channel=gate == "kda")
        args = [x[n] for n in ("q", "k", "v", "a", "b")]
        shardings = [NamedSharding(mesh, P(*spec, *[None] * (y.ndim - 3)))
                     for y in args]
        fwd = lambda *a, impl=impl: deltajax.gated_delta(
            *a, impl=impl, chunk_size=16)
        fns = {"fwd": fwd, "grad": loss_of(fwd)}
        for pass_ in passes:
          emit("jit", f"{axis_type.name}-{layout}-{impl}-{gate}-{pass_}",
               control=layout == "T-control",
               collectives=collectives(fns[pass_], args, shardings))


def check_sharded_wrapper():
  """gated_delta_sharded: equal to gated_delta, and no collectives."""
  mesh = mesh_of((2, 4), ("data", "heads"))
  x = inputs(3, b=4, t=40, h=4, per_channel=True)
  for impl in ("scan", "chunked"):
    options = dict(impl=impl, chunk_size=16)
    want = values_and_grads(
        lambda *a, **kw: deltajax.gated_delta(*a, **kw, **options), x)
    sharded = lambda *a, **kw: parallel.gated_delta_sharded(
        *a, **kw, mesh=mesh, batch_axis="data", head_axis="heads", **options)
    got = values_and_grads(sharded, x)
    args = [x[n] for n in ("q", "k", "v", "a", "b")]
    fwd = lambda *a: sharded(*a)
    emit("sharded", impl, errors=relative_errors(got, want),
         collectives=collectives(loss_of(fwd), args, None))


def check_inside_user_shard_map():
  """gated_delta in a user's shard_map (default checks), no initial_state."""
  mesh = mesh_of((8,), ("data",), AxisType.Auto)
  x = inputs(5, b=8, t=32)
  args = [x[n] for n in ("q", "k", "v", "a", "b")]
  for impl in ("scan", "chunked"):
    call = lambda *a: deltajax.gated_delta(*a, impl=impl, chunk_size=16)
    sharded = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("data"),
                                    out_specs=P("data")))
    got, want = np.asarray(sharded(*args)), np.asarray(call(*args))
    emit("user-shard-map", impl, errors={
        "o": float(np.max(np.abs(got - want)) / np.max(np.abs(want)))})


def check_sequence_parallel_hlo():
  """Sequence parallel moves only the (F, G) maps and the final state."""
  mesh = mesh_of((8,), ("sp",))
  x = inputs(0, t=1024)
  bsz, _, h, dk = x["q"].shape
  map_elements = 8 * bsz * h * dk * (dk + x["v"].shape[-1])
  args = [x[n] for n in ("q", "k", "v", "a", "b")]
  fwd = lambda *a: parallel.gated_delta_sequence_parallel(
      *a, mesh=mesh, axis_name="sp", chunk_size=16)
  for pass_, fn in (("fwd", fwd), ("grad", loss_of(fwd))):
    emit("sequence-hlo", pass_, collectives=collectives(fn, args, None),
         map_elements=map_elements, q_elements=int(np.prod(x["q"].shape)))


def check_gdn2():
  """Gated DeltaNet-2 (erase gate b [K], write gate w [V]): T split over 4
  devices with a document spanning two, and B split over 2, against the
  plain gdn2 call; outputs and all seven gradients."""
  x = inputs(30, per_channel=True)
  rng = np.random.default_rng(31)
  x["b"] = rng.uniform(0.1, 0.9, x["a"].shape).astype(np.float32)
  w = rng.uniform(0.1, 0.9, x["v"].shape).astype(np.float32)
  ids = np.zeros((2, 96), np.int32)
  ids[1, 40:] = 1

  def values_and_grads_gdn2(fn):
    def loss(q, k, v, a, b, w, s0):
      o, final_state = fn(q, k, v, a, b, w=w, initial_state=s0,
                          return_final_state=True)
      return jnp.sum(o * x["d_o"]) + jnp.sum(final_state * x["d_final"]), (
          o, final_state)
    args = [x[n] for n in ("q", "k", "v", "a", "b")] + [w, x["initial_state"]]
    grads, (o, final_state) = jax.jit(
        jax.grad(loss, argnums=range(7), has_aux=True))(*args)
    return (o, final_state, *grads)

  names = ("o", "final_state", "dq", "dk", "dv", "da", "db", "dw",
           "d_initial_state")
  errors = lambda got, want: {
      n: float(np.max(np.abs(np.asarray(g) - np.asarray(r)))
               / np.max(np.abs(np.asarray(r))))
      for n, g, r in zip(names, got, want)}
  for impl in ("scan", "chunked"):
    options = dict(impl=impl, chunk_size=8, segment_ids=ids)
    want = values_and_grads_gdn2(
        lambda q, k, v, a, b, w, **kw: deltajax.gdn2(q, k, v, a, b, w, **kw,
                                                     **options))
    for name, fn in (
        ("sequence4", functools.partial(
            parallel.gated_delta_sequence_parallel,
            mesh=mesh_of((4,), ("sp",)), axis_name="sp")),
        ("batch2", functools.partial(parallel.gated_delta_sharded,
                                     mesh=mesh_of((2,), ("data",)),
                                     batch_axis="data"))):
      got = values_and_grads_gdn2(functools.partial(fn, **options))
      emit("gdn2", f"{name}-{impl}", errors=errors(got, want))


def main():
  assert jax.device_count() == 8, jax.devices()
  check_sequence_parallel()
  check_sequence_parallel_variants()
  check_sequence_parallel_features()
  check_errors()
  check_batch_head_sharding()
  check_sharded_wrapper()
  check_inside_user_shard_map()
  check_sequence_parallel_hlo()
  check_gdn2()


if __name__ == "__main__":
  main()
