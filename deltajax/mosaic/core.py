"""The Mosaic GPU kernels' building blocks, as :mod:`deltajax.pallas.core`.

The layouts of a wgmma tile (:data:`WGMMA`, its rows :data:`ROWS` and
columns :data:`COLS`), the gate's decay matrix (:func:`decay`), TMA copies
(:func:`copy_in`, :func:`copy_out`), swizzled shared memory (:func:`smem`)
and :class:`Mosaic`, the kernels' launch and products.

The kernels of this package are written once against :class:`Mosaic`, which
either compiles them for Hopper (``plgpu.kernel``, JAX 0.11) or runs them in
the Mosaic GPU interpreter of JAX 0.10 on the CPU (the JAX-version shims:
:mod:`compat`). The interpreter of JAX 0.10.2 lacks two things the compiled
kernels use, and :class:`Mosaic` stands in for them when interpreting:

* ``plgpu.wgmma`` reads only untransposed shared-memory operands (a
  transposed ref fails in its ``to_range``) and has no register operand: the
  product is then formed from the loaded values (``jnp.dot``, float32
  accumulation, the same operand roundings);
* ``layout_cast`` (behind ``plgpu.broadcasted_iota(layout=...)`` and
  ``plgpu.load(layout=...)``) has no CPU rule: plain ``lax`` ops instead.

Between releases, ``plgpu.load`` takes its index positionally in 0.10 and
optionally in 0.11 (:meth:`Mosaic.load` passes ``()``).

So the interpreter checks the kernels' data movement (TMA copies, barriers:
it runs the warpgroups and insists that every barrier phase be observed)
and their arithmetic, not the register layouts or the wgmma operand forms.
Those are checked by lowering the kernels for CUDA on the CPU
(tests/test_mosaic.py: Mosaic GPU's layout inference and wgmma checks) and
compiled only on the GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import compat

WGMMA = plgpu.Layout.WGMMA
WGMMA_TRANSPOSED = plgpu.Layout.WGMMA_TRANSPOSED
ROWS = WGMMA.reduce(1)  # one value per row of a WGMMA tile
COLS = WGMMA.reduce(0)  # one value per column


def _check_interpreter_threads(warpgroups):
  """Refuses to interpret a kernel of ``warpgroups`` warpgroups with too few
  XLA CPU threads (it would wait forever at its first barrier)."""
  needed = warpgroups + 1
  threads = compat.cpu_threads()
  if threads < needed:
    raise RuntimeError(
        f"the Mosaic GPU interpreter runs this kernel's {warpgroups} "
        f"warpgroups concurrently on XLA's CPU threads, and needs "
        f"{needed}; this process has {threads}. Set NPROC={needed} "
        f"(or more) in the environment before JAX starts.")


def rows(x, shape):
  """A per-row vector (``ROWS``) broadcast over ``shape``'s columns."""
  return lax.broadcast_in_dim(x, shape, [0])


def decay(mg, g_row, g_col, *, strict=False, transposed=False):
  """``Gamma [C, C]``, ``e^{g_i - g_j}`` at row i, column j for ``j <= i``
  (``strict``: ``j < i``), else 0, masked before exp (above the diagonal
  the exponent is positive); ``transposed``: its transpose. ``g_row``, ``g_col``: the chunk's
  gate as a per-row (ROWS) and a per-column (COLS) vector."""
  square = (g_row.shape[0], g_col.shape[0])
  rows, cols = mg.iota(square, 0), mg.iota(square, 1)
  diff = (lax.broadcast_in_dim(g_row, square, [0])
          - lax.broadcast_in_dim(g_col, square, [1]))
  if transposed:
    rows, cols, diff = cols, rows, -diff
  keep = rows > cols if strict else rows >= cols
  return jnp.exp(jnp.where(keep, diff, -jnp.inf))


def copy_in(copies, barrier):
  """TMA copies of ``(source in HBM, destination in shared memory)`` pairs,
  all arriving on ``barrier`` (whose arrival count is their number)."""
  for src, dst in copies:
    plgpu.copy_gmem_to_smem(src, dst, barrier)


def copy_out(value, staging, dst):
  """``value`` to HBM at ``dst`` (a TMA copy) through the shared
  ``staging`` tile."""
  staging[...] = value.astype(staging.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(staging, dst)


def smem(shape, dtype):
  """Shared memory tiled and swizzled for TMA and wgmma (rows along the last
  axis): the widest swizzle the row allows."""
  dtype = jnp.dtype(dtype)
  swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
      plgpu.SwizzleTransform(swizzle)))


@dataclasses.dataclass(frozen=True)
class T:
  """A shared-memory operand of :meth:`Mosaic.mm` read transposed."""
  ref: object


