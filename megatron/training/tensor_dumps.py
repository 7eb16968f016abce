"""``--save-params-interval`` and ``--save-wgrads-interval``: Megatron's debug dumps of every parameter (after
the optimizer step) or of every main gradient (reduced, before the step) by name.

Megatron's layout: ``<--save>/<params|wgrads>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE].pth``, one file per
tensor-, pipeline- and expert-parallel rank, written by expert-data-parallel rank 0, holding
``{"model_chunk<k>": {parameter name: CPU tensor}}`` (``torch.load(weights_only=True)`` reads it).
"""

import os

import torch

from megatron.training.dist_checkpointing import unwrapped_model
from megatron.training.logging_utils import print_rank_0

PARAMS, WGRADS = "params", "wgrads"


def dump_name(pg) -> str:
    """``mp_rank_TT[_PPP][_EEE].pth`` of this rank (Megatron's ``save_grads``)."""
    name = f"mp_rank_{pg.tp_rank:02d}"
    if pg.pp_size > 1:
        name += f"_{pg.pp_rank:03d}"
    if pg.ep_size > 1:
        name += f"_{pg.ep_rank:03d}"
    return name + ".pth"


def dump(model, pg, save_dir: str, label: str, iteration: int) -> None:
    """Writes the parameters (``label`` ``params``) or their ``main_grad`` (``wgrads``) of ``model``."""
    print_rank_0(f"  saving {label} from iteration {iteration:7d}")
    if pg.expt_dp_rank != 0:
        return
    state = {}
    chunks = unwrapped_model(model)  # the names the checkpoints use
    for k, chunk in enumerate(chunks if isinstance(chunks, list) else [chunks]):
        tensors = {}
        for name, param in chunk.named_parameters():
            value = param.detach() if label == PARAMS else getattr(param, "main_grad", None)
            if value is not None:
                tensors[name] = value.detach().to("cpu", copy=True)
        state[f"model_chunk{k}"] = tensors
    folder = os.path.join(save_dir, label, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    torch.save(state, os.path.join(folder, dump_name(pg)))
