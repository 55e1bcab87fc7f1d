"""Times every deltajax implementation, and jla and fla when importable, on the same inputs.

    python benchmarks/benchmark.py [--gate gdn|kda|gdn2] [--shapes 4,4096,16,128 2,4096,16,32,128 ...]
        [--reps 20] [--impls scan chunked pallas mosaic mosaic:pieces=4 mosaic/8] [--out DIR]

For each shape (B, T, H, D), or (B, T, H, HV, D) with grouped value heads, bf16 q/k/v (L2-normalised k), float32 gates
(``a = -softplus(N(0, 1)) / 8``, per head for GDN, per key channel for
KDA and Gated DeltaNet-2; beta, or GDN-2's erase and write gates, sigmoids
of N(0, 1)): forward and forward+backward (a training step: the loss
``sum(o * dO)`` and its gradients, ``jax.value_and_grad``) of each
implementation, of jla (``jla.ops.linear_attention``) and of fla (``chunk_gated_delta_rule``,
``chunk_kda`` or ``chunk_gdn2``), all timed the same way (:func:`median_ms`), the JAX
backward's temporaries (XLA ``memory_analysis``), and a decoding step timed
inside a jitted loop of 100 steps. Prints markdown tables in
benchmarks/RESULTS.md's format (one per implementation, a line per shape,
with ratios to jla and fla), and writes them to ``results.md``, with
``time_vs_t.png`` (time against T, log scale), into ``--out`` after each
shape. ``--replot TABLE_MD`` redraws the plot from saved tables (of
``--gate``).
An ``--impls`` entry ``"<impl>/<n>"`` times that implementation with T cut
into n pieces run side by side (``deltajax.parallel.gated_delta_in_pieces``);
``"mosaic:pieces=<n>"`` times ``impl="mosaic"`` with
``config=deltajax.mosaic.Config(pieces=n)`` (its scan and reverse pass in n
pieces of each sequence; T / 64 a multiple of n) in place of the automatic
choice.

``--documents N`` packs N documents of random lengths into every row (cuts
at N - 1 distinct random tokens): ``--packing segment_ids`` (the default)
passes them to deltajax and jla as ``segment_ids``, ``--packing
cu_seqlens`` to deltajax as ``cu_seqlens`` over the rows laid end to end
(B = 1; jla takes segment_ids, its cu_seqlens being reference-only); fla
takes ``cu_seqlens`` either way.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import deltajax
from deltajax import mosaic
from deltajax import pallas

# The shapes of RESULTS.md's tables.
DEFAULT_SHAPES = ((4, 4096, 16, 128), (8, 1024, 8, 64), (2, 4096, 16, 32, 128),
                  (1, 8192, 96, 128), (16, 4096, 32, 128), (1, 65536, 16, 128))
SCAN_MAX_TOKENS = 4 * 4096 * 16  # B*T*H above which the token scan is skipped


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def make_inputs(shape, seed=0, gate="gdn"):
  """numpy float32 q, k ``[B, T, H, D]``, v ``[B, T, HV, D]``, a
  ``[B, T, HV]`` (``[B, T, HV, D]`` for KDA and Gated DeltaNet-2), b ``[B,
  T, HV]`` (for Gated DeltaNet-2 the pair of erase and write gates, ``[B, T,
  HV, D]`` each), do ``[B, T, HV, D]``, for ``shape`` (B, T, H, D) or, with
  grouped value heads, (B, T, H, HV, D)."""
  bsz, t, h, *hv, d = shape
  hv = hv[0] if hv else h
  rng = np.random.default_rng(seed)
  q, k = (rng.standard_normal((bsz, t, h, d), np.float32) for _ in range(2))
  v, do = (rng.standard_normal((bsz, t, hv, d), np.float32) for _ in range(2))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  a_shape = (bsz, t, hv) if gate == "gdn" else (bsz, t, hv, d)
  a = -np.logaddexp(0, rng.standard_normal(a_shape)).astype(np.float32) / 8
  gates = lambda *shape: (1 / (1 + np.exp(-rng.standard_normal(shape)))
                          ).astype(np.float32)
  b = (gates(bsz, t, hv, d), gates(bsz, t, hv, d)) if gate == "gdn2" else (
      gates(bsz, t, hv))
  return q, k, v, a, b, do


def median_ms(fn, reps: int, sync=None, back_to_back: int = 10) -> float:
  """Median time of one ``fn()`` call in ms: the median over ``reps`` runs of
  ``back_to_back`` calls issued one after another and then waited for with
  ``sync(last result)``, divided by ``back_to_back``; after two warm-ups.

  Each framework's dispatch overlaps the device work as it does in a
  training loop, and one host synchronisation is spread over the calls
  (waiting after every call would add ~0.2 ms of host round trip to JAX's
  numbers, measured on the H200, RESULTS.md). ``sync`` defaults to
  ``jax.block_until_ready``.
  """
  sync = sync or jax.block_until_ready
  sync(fn())
  sync(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(back_to_back):
      out = fn()
    sync(out)
    times.append((time.perf_counter() - t0) * 1e3 / back_to_back)
  return statistics.median(times)


def documents(bsz, t, count, seed=3):
  """int32 ``segment_ids [B, T]``: each row cut into ``count`` documents at
  ``count - 1`` distinct random tokens."""
  rng = np.random.default_rng(seed)
  starts = np.zeros((bsz, t), np.int32)
  for row in starts:
    row[rng.choice(np.arange(1, t), count - 1, replace=False)] = 1
  return np.cumsum(starts, axis=1, dtype=np.int32)


def cu_seqlens_of(segment_ids):
  """int32 ``[N + 1]``: the documents of ``segment_ids [B, T]`` with the rows
  laid end to end (B = 1)."""
  bsz, t = segment_ids.shape
  starts = np.ones((bsz, t), bool)
  starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
  return np.append(np.flatnonzero(starts), bsz * t).astype(np.int32)


def end_to_end(attention, cu_seqlens):
  """``attention(q, k, v, a, b, cu_seqlens=...)`` on the rows laid end to end
  (B = 1), as ``(q, k, v, a, b) -> o [B, T, HV, V]``."""
  def packed(q, k, v, a, b):
    merged = jax.tree.map(lambda x: x.reshape(1, -1, *x.shape[2:]),
                          (q, k, v, a, b))
    o = attention(*merged, cu_seqlens=jnp.asarray(cu_seqlens))
    return o.reshape(q.shape[0], -1, *o.shape[2:])
  return packed


def time_jax(attention, inputs, reps):
  """``(forward ms, forward+backward ms, o, backward temporaries MiB)`` of
  ``attention(q, k, v, a, b) -> o``, a JAX function (deltajax or jla)."""
  q, k, v, a, b, do = inputs
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  a, b = jax.tree.map(jnp.asarray, (a, b))
  fwd = jax.jit(attention)

  def loss(q, k, v, a, b):
    o = attention(q, k, v, a, b)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  # The loss is returned, so o is formed: with jax.grad alone XLA drops a
  # forward kernel that only forms o (jla's: its backward recomputes the
  # states), and the backward would be timed against a whole step.
  fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  memory = fwd_bwd.lower(q, k, v, a, b).compile().memory_analysis()
  o = fwd(q, k, v, a, b).block_until_ready()
  t_fwd = median_ms(lambda: fwd(q, k, v, a, b), reps)
  t_bwd = median_ms(lambda: fwd_bwd(q, k, v, a, b), reps)
  return (t_fwd, t_bwd, np.asarray(o, np.float32),
          memory.temp_size_in_bytes / 2 ** 20)


MOSAIC_PIECES = "mosaic:pieces="  # an --impls entry's prefix


def mosaic_config(impl):
  """The :class:`deltajax.mosaic.Config` of an ``--impls`` entry
  ``"mosaic:pieces=<n>"``."""
  if not impl.startswith(MOSAIC_PIECES):
    raise ValueError(f"{impl!r}: the impls with a config are "
                     f"'{MOSAIC_PIECES}<n>'")
  return mosaic.Config(pieces=int(impl[len(MOSAIC_PIECES):]))


def deltajax_attention(impl, gate="gdn", packing=None):
  """``(q, k, v, a, b) -> o`` of deltajax's ``impl``: a name of the
  registry, ``"mosaic:pieces=<n>"`` (:func:`mosaic_config`), or
  ``"<impl>/<n>"``, that implementation with T cut into n pieces run side
  by side (:func:`deltajax.parallel.gated_delta_in_pieces`); ``packing``:
  None, or ``(kind, segment_ids)`` with kind "segment_ids" or "cu_seqlens"
  (a name of the registry only)."""
  if packing is not None:
    if "/" in impl or ":" in impl:
      raise ValueError(f"--documents times the registry's implementations; "
                       f"got {impl!r}")
    kind, segment_ids = packing
    rule = deltajax.gated_delta
    if gate == "gdn2":
      rule = lambda q, k, v, a, b, **kw: deltajax.gdn2(q, k, v, a, *b, **kw)
    if kind == "cu_seqlens":
      return end_to_end(lambda *x, **kw: rule(*x, impl=impl, **kw),
                        cu_seqlens_of(segment_ids))
    ids = jnp.asarray(segment_ids)
    return lambda q, k, v, a, b: rule(q, k, v, a, b, impl=impl,
                                      segment_ids=ids)
  if ":" in impl:
    config = mosaic_config(impl)
    return lambda q, k, v, a, b: deltajax.gated_delta(
        q, k, v, a, b, impl="mosaic", config=config)
  impl, _, pieces = impl.partition("/")
  if pieces:
    def attention(q, k, v, a, b):
      b, w = b if gate == "gdn2" else (b, None)
      return deltajax.parallel.gated_delta_in_pieces(
          q, k, v, a, b, w=w, pieces=int(pieces), impl=impl)
    return attention
  if gate == "gdn2":
    return lambda q, k, v, a, b: deltajax.gdn2(q, k, v, a, *b, impl=impl)
  return lambda q, k, v, a, b: deltajax.gated_delta(q, k, v, a, b, impl=impl)


def load_jla(gate, segment_ids=None):
  """jla's attention ``(q, k, v, a, b) -> o`` for the gate (of packed
  documents with ``segment_ids [B, T]``), or None."""
  try:
    from jla import ops
  except ImportError as e:
    log(f"jla not importable ({e}); skipping it")
    return None
  kind = {"gdn": "gated_deltanet", "kda": "kda", "gdn2": "gdn2"}[gate]

  def attention(q, k, v, a, b):
    # jla takes one head count: grouped value heads get q, k repeated.
    q, k = (jnp.repeat(x, v.shape[2] // x.shape[2], axis=2) for x in (q, k))
    gates = dict(b=b[0], w=b[1]) if gate == "gdn2" else dict(beta=b)
    if segment_ids is not None:
      gates["segment_ids"] = jnp.asarray(segment_ids)
    return ops.linear_attention(kind, q, k, v, g=a,
                                scale=q.shape[-1] ** -0.5, **gates)[0]
  return attention


def load_fla(gate):
  """torch and fla's ``chunk_gated_delta_rule`` (``chunk_kda``,
  ``chunk_gdn2``), or None."""
  try:
    import torch
    import fla.ops.common.chunk_o as fla_chunk_o
    if gate == "kda":
      from fla.ops.kda import chunk_kda as chunk_gated_delta_rule
    elif gate == "gdn2":
      from fla.ops.gdn2 import chunk_gdn2 as chunk_gated_delta_rule
    else:
      from fla.ops.gated_delta_rule import chunk_gated_delta_rule
  except ImportError as e:
    log(f"fla not importable ({e}); skipping it")
    return None
  if not torch.cuda.is_available():
    return None
  # fla refuses its GDN backward on Hopper with Triton < 3.7.1 (its #640);
  # timing only, its dg/db are not trusted.
  fla_chunk_o.TRITON_ABOVE_3_7_1 = True
  return torch, chunk_gated_delta_rule


def time_fla(fla, inputs, reps, segment_ids=None):
  """``(forward ms, forward+backward ms, o)`` for fla, timed as JAX is; with
  ``segment_ids [B, T]``, their documents as ``cu_seqlens`` over the rows
  laid end to end."""
  torch, chunk_gated_delta_rule = fla
  q, k, v, a, b, do = inputs
  gates = b if isinstance(b, tuple) else (b,)  # Gated DeltaNet-2: b, w
  options, shape = {}, v.shape
  if segment_ids is not None:
    merge = lambda x: x.reshape(1, -1, *x.shape[2:])
    q, k, v, a, do, *gates = map(merge, (q, k, v, a, do, *gates))
    options["cu_seqlens"] = torch.tensor(cu_seqlens_of(segment_ids),
                                         device="cuda", dtype=torch.long)
  q, k, v, a, do, *gates = (torch.tensor(x, device="cuda")
                            for x in (q, k, v, a, do, *gates))
  q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
  if len(gates) == 2:  # chunk_gdn2's backward dots v with w: one dtype
    gates = [x.to(torch.bfloat16) for x in gates]
  q, k, v, a, *gates = (x.requires_grad_() for x in (q, k, v, a, *gates))

  def fwd():
    return chunk_gated_delta_rule(q, k, v, a, *gates, **options)[0]

  def fwd_bwd():
    fwd().backward(do)

  sync = lambda _: torch.cuda.synchronize()
  with torch.no_grad():
    o = fwd().float().cpu().numpy().reshape(shape)
    t_fwd = median_ms(fwd, reps, sync)
  torch.cuda.reset_peak_memory_stats()
  before = torch.cuda.memory_allocated()
  fwd_bwd()
  torch.cuda.synchronize()
  memory = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
  return t_fwd, median_ms(fwd_bwd, reps, sync), o, memory


def time_decode_step(bsz=4, h=16, d=128, steps=100, gate="gdn", impl="auto",
                     state_dtype=jnp.float32, pool=0, reps=20, step=None):
  """Microseconds per :func:`deltajax.gated_delta_step` inside a jitted loop
  of ``steps`` tokens, its state carried (in ``state_dtype``) from step to
  step. Every step takes the same token (q, k, v and gates made once
  outside the loop; a decoder computes them in its own kernels), so the
  loop runs the step's kernels alone; the output is carried too, so that
  no step is dead code. ``pool``: the states in a pool of ``pool * bsz``
  slots, the rows at random distinct slots (``state_indices``), the pool
  carried instead. ``step``: None, or a function with
  :func:`deltajax.gated_delta_step`'s signature to time in its place."""
  q, k, v, a, b, _ = make_inputs((bsz, 1, h, d), seed=1, gate=gate)
  q, k, v = (jnp.asarray(x[:, 0], jnp.bfloat16) for x in (q, k, v))
  a, b = jax.tree.map(lambda x: jnp.asarray(x[:, 0]), (a, b))
  b, write = b if gate == "gdn2" else (b, None)
  options = dict(impl=impl)
  if write is not None:
    options["w"] = write
  if pool:
    options["state_indices"] = jnp.asarray(np.random.default_rng(2).choice(
        pool * bsz, bsz, replace=False), jnp.int32)
  step = step or deltajax.gated_delta_step

  @jax.jit
  def decode(state):
    def token(_, carry):
      o, state = step(carry[1], q, k, v, a, b, **options)
      return o, state
    return jax.lax.fori_loop(0, steps, token, (jnp.zeros_like(v), state))

  state = jnp.zeros(((pool or 1) * bsz, h, d, d), state_dtype)
  return median_ms(lambda: decode(state), reps) * 1e3 / steps


