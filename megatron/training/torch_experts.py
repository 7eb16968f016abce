"""``--ckpt-format torch`` across expert-parallel sizes: one rank's file from the saving run's EP files.

With EP > 1 each EP rank's file (``mp_rank_TT[_PPP]_EEE``) holds the dense weights and
its own experts under local names (``local_experts.<i>``, or dim 0 of a grouped
expert weight), as Megatron writes them; local expert ``i`` of EP rank ``e`` is global
expert ``e * num_local + i``. A run with another EP size (same TP and PP) reads every
EP file of its TP/PP rank and builds the file it would have written itself: the dense
entries from the first file, each of its experts from the file that holds it, and the
optimizer state (torch's position-indexed layout, which both optimizers load) in its
own parameter order.

What is unusual: torch's optimizer state is keyed by position, not name. The position
of a parameter is its place in the model's parameter order, weight-decayed parameters
(2-D and up) first, as ``MixedPrecisionOptimizer`` builds its groups. The saving run's
order is this run's with each MoE layer's run of experts resized to the saving
run's count, so it is computed here from this run's model rather than stored.
"""

import glob
import os
import re
from typing import Any

import torch

from megatron.core.distributed.distributed_data_parallel import is_expert_param
from megatron.training.logging_utils import print_rank_0

_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def saved_ep_size(iteration_dir: str, rank_dir: str) -> int | None:
    """The EP size of the run that saved ``iteration_dir``, seen from this rank's TP/PP
    folder name without its EP part (``mp_rank_00`` or ``mp_rank_00_001``); None when
    the folder holds no file of this TP/PP rank."""
    if os.path.isdir(os.path.join(iteration_dir, rank_dir)):
        return 1
    found = glob.glob(os.path.join(iteration_dir, glob.escape(rank_dir) + "_[0-9][0-9][0-9]"))
    return len(found) or None


def _module(model) -> torch.nn.Module:
    return getattr(model, "module", model)


