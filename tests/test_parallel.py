"""deltajax.parallel against the single-device call, on 8 CPU devices.

The device count has to be set before JAX initialises, and other test files
import JAX first, so tests/parallel_checks.py runs once in a subprocess and
prints its measurements; the tests here assert on them.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # one subprocess of 8 CPU devices, minutes

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOLERANCE = 2e-6  # float32: max abs error / max abs of the single-device value
GATHERS = ("all-gather", "all-to-all")


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, str(ROOT / "tests/parallel_checks.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500, check=False)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  rows = [json.loads(line) for line in run.stdout.splitlines()
          if line.startswith("{")]
  return {(row["group"], row["name"]): row for row in rows}


def group(results, name):
  return {key[1]: row for key, row in results.items() if key[0] == name}


def assert_close(row):
  worst = {n: e for n, e in row["errors"].items() if not e <= TOLERANCE}
  assert not worst, f"{row['name']}: {worst}"


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_sequence_parallel_matches_single_device(results, devices):
  rows = [row for row in group(results, "sequence").values()
          if row["devices"] == devices and row["name"][0].isdigit()]
  assert sorted(row["name"] for row in rows) == sorted(
      f"{devices}-{impl}-{gate}" for impl in ("scan", "chunked")
      for gate in ("gdn", "kda"))
  for row in rows:
    assert set(row["errors"]) == {"o", "final_state", "dq", "dk", "dv", "da",
                                  "db", "d_initial_state"}
    assert_close(row)


@pytest.mark.parametrize("name", [
    "batch2-seq4", "seq4-head2", "seq4-replicated2", "auto-mesh-seq8",
    "no-initial-state", "segments-scan", "segments-chunked",
    "grouped-heads"])
def test_sequence_parallel_meshes_and_defaults(results, name):
  assert_close(results[("sequence", name)])


@pytest.mark.parametrize("name, expected", [
    ("indivisible-T", "T = 90 is not divisible by the 8 devices"),
    ("unknown-axis", "axis_name='seq' is not an axis of the mesh"),
    ("batch-not-divisible", "do not divide B = 2"),
    ("rank-2", "must have shape [B, T, H, K]"),
])
def test_clear_errors(results, name, expected):
  message = results[("errors", name)]["message"]
  assert message is not None and expected in message, message


def test_jit_over_batch_and_heads_compiles_without_gathers(results):
  rows = group(results, "jit")
  assert len(rows) == 34
  for name, row in rows.items():
    gathers = {op: row["collectives"].get(op) for op in GATHERS
               if op in row["collectives"]}
    if row["control"]:
      assert gathers, f"{name}: sharding T should need gathers"
    else:
      assert not gathers, f"{name}: {gathers}"


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_sharded_wrapper(results, impl):
  row = results[("sharded", impl)]
  assert_close(row)
  assert not row["collectives"], row["collectives"]


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_gated_delta_inside_a_users_shard_map(results, impl):
  assert_close(results[("user-shard-map", impl)])


@pytest.mark.parametrize("pass_", ["fwd", "grad"])
def test_sequence_parallel_moves_only_segment_maps(results, pass_):
  row = results[("sequence-hlo", pass_)]
  assert "collective-permute" in row["collectives"]
  assert set(row["collectives"]) <= {"collective-permute", "reduce-scatter",
                                     "all-reduce"}
  for op, types in row["collectives"].items():
    for t in types:
      for shape in re.findall(r"\w+\[([\d,]*)\]", t):
        elements = np.prod([int(d) for d in shape.split(",") if d])
        assert elements <= row["map_elements"] < row["q_elements"], (op, t)


@pytest.mark.parametrize("name", ["sequence4-scan", "sequence4-chunked",
                                  "batch2-scan", "batch2-chunked"])
def test_gdn2_across_devices(results, name):
  """Gated DeltaNet-2 with T split over 4 devices (a document spanning two)
  or B over 2: outputs and all seven gradients as on one device."""
  row = group(results, "gdn2")[name]
  assert set(row["errors"]) == {"o", "final_state", "dq", "dk", "dv", "da",
                                "db", "dw", "d_initial_state"}
  assert_close(row)