def rel_rms(x, ref):
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def implementations_for(shape, only=None):
  """deltajax implementations to time at ``shape`` (``only``: a subset)."""
  bsz, t, h = shape[:3]
  impls = ["chunked"]
  if jax.default_backend() == "gpu":
    impls.append("pallas")
    if pallas.gpu_capability() >= mosaic.MIN_CAPABILITY:
      impls.append("mosaic")
  if bsz * t * h <= SCAN_MAX_TOKENS:
    impls.insert(0, "scan")
  # e.g. "mosaic/8", "mosaic:pieces=4"
  named = [i for i in only or () if "/" in i or ":" in i]
  return [i for i in impls if only is None or i in only] + named


def run(shapes, reps, only=None, on_shape=lambda rows: None, gate="gdn",
        peers=("jla", "fla"), documents_per_row=0, packing="segment_ids"):
  """Returns rows ``{shape, impl, fwd, fwd_bwd, err, mem}``; with
  ``documents_per_row``, of that many documents per row (:func:`documents`)
  passed as ``packing``.

  ``err`` is the relative RMS difference of the output from chunked's (from
  the first implementation timed when ``only`` leaves chunked out).

  ``on_shape(rows)`` is called after each shape, so partial results survive a
  time limit.
  """
  fla = load_fla(gate) if "fla" in peers else None
  rows = []
  for shape in shapes:
    inputs = make_inputs(shape, gate=gate)
    ids = (documents(*shape[:2], documents_per_row) if documents_per_row
           else None)
    jla = load_jla(gate, ids) if "jla" in peers else None
    results = {}
    for impl in implementations_for(shape, only):
      log(f"{shape} {impl} ...")
      results[impl] = time_jax(
          deltajax_attention(impl, gate,
                             None if ids is None else (packing, ids)),
          inputs, reps)
    if jla is not None:
      log(f"{shape} jla ...")
      results["jla"] = time_jax(jla, inputs, reps)
    if fla is not None:
      log(f"{shape} fla ...")
      results["fla"] = time_fla(fla, inputs, reps, ids)
    ref = results.get("chunked", next(iter(results.values())))[2]
    for impl, (t_fwd, t_bwd, o, mem) in results.items():
      rows.append(dict(shape=shape, impl=impl, fwd=t_fwd, fwd_bwd=t_bwd,
                       err=rel_rms(o, ref), mem=mem))
      log(f"  {impl:8s} fwd {t_fwd:8.3f} ms  fwd+bwd {t_bwd:8.3f} ms")
    on_shape(rows)
  return rows


