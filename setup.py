"""deltajax: gated delta rule linear attention (Gated DeltaNet, KDA) for JAX."""

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
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10",
        "jaxlib>=0.10",
        "numpy>=1.26",
        "chex>=0.1.90",
        "absl-py>=2.0",
    ],
    extras_require={
        "nn": ["flax>=0.12", "optax>=0.2.4"],
        "test": [
            "pytest>=8",
            "flax>=0.12",
            "optax>=0.2.4",
            "matplotlib>=3.8",
            "nbformat>=5.10",
            "nbclient>=0.10",
            "ipykernel>=6.29",
        ],
    },
    license="Apache-2.0",
)
