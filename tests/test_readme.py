"""The README's runnable example (the Flax model in section "## API") runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _section(markdown: str, heading: str) -> str:
  """The text from ``heading`` to the next ``## `` heading."""
  start = markdown.index(f"\n{heading}\n")
  end = markdown.find("\n## ", start + 1)
  return markdown[start:] if end < 0 else markdown[start:end]


def _runnable_python_blocks(text: str):
  """```python blocks that import deltajax (the others list signatures)."""
  blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
  return [b for b in blocks if re.search(r"^import deltajax$", b, re.MULTILINE)]


def test_api_example_runs(capsys):
  blocks = _runnable_python_blocks(
      _section((ROOT / "README.md").read_text(), "## API"))
  assert len(blocks) == 1
  exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})  # pylint: disable=exec-used
  assert "(2, 100, 64)" in capsys.readouterr().out