GATE_NAMES = {"gdn": "Gated DeltaNet", "kda": "KDA", "gdn2": "Gated DeltaNet-2"}
PEERS = ("jla", "fla")
TABLE_HEADER = (
    "| B, T, H[, HV], D | deltajax ms | jla ms | / jla | fla ms | / fla | "
    "temporaries MiB: deltajax / jla / fla |\n"
    "|---|---|---|---|---|---|---|")


def shape_cell(shape) -> str:
  """``"4, 4096, 16, 128"``; grouped value heads as ``"2, 4096, 16 / 32, 128"``."""
  bsz, t, h, *hv, d = shape
  heads = f"{h} / {hv[0]}" if hv else f"{h}"
  return f"{bsz}, {t}, {heads}, {d}"


def _times(row) -> str:
  return f"{row['fwd']:.3f} / {row['fwd_bwd']:.3f}" if row else "-"


def _ratios(row, peer) -> str:
  if not (row and peer):
    return "-"
  return (f"{row['fwd'] / peer['fwd']:.2f} / "
          f"{row['fwd_bwd'] / peer['fwd_bwd']:.2f}")


def table(rows, gate="gdn", heading="") -> str:
  """Markdown tables in benchmarks/RESULTS.md's format: one per deltajax
  implementation in ``rows`` (headed ``### <gate>, `"<impl>"`: <heading>``),
  one line per shape with ms forward / forward+backward of deltajax, jla and
  fla, deltajax's time over each peer's, and the backward's temporaries
  ("-": not timed)."""
  found = {(r["shape"], r["impl"]): r for r in rows}
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows
                             if r["impl"] not in PEERS))
  tables = []
  for impl in impls:
    title = f'### {GATE_NAMES[gate]}, `"{impl}"`'
    lines = [f"{title}: {heading}" if heading else title, "", TABLE_HEADER]
    for shape in shapes:
      row = found.get((shape, impl))
      if row is None:
        continue
      jla, fla = (found.get((shape, peer)) for peer in PEERS)
      memory = " / ".join(f"{r['mem']:.0f}" if r else "-"
                          for r in (row, jla, fla))
      lines.append(f"| {shape_cell(shape)} | {_times(row)} | {_times(jla)} | "
                   f"{_ratios(row, jla)} | {_times(fla)} | "
                   f"{_ratios(row, fla)} | {memory} |")
    tables.append("\n".join(lines))
  return "\n\n".join(tables)


