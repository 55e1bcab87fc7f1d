"""Repository configuration: BUILD names every module and test file, and
.ci/run runs the README's test command.

BUILD is Starlark; the subset it uses is Python, so it is executed here with
stand-ins for the Bazel rules that record each target's attributes.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("deltajax", "benchmarks", "tests")  # every .py below is in BUILD
README_TEST_COMMAND = ('pip install -e ".[test]" && '
                       'python -m pytest -q -n auto tests')


def _glob(*args, **kwargs):
  raise AssertionError(f"BUILD must name its files, not glob({args}, "
                       f"{kwargs}): tests/test_build.py checks the names")


@pytest.fixture(scope="module")
def targets():
  """``{name: {"kind": rule, **attributes}}`` for every target in BUILD."""
  found = {}

  def rule(kind):
    def declare(name, **attributes):
      assert name not in found, f"BUILD declares {name!r} twice"
      found[name] = dict(kind=kind, **attributes)
    return declare

  scope = {"load": lambda *args: None, "package": lambda **kwargs: None,
           "glob": _glob, **{kind: rule(kind) for kind in (
               "py_library", "py_binary", "py_test")}}
  exec(compile((ROOT / "BUILD").read_text(), "BUILD", "exec"), scope)  # pylint: disable=exec-used
  return found


def _named_files(targets, attribute):
  return {f for t in targets.values() for f in t.get(attribute, ())}


def _python_files():
  return {p.relative_to(ROOT).as_posix() for package in PACKAGES
          for p in (ROOT / package).rglob("*.py")}


def test_build_names_every_python_file(targets):
  missing = sorted(_python_files() - _named_files(targets, "srcs"))
  assert not missing, (f"add these files to a target's srcs in BUILD: "
                       f"{missing}")


def test_every_test_file_has_its_py_test(targets):
  for path in sorted((ROOT / "tests").glob("test_*.py")):
    name, src = path.stem, path.relative_to(ROOT).as_posix()
    assert name in targets, (f"BUILD needs a py_test named {name!r} for "
                             f"{src}, like the others")
    target = targets[name]
    assert target["kind"] == "py_test", f"{name} must be a py_test"
    assert src in target["srcs"], f"py_test {name} must have {src} in srcs"
    assert target.get("main") == "tests/pytest_main.py", name
    assert target.get("args") == [f"$(location {src})"], name


def test_named_files_exist(targets):
  named = _named_files(targets, "srcs") | _named_files(targets, "data")
  stale = sorted(f for f in named if not (ROOT / f).is_file())
  assert not stale, f"BUILD names files that do not exist: {stale}"


def test_deps_are_targets(targets):
  for name, target in targets.items():
    unknown = [d for d in target.get("deps", ())
               if d.lstrip(":") not in targets]
    assert not unknown, f"{name} depends on undeclared targets {unknown}"


def test_build_test_sees_this_package():
  """The checks above look at real files (so they can fail)."""
  files = _python_files()
  assert {"deltajax/__init__.py", "deltajax/api.py",
          "tests/test_build.py"} <= files


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  assert README_TEST_COMMAND in readme
  commands = [line.strip() for line in ci.splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
  assert README_TEST_COMMAND in commands, ci
  assert re.search(r"^set -[a-z]*e", ci, re.MULTILINE), (
      ".ci/run must stop at the first failing command (set -e)")
