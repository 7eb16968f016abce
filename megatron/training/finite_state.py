"""The NaN guard of saves: a checkpoint is never written from state holding NaN or Inf values.

``refuse_non_finite`` checks every floating-point tensor of the state to be saved (one host read for all
of them, and one all-reduce of the verdict), on every rank, before anything is written; both checkpoint
formats call it, so the tracker only ever points at finite weights.
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


class NonFiniteCheckpointError(RuntimeError):
    """A save refused because the state holds NaN or Inf values (nothing was written)."""


def _float_tensors(value: Any, where: str):
    """(name, tensor) for every floating-point tensor in a nested state dict."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield where, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _float_tensors(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _float_tensors(v, f"{where}[{i}]")


def refuse_non_finite(states: Mapping[str, Any], pg, iteration: int, kept: str) -> None:
    """Raises ``NonFiniteCheckpointError`` on every rank if any rank's state is not finite.

    ``kept``: what the refused save leaves in place, for the message (e.g. the tracker's iteration).

    One host read of one flag per tensor (stacked on the device), plus an all-reduce
    of the verdict when there are several ranks.
    """
    named = [(n, t) for key, value in states.items() for n, t in _float_tensors(value, key) if t.numel()]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    bad_flags = [False] * len(named)
    for indices in by_device.values():
        # max and min propagate NaN and Inf, and reduce without a tensor-sized temporary.
        extremes = [torch.stack([named[i][1].detach().amax(), named[i][1].detach().amin()]) for i in indices]
        flags = torch.stack([torch.isfinite(e).all().logical_not() for e in extremes]).tolist()
        for i, flag in zip(indices, flags):
            bad_flags[i] = bool(flag)
    bad = [name for (name, _), flag in zip(named, bad_flags) if flag]
    verdict = len(bad)
    if pg.world_size > 1 and dist.is_available() and dist.is_initialized():
        count = torch.tensor([verdict], dtype=torch.int64, device=pg.device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        verdict = int(count.item())
    if verdict:
        where = f"{len(bad)} of {len(named)} tensors on this rank, e.g. {', '.join(bad[:3])}" if bad else "other ranks"
        raise NonFiniteCheckpointError(
            f"refusing to save iteration {iteration}: the state holds NaN or Inf values ({where}); "
            f"nothing was written and {kept}"
        )
