"""The ``python -m deltajax`` demo runs and reports every implementation."""

import re
import runpy

import deltajax


def test_demo_reports_every_implementation_close_to_scan(capsys):
  runpy.run_module("deltajax", run_name="__main__")
  out = capsys.readouterr().out
  assert "devices [" in out
  diffs = dict(re.findall(r"^\s*(\w+): max abs diff vs scan (\S+),", out,
                          re.MULTILINE))
  skipped = re.findall(r"^\s*(\w+): skipped", out, re.MULTILINE)
  assert sorted([*diffs, *skipped]) == sorted(
      i for i in deltajax.IMPLEMENTATIONS if i != "auto"), out
  assert float(diffs["scan"]) == 0.0
  assert all(float(d) < 1e-4 for d in diffs.values()), out