def errors_table(rows) -> str:
  """The outputs' relative RMS difference from the reference's (chunked's,
  else the first implementation timed at that shape), as :func:`run`
  computes them."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  found = {(r["shape"], r["impl"]): r for r in rows}
  lines = ["| B, T, H[, HV], D | reference | " + " | ".join(impls) + " |",
           "|---" * (len(impls) + 2) + "|"]
  for shape in dict.fromkeys(r["shape"] for r in rows):
    timed = [i for i in impls if (shape, i) in found]
    ref = "chunked" if "chunked" in timed else timed[0]
    cells = [f"{found[shape, i]['err']:.1e}" if i in timed else "-"
             for i in impls]
    lines.append(f"| {shape_cell(shape)} | {ref} | " + " | ".join(cells)
                 + " |")
  return "\n".join(lines)


def _time_pair(cell):
  fwd, _, fwd_bwd = cell.partition("/")
  try:
    return float(fwd), float(fwd_bwd)
  except ValueError:
    return None


def read_table(path, gate=None):
  """Rows ``{shape, impl, fwd, fwd_bwd}`` back from tables written by
  :func:`table` (to re-plot saved runs), deltajax's implementation named
  by each table's heading, jla and fla by their columns; only the tables
  of ``gate`` when given. Of rows with the same shape and implementation,
  the first one counts."""
  rows, impl = {}, None
  with open(path) as f:
    for line in f:
      heading = re.match(r'#+ (.+?), `"(.+?)"`', line)
      if heading:
        impl = heading.group(2)
        if gate is not None and heading.group(1) != GATE_NAMES[gate]:
          impl = None
        continue
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if impl is None or len(cells) != 7 or not cells[0][:1].isdigit():
        continue
      shape = tuple(int(x) for x in re.split(r"[,/]", cells[0]))
      for name, cell in ((impl, cells[1]), ("jla", cells[2]),
                         ("fla", cells[4])):
        times = _time_pair(cell)
        if times:
          rows.setdefault((shape, name), dict(
              shape=shape, impl=name, fwd=times[0], fwd_bwd=times[1]))
  return list(rows.values())


def plot(rows, path):
  """Time against B*T*H, forward and forward+backward, one line per impl."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, key in zip(axes, ("fwd", "fwd_bwd")):
    for impl in sorted({r["impl"] for r in rows}):
      pts = sorted((r["shape"][0] * r["shape"][1] * r["shape"][2], r[key])
                   for r in rows if r["impl"] == impl)
      ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set(xscale="log", yscale="log", xlabel="tokens x heads (B*T*H)",
           ylabel="ms", title=key.replace("_", "+"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="*", default=None,
                      help="B,T,H,D or B,T,H,HV,D entries (default: "
                      "RESULTS.md's shapes)")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--gate", choices=("gdn", "kda", "gdn2"), default="gdn")
  parser.add_argument("--peers", nargs="*", default=("jla", "fla"),
                      help="other libraries to time when importable")
  parser.add_argument("--impls", nargs="*", default=None,
                      help="deltajax implementations to time (default: all)")
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--documents", type=int, default=0,
                      help="documents of random lengths packed into each row "
                      "(0: none)")
  parser.add_argument("--packing", choices=("segment_ids", "cu_seqlens"),
                      default="segment_ids",
                      help="how deltajax takes the --documents")
  parser.add_argument("--replot", metavar="TABLE_MD", default=None,
                      help="only redraw time_vs_t.png from a saved table")
  args = parser.parse_args()
  if args.replot:
    plot(read_table(args.replot, args.gate),
         os.path.join(args.out, "time_vs_t.png"))
    return
  shapes = (tuple(tuple(int(x) for x in s.split(",")) for s in args.shapes)
            if args.shapes else DEFAULT_SHAPES)
  log(f"devices: {jax.devices()}  jax {jax.__version__}")
  os.makedirs(args.out, exist_ok=True)
  heading = f"{jax.devices()[0].device_kind}, {datetime.date.today()}"
  if args.documents:
    heading += (f", {args.documents} documents per row as "
                f"{args.packing}")
  method = (f"JAX {jax.__version__}; median of {args.reps} samples of 10 "
            f"back-to-back calls (benchmark.median_ms)")

  def text(rows, decode_us=None):
    parts = [method, table(rows, args.gate, heading),
             "Outputs' relative RMS difference from the reference's:\n\n"
             + errors_table(rows)]
    if decode_us is not None:
      parts.append(f"Decoding step (B=4, H=16, D=128, jitted loop of 100 "
                   f"steps): {decode_us:.1f} us/step")
    return "\n\n".join(parts)

  def write(rows, content):
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write(f"{content}\n")
    plot(rows, os.path.join(args.out, "time_vs_t.png"))

  rows = run(shapes, args.reps, args.impls,
             on_shape=lambda rows: write(rows, text(rows)), gate=args.gate,
             peers=args.peers, documents_per_row=args.documents,
             packing=args.packing)
  final = text(rows, time_decode_step(gate=args.gate))
  write(rows, final)
  print(final)


if __name__ == "__main__":
  main()