@dataclasses.dataclass(frozen=True)
class Mosaic:
  """The kernels' view of Mosaic GPU: compiled (``interpret=False``) or
  interpreted on the CPU (``detect_races``: with the interpreter's race
  detector, see :func:`compat.races_found`)."""
  interpret: bool
  detect_races: bool = False

  def kernel(self, body, **kwargs):
    """``plgpu.kernel`` (interpreted, or compiled with fast math), traced
    with 32-bit defaults: the kernels index with int32 (block ids, loop
    counters), which ``jax_enable_x64`` would mix with int64."""
    if self.interpret:
      _check_interpreter_threads(kwargs.get("num_threads") or 1)
      call = plgpu.kernel(
          body, interpret=compat.interpret_params(self.detect_races),
          **kwargs)
    else:
      call = plgpu.kernel(body, compiler_params=plgpu.CompilerParams(
          approx_math=True), **kwargs)

    def in_32_bits(*args):
      with jax.enable_x64(False):
        return call(*args)
    return in_32_bits

  def set_max_registers(self, n, *, action):
    """A warpgroup's register budget (nothing to set when interpreting)."""
    if not self.interpret:
      plgpu.set_max_registers(n, action=action)

  def iota(self, shape, dim):
    """int32 iota in the WGMMA layout."""
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)

  def load(self, ref, layout):
    """The whole ``ref`` (or :class:`T`: transposed) in ``layout`` (ROWS,
    COLS or WGMMA)."""
    if self.interpret:
      return ref.ref[...].T if isinstance(ref, T) else ref[...]
    if isinstance(ref, T):
      # A swizzled tile is read transposed in the transposed WGMMA layout
      # only; from there to WGMMA is a shuffle within the registers.
      return plgpu.layout_cast(plgpu.load(
          plgpu.transpose_ref(ref.ref, (1, 0)), (), layout=WGMMA_TRANSPOSED),
                               layout)
    return plgpu.load(ref, (), layout=layout)

  def store_transposed(self, ref, x):
    """``ref[...] = x.T`` for a 2-d shared memory ``ref`` and a WGMMA-layout
    ``x`` (through the transposed WGMMA layout, as :meth:`load`)."""
    if self.interpret:
      ref[...] = x.T
    else:
      plgpu.transpose_ref(ref, (1, 0))[...] = plgpu.layout_cast(
          x, WGMMA_TRANSPOSED)

  def mm(self, pairs, shape, init=None, *, meet=True):
    """``init + sum(a @ b for a, b in pairs)``, ``[M, N]`` float32: one
    product of :meth:`products`."""
    return self.products([(pairs, shape, init)], meet=meet)[0]

  def products(self, products, meanwhile=lambda: None, *, meet=True):
    """Several ``init + sum(a @ b for a, b in pairs)`` (``products``: a list
    of ``(pairs, shape, init or None)``), float32, issued together on the
    tensor cores and waited for once; ``meanwhile()`` runs between the two
    (it must not write their operands). Each ``a`` is a 16-bit value in the
    WGMMA layout or a shared memory ref, each ``b`` a shared memory ref;
    either may be :class:`T` (read transposed). The results pass an
    optimization barrier, so that no use of them is scheduled before the
    wgmma wait (jla's note: the wait carries no data dependency), and the
    warpgroup meets after the wait, so that its operands may be written
    (``meet=False``: it does not, where nothing writes them before its next
    meeting; each meeting is a warpgroup barrier on the chain's critical
    path)."""
    if self.interpret:  # a value or a ref: x[...] is either's value
      meanwhile()
      # 16-bit operands widen exactly; their products are exact in float32
      # (XLA's CPU runtime lacks some 16-bit dots with float32 results).
      value = lambda x: (x.ref[...].T if isinstance(x, T) else x[...]
                         ).astype(jnp.float32)
      return tuple(
          sum((jnp.dot(value(a), value(b), precision=lax.Precision.HIGHEST)
               for a, b in pairs),
              jnp.zeros(shape, jnp.float32) if init is None else init)
          for pairs, shape, init in products)
    ref = lambda x: plgpu.transpose_ref(x.ref, (1, 0)) if isinstance(x, T) \
        else x

    def issue(*accs):
      for acc, (pairs, _, _) in zip(accs, products):
        for a, b in pairs:
          plgpu.wgmma(acc, ref(a), ref(b))
      meanwhile()

    if len(products) == 1 and products[0][2] is None:
      def scoped(acc):
        issue(acc)
        return (acc[...],)
      out = pl.run_scoped(scoped, plgpu.ACC(products[0][1], jnp.float32))
    else:  # several accumulators: one run_state, as jla does on JAX 0.11
      inits = tuple(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)
                    if init is None else init
                    for _, shape, init in products)
      out = pl.run_state(lambda accs: issue(*accs))(
          tuple(plgpu.ACC.init(x) for x in inits))
    out = lax.optimization_barrier(tuple(out))
    if meet:
      # Each warp waits for its own share of the products: the warpgroup
      # meets before any of it overwrites their operands (a TMA copy into a
      # tile the other warps still read gave rows of garbage on the H200).
      plgpu.commit_smem()
    return out
