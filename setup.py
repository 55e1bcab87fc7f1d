"""deltajax: gated delta rule linear attention (Gated DeltaNet, KDA) for JAX.

Lower bounds: the whole test suite passes on the CPU (Python 3.11) with exactly
these versions (``pip install -c`` pins of them). jax 0.10 needs numpy >= 2, so
matplotlib < 3.8.4 (numpy < 2) cannot be installed with it, and flax 0.12.0
and 0.12.1 do not import or jit under jax 0.10. safetensors 0.8.0 and
transformers 5.24.0 are the versions deltajax.hf was tested with (no older
ones were tried).
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

_HERE = Path(__file__).parent
_VERSION = re.search(r'__version__ = "([^"]+)"',
                     (_HERE / "deltajax" / "__init__.py").read_text()).group(1)

setup(
    name="deltajax",
    version=_VERSION,
    description=("Gated delta rule linear attention (Gated DeltaNet, Kimi Delta "
                 "Attention) for JAX: scan, chunked and Pallas GPU kernels."),
    long_description=(_HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deltajax", "deltajax.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.0",
        "jaxlib>=0.10.0",
    ],
    extras_require={
        "nn": ["flax>=0.12.2", "optax>=0.2.4"],
        # deltajax.hf: layers from transformers checkpoints (no torch).
        "hf": ["flax>=0.12.2", "optax>=0.2.4", "safetensors>=0.8.0"],
        "test": [
            "absl-py>=2.0.0",
            "chex>=0.1.90",
            "numpy>=2.0.0",
            "pytest>=8.0.0",
            # The tests run in parallel workers (``pytest -n auto``; the GPU
            # tests ``-n 8``): compiling dominates.
            "pytest-xdist>=3.5.0",
            "flax>=0.12.2",
            "optax>=0.2.4",
            "matplotlib>=3.8.4",
            "nbformat>=5.10.0",
            "nbclient>=0.10.0",
            "ipykernel>=6.29.0",
            # tests/test_hf.py compares deltajax.hf with transformers' modules;
            # 2.13.0 is the CPU build on these machines (an unpinned torch
            # pulls a multi-GB CUDA build).
            "safetensors>=0.8.0",
            "torch==2.13.0",
            "transformers>=5.24.0",
        ],
    },
    license="Apache-2.0",
)