def _params_in_order(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``(state-dict name, parameter)`` of the trainable parameters, in model order."""
    seen, out = set(), []
    for name, param in _module(model).named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def _resized(names: list[str], num_local: int) -> list[str]:
    """``names`` with every run of sequential experts (``local_experts.0 .. n-1``) resized to ``num_local``."""
    out, i = [], 0
    while i < len(names):
        match = _LOCAL_EXPERT.match(names[i])
        if match is None:
            out.append(names[i])
            i += 1
            continue
        prefix = match[1]
        block = []  # the run of this layer's experts, then expert 0's parameter suffixes
        while i < len(names) and names[i].startswith(prefix):
            block.append(_LOCAL_EXPERT.match(names[i]))
            i += 1
        suffixes = [m[3] for m in block if m[2] == "0"]
        out += [f"{prefix}{e}{suffix}" for e in range(num_local) for suffix in suffixes]
    return out


def _optimizer_order(params: list[tuple[str, torch.nn.Parameter]], num_local: int | None) -> tuple[list, list]:
    """State-dict positions -> names (decayed first), and the bf16/fp16 names in model order,
    for this model's parameters, or for the same model with ``num_local`` sequential experts."""
    decays = {n: p.ndim >= 2 for n, p in params}
    lowp = {n: p.dtype in _LOW_PRECISION for n, p in params}
    names = [n for n, _ in params]
    if num_local is not None:
        names = _resized(names, num_local)

    def like(name: str) -> str:  # a parameter of this model with the same shape rank and dtype
        match = _LOCAL_EXPERT.match(name)
        return name if match is None else f"{match[1]}0{match[3]}"

    order = [n for n in names if decays[like(n)]] + [n for n in names if not decays[like(n)]]
    return order, [n for n in names if lowp[like(n)]]


def _source(name: str, grouped: set[str], ep_rank: int, num_local: int, saved_local: int):
    """Where this rank's tensor ``name`` comes from: ``(file, name there, rows)``; ``rows``
    is the slice of the grouped experts (all files concatenated along dim 0), else None."""
    match = _LOCAL_EXPERT.match(name)
    if match is not None:
        expert = ep_rank * num_local + int(match[2])
        return expert // saved_local, f"{match[1]}{expert % saved_local}{match[3]}", None
    if name in grouped:
        return None, name, slice(ep_rank * num_local, (ep_rank + 1) * num_local)
    return 0, name, None


def _pick(values: list, file: int | None, rows: slice | None):
    """One file's value, or the grouped rows out of every file's."""
    if rows is None:
        return values[file]
    if not torch.is_tensor(values[0]) or values[0].dim() == 0:
        return values[0]  # step: the same in every file
    return torch.cat(values, dim=0)[rows].clone()


def merge(files: list[dict[str, Any]], model, num_experts: int, pg) -> dict[str, Any]:
    """This rank's file contents, built from the saving run's EP files (in EP-rank order).

    Raises:
        ValueError: The files do not fit this model (another parameter count per EP rank).
    """
    saved_ep, ep_size, ep_rank = len(files), pg.ep_size, pg.ep_rank if pg.ep_size > 1 else 0
    saved_local, num_local = num_experts // saved_ep, num_experts // ep_size
    print_rank_0(
        f"> --expert-model-parallel-size {ep_size}: merging the experts of a checkpoint saved at "
        f"expert-parallel size {saved_ep} by global expert index"
    )
    tensors = _module(model).state_dict(keep_vars=True)
    sequential = any(_LOCAL_EXPERT.match(n) for n in tensors)
    grouped = {n for n, t in tensors.items() if is_expert_param(t) and not _LOCAL_EXPERT.match(n)}
    out = dict(files[0])

    def value_of(name: str, values_of):
        file, there, rows = _source(name, grouped, ep_rank, num_local, saved_local)
        files_used = range(saved_ep) if rows is not None else [file]
        values = [None] * saved_ep
        for f in files_used:
            values[f] = values_of(f, there)
        return _pick(values, file, rows)

    model_state = {}
    for name in tensors:
        try:
            model_state[name] = value_of(name, lambda f, there: files[f]["model"][there])
        except KeyError as e:
            raise ValueError(
                f"checkpoint saved at --expert-model-parallel-size {saved_ep} lacks {e}: it was saved for "
                "another model; pass the saving run's model and MoE flags."
            ) from e
    out["model"] = model_state

    if "optimizer" in files[0]:
        out["optimizer"] = _merge_optimizer(files, model, sequential, saved_local, value_of)
    return out


def _merge_optimizer(files, model, sequential: bool, saved_local: int, value_of) -> dict[str, Any]:
    params = _params_in_order(model)
    mine, mine_lowp = _optimizer_order(params, None)
    theirs, theirs_lowp = _optimizer_order(params, saved_local if sequential else None)
    position = {n: i for i, n in enumerate(theirs)}
    lowp_position = {n: i for i, n in enumerate(theirs_lowp)}
    for f, contents in enumerate(files):
        saved = contents["optimizer"]
        count = sum(len(g["params"]) for g in saved["optimizer"]["param_groups"])
        if count != len(theirs) or len(saved["main_params"]) != len(theirs_lowp):
            raise ValueError(
                f"optimizer state of expert-parallel rank {f} holds {count} parameters, the saving layout of this "
                f"model {len(theirs)}: it was saved with other model or MoE flags; pass them, or --no-load-optim."
            )
    states = [c["optimizer"]["optimizer"]["state"] for c in files]
    keys = sorted(next(iter(states[0].values()), {}))  # every parameter has the same entries (step, moments)
    state = {}
    for i, name in enumerate(mine):
        if keys:
            state[i] = {k: value_of(name, lambda f, there, k=k: states[f][position[there]][k]) for k in keys}
    decayed = sum(1 for _, p in params if p.ndim >= 2)
    sizes = [n for n in (decayed, len(mine) - decayed) if n]
    saved_groups = files[0]["optimizer"]["optimizer"]["param_groups"]
    if len(saved_groups) != len(sizes):
        raise ValueError(
            f"optimizer state of the checkpoint has {len(saved_groups)} parameter groups, this model "
            f"{len(sizes)}: pass the saving run's model flags, or --no-load-optim."
        )
    groups, first = [], 0
    for group, size in zip(saved_groups, sizes):
        groups.append(dict(group, params=list(range(first, first + size))))
        first += size
    main = [value_of(n, lambda f, there: files[f]["optimizer"]["main_params"][lowp_position[there]]) for n in mine_lowp]
    return dict(files[0]["optimizer"], optimizer={"state": state, "param_groups": groups}, main_params=main)
