"""Newton-Schulz orthogonalization for Muon, whole or over tensor-parallel shards.

``newton_schulz(x)`` maps a matrix ``x = U S V^T`` to about ``U V^T``: it divides ``x``
by its Frobenius norm (so every singular value is at most 1) and applies the odd
polynomial ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` once per step, with the
``(a, b, c)`` of the chosen coefficient set. The iteration runs on the smaller side
(the matrix is transposed when it has more rows than columns).

Megatron's precision rule: with ``--muon-fp32-matmul-prec medium`` the iteration runs
in bfloat16 (the normalization stays in float32); ``high`` runs float32 matmuls that
CUDA may do in TF32.

Tensor parallelism (``newton_schulz_tp``): a weight split over TP ranks along
``partition_dim`` is either gathered whole on every rank (``duplicated``), or kept
split with each step's Gram matrix ``X X^T`` and the norm summed over the TP group
(``distributed``; the split dimension becomes the summed one). ``blockwise`` (the
caller passes no partition dimension) treats each shard as a matrix of its own.
"""

from collections.abc import Iterator
from itertools import chain, cycle, islice, repeat

import torch
import torch.distributed as dist

COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "cubic5": (
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
}
"""Coefficient sets ``(a, b, c)`` per step, by ``--muon-coefficient-type``."""

_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
"""Sets whose last entry repeats past their length; the others cycle."""

_FIXED_LENGTH = ("cubic5",)
"""Sets that are a schedule of exactly their length."""

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


def check_coefficients(coefficient_type: str, steps: int) -> None:
    """Raises ``ValueError`` (naming the flags) for an unknown set or a step count it cannot run."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(
            f"--muon-coefficient-type {coefficient_type!r} is not a Newton-Schulz coefficient set; use one of "
            f"{', '.join(COEFFICIENT_SETS)}."
        )
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be at least 1, got {steps}.")
    if coefficient_type in _FIXED_LENGTH and steps != len(COEFFICIENT_SETS[coefficient_type]):
        raise ValueError(
            f"--muon-coefficient-type {coefficient_type} is a fixed {len(COEFFICIENT_SETS[coefficient_type])}-step "
            f"schedule; set --muon-num-ns-steps {len(COEFFICIENT_SETS[coefficient_type])}."
        )


def coefficients(coefficient_type: str, steps: int) -> Iterator[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations."""
    check_coefficients(coefficient_type, steps)
    sets = COEFFICIENT_SETS[coefficient_type]
    base = chain(sets, repeat(sets[-1])) if coefficient_type in _REPEAT_LAST else cycle(sets)
    return islice(base, steps)


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """Muon's update scale for an ``(out=rows, in=cols)`` weight under ``--muon-scale-mode``."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r} is not one of {', '.join(SCALE_MODES)}.")


def _step(x: torch.Tensor, a: float, b: float, c: float, group) -> torch.Tensor:
    """One iteration ``a X + (b A + c A A) X`` with ``A = X X^T`` (summed over ``group``); 2-D or batched."""
    gram = x @ x.mT
    if group is not None:
        dist.all_reduce(gram, group=group)
    if x.ndim == 2:
        if c != 0.0:
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            return torch.addmm(x, poly, x, beta=a, alpha=1.0)
        return torch.addmm(x, gram, x, beta=a, alpha=b)
    if c != 0.0:
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        return torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return torch.baddbmm(x, gram, x, beta=a, alpha=b)


def newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    *,
    bf16: bool = False,
    transpose: bool | None = None,
    group=None,
    eps: float = 1e-15,
) -> torch.Tensor:
    """The Newton-Schulz orthogonalization of a float32 matrix (or a batch of them, ``(B, M, N)``).

    Args:
        x: float32 input, 2-D or 3-D.
        steps: Iterations (``--muon-num-ns-steps``).
        coefficient_type: Key of ``COEFFICIENT_SETS``.
        bf16: Run the iteration in bfloat16 (``--muon-fp32-matmul-prec medium``).
        transpose: Iterate on ``x^T``; default: when ``x`` has more rows than columns.
        group: ``x`` is this rank's column block of the (possibly transposed) matrix:
            the norm and each Gram matrix are summed over this process group.
        eps: Floor of the norm.

    Returns:
        A float32 tensor shaped like ``x``.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a 2-D matrix or a 3-D batch, got {x.ndim}-D.")
    if x.dtype != torch.float32:
        raise ValueError(f"Newton-Schulz takes float32 input, got {x.dtype}.")
    schedule = list(coefficients(coefficient_type, steps))
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if group is None:
        x = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)
    else:
        squares = (x * x).sum(dim=(-2, -1), keepdim=True)
        dist.all_reduce(squares, group=group)
        x = x / squares.sqrt().clamp_min(eps)
    if bf16:
        x = x.to(torch.bfloat16)
    for a, b, c in schedule:
        x = _step(x, a, b, c, group)
    x = x.to(torch.float32)
    return x.mT if transpose else x


def newton_schulz_tp(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str,
    *,
    group,
    partition_dim: int | None,
    mode: str,
    bf16: bool = False,
) -> torch.Tensor:
    """Newton-Schulz of a weight whose TP shard ``x`` is split along ``partition_dim`` (last two dims).

    ``partition_dim`` None (not split, or ``blockwise``): the shard alone. ``duplicated``:
    gather the whole matrix, orthogonalize it, keep this rank's block. ``distributed``:
    iterate on the shards, summing the norm and the Gram matrices over ``group``.
    """
    if partition_dim is None or group is None or dist.get_world_size(group) == 1:
        return newton_schulz(x, steps, coefficient_type, bf16=bf16)
    dim = x.ndim - 2 + partition_dim
    if mode == "duplicated":
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, x.contiguous(), group=group)
        whole = newton_schulz(torch.cat(shards, dim=dim), steps, coefficient_type, bf16=bf16)
        return whole.chunk(len(shards), dim=dim)[dist.get_rank(group)].contiguous()
    if mode == "distributed":
        # Rows split (0): iterate on x^T, whose split dimension is then the summed columns.
        return newton_schulz(x, steps, coefficient_type, bf16=bf16, transpose=partition_dim == 0, group=group)
    raise ValueError(f"--muon-tp-mode {mode!r} is not one of blockwise, duplicated, distributed.")
