"""The documentation's runnable examples run: README.md's "## Example",
docs/layers.md's "## A layer of your own" and "## Real models: ...", and
docs/api.md's "## Serving: ..." and "## Value checks"."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _section(markdown: str, heading: str) -> str:
  """The text from ``heading`` to the next ``## `` heading."""
  start = markdown.index(f"\n{heading}\n")
  end = markdown.find("\n## ", start + 1)
  return markdown[start:] if end < 0 else markdown[start:end]


def _runnable_python_blocks(text: str):
  """```python blocks that import deltajax or a module of it (the others list signatures)."""
  blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
  return [b for b in blocks
          if re.search(r"^import deltajax(\.\w+)?$", b, re.MULTILINE)]


def _run_section(path: str, heading: str):
  """Executes the one runnable block of the section ``heading`` of the
  markdown file ``path`` (relative to the repository's root)."""
  blocks = _runnable_python_blocks(
      _section((ROOT / path).read_text(), heading))
  assert len(blocks) == 1
  exec(compile(blocks[0], path, "exec"), {"__name__": "readme"})  # pylint: disable=exec-used


def test_readme_example_runs(capsys):
  _run_section("README.md", "## Example")
  out = capsys.readouterr().out
  assert "(2, 256, 4, 64) (2, 4, 64, 64) (2, 256, 4, 64) (2, 4, 64)" in out, out


def test_api_example_runs(capsys):
  _run_section("docs/layers.md", "## A layer of your own")
  assert "(2, 100, 64)" in capsys.readouterr().out


def test_value_checks_example_runs(capsys):
  _run_section("docs/api.md", "## Value checks")
  out = capsys.readouterr().out
  assert "a must be <= 0" in out and "got a[0, 3, 1] = 0.5" in out, out


def test_serving_example_runs(capsys):
  _run_section("docs/api.md",
               "## Serving: a pool of states, speculative decoding")
  out = capsys.readouterr().out
  assert "(3, 4, 2, 32) (3, 4, 2, 32, 32) bfloat16" in out, out


def test_real_models_example_runs(capsys):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  _run_section("docs/layers.md",
               "## Real models: Qwen3-Next, Qwen3.5, Kimi Linear")
  out = capsys.readouterr().out
  difference = float(re.search(r"from transformers: (\S+)", out).group(1))
  assert difference < 1e-4, out
