"""Intra-chunk decayed scores of a scalar gate (Gated DeltaNet).

``A[i, j] = (x_i . y_j) exp(g_i - g_j)`` on the causal triangle of one chunk
(``x = y = k``, strict, for the UT system; ``x = q``, ``y = k``, ``j <= i``,
for the output): ``(X Y^T) * Gamma``, one ``[C, C]`` decay. A per-channel
gate's scores are formed once, by :mod:`intra`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from deltajax.pallas import core


@dataclasses.dataclass(frozen=True)
class Scores:
  """The decayed scores of one chunk for a scalar gate: ``matrix [C, C]``
  float32 and its ``[C, C]`` decay ``Gamma``."""
  matrix: object
  decay: object
  dot: core.Dot

  def vjp(self, d, x, y):
    """``(dx, dy, dg)`` from the cotangent ``d [C, C]`` of ``matrix``; x, y
    ``[C, K]``; ``dg [C]``: the gate's share (each score is
    ``x_i . y_j exp(g_i - g_j)``)."""
    d_e = (d * self.decay).astype(x.dtype)
    p = d * self.matrix
    return (self.dot(d_e, y), self.dot(d_e, x, trans_a=True),
            jnp.sum(p, axis=1) - jnp.sum(p, axis=0))


def scores(*, x, y, g, cuts, strict, dot) -> Scores:
  """The decayed scores of one chunk for a scalar gate on ``j < i``
  (``strict``) or ``j <= i``: x, y ``[C, K]``, g ``[C]`` float32, cuts
  ``[C]`` or None."""
  e = core.decay(g, g, core.causal(x.shape[0], strict=strict), cuts, cuts)
  return Scores(dot(x, y, trans_b=True) * e, e, dot)

