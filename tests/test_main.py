"""The ``python -m deltajax`` demo runs and reports every implementation."""

import re
import runpy

import pytest

from deltajax import registry


@pytest.mark.slow  # every implementation, the Pallas kernels interpreted
def test_demo_reports_every_implementation_close_to_scan(capsys):
  runpy.run_module("deltajax", run_name="__main__")
  out = capsys.readouterr().out
  assert "devices [" in out
  diffs = dict(re.findall(r"^\s*(\w+): max abs diff vs scan (\S+),", out,
                          re.MULTILINE))
  assert sorted(diffs) == sorted(registry.REGISTRY), out
  assert re.search(r"impl=\"auto\" for the 'channel' gate picks '\w+'", out)
  assert float(diffs["scan"]) == 0.0
  # "mosaic" (16-bit products) runs on bfloat16 q, k, v.
  assert all(float(d) < (1e-2 if impl == "mosaic" else 1e-4)
             for impl, d in diffs.items()), out
