"""Install: pip install -e .[test]  (CPU torch first: pip install torch==2.13.0)."""

from setuptools import find_packages, setup

setup(
    name="megatron-lean",
    version="0.1.0",
    description="A trimmed Megatron-style trainer with memory-lean partial CUDA graphs",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4,<2.15", "numpy>=1.24", "einops>=0.7"],
    extras_require={
        # Triton: the fused cross-entropy and Mamba scan kernels are tested on the CPU in its interpreter.
        "test": [
            "pytest>=7",
            # Pinned: another ruff version may format differently, and CI checks the format.
            "ruff==0.17.6",
            "pytest-timeout>=2.1",
            "pytest-xdist>=3.0",  # -n: the suite in one worker per core (README)
            "pyyaml>=6",
            "tensorboard>=2.14",
            "matplotlib>=3.7",
            "tokenizers>=0.15",
            "sentencepiece>=0.2",
            "triton>=3.0; platform_system == 'Linux'",
        ],
        "tensorboard": ["tensorboard>=2.14"],
        "tokenizers": ["tokenizers>=0.15", "sentencepiece>=0.2", "tqdm>=4.60"],
        # Transformer Engine is optional and never required; apex builds from source only
        # (the package called "apex" on the index is an unrelated project).
        "te": ["transformer-engine>=2.0"],
    },
)
