"""Entry point of every ``py_test`` in BUILD: runs pytest on the files given.

    python tests/pytest_main.py tests/test_forward.py [pytest options]
"""

import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main(["-q", *sys.argv[1:]]))
