"""--deterministic-mode: the environment and the process-wide switches for bitwise-repeatable runs.

Libraries read their switches once: NCCL when a communicator is created, cuBLAS when its
handle is created. So :func:`apply_determinism_env` runs before the process groups
exist; :func:`set_determinism` then switches torch to its deterministic kernels. A value
the launcher set wins when it is a deterministic one and is refused otherwise, as in
Megatron.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""What --deterministic-mode sets when the launcher did not: ring all-reduce (a fixed
summation order) and a cuBLAS workspace configuration with deterministic reductions."""

NCCL_ALGO_TOKENS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
"""NCCL_ALGO tokens Megatron accepts under --deterministic-mode (Tree is not: its reduction
order depends on the topology)."""

ENV_VALUES = {"CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"})}


def apply_determinism_env(env: MutableMapping[str, str]) -> None:
    """Checks the launcher's determinism variables in ``env``, then fills in the defaults.

    Raises:
        ValueError: a variable holds a value that is not deterministic (the message
            names it, the accepted values and the fix).
    """
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGO_TOKENS for t in tokens):
            raise ValueError(
                f"--deterministic-mode: NCCL_ALGO={algo!r} does not fix the summation order; every token must be one "
                f"of {', '.join(sorted(NCCL_ALGO_TOKENS))}. Unset it (Ring is used) or drop --deterministic-mode."
            )
    for name, accepted in ENV_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise ValueError(
                f"--deterministic-mode: {name}={value!r} is not a deterministic setting (accepted: "
                f"{', '.join(sorted(accepted))}). Unset it or use one of those."
            )
    for name in ("MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC"):  # the fused Mamba kernels, if installed
        value = env.get(name)
        if value and not value.startswith("1"):
            raise ValueError(
                f"--deterministic-mode: {name}={value!r} turns off deterministic kernels; unset it or set 1."
            )
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)


def set_determinism(cfg: Any, use_cuda: bool) -> None:
    """The process-wide numerics switches: --deterministic-mode, --disable-bf16-reduced-precision-matmul.

    The environment is :func:`apply_determinism_env`'s, run earlier (before the process
    groups exist: ``build_trainer`` does)."""
    if cfg.precision.bf16 and cfg.precision.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # process-wide, as in Megatron
    if not cfg.training.deterministic_mode:
        return
    torch.use_deterministic_algorithms(True)
    if use_cuda:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
