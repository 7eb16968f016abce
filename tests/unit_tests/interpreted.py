"""Triton kernels on the CPU: a script run in a child process with Triton's interpreter on
(``TRITON_INTERPRET=1`` is read when the kernels are defined, so not in this process)."""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="Triton is not installed (pip install -e .[test] brings it on Linux)"
)


def run_interpreted(script: str, timeout: float, **env: str) -> None:
    """Runs ``script`` (it prints ``ok`` last) in the interpreter, with ``env`` set; fails with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO, **env)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
