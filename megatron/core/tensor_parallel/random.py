"""Seeding of the random generators used by the model.

Kept deliberately small: with TP = 1 every rank of a model replica draws from torch's
default generators, and ``torch.manual_seed`` seeds the CPU generator and the default
generator of every CUDA device. Those CUDA generators are safe to use inside CUDA-graph
capture (torch registers them with the graph), so dropout needs no separate tracker.
A tensor-parallel RNG tracker (distinct streams per TP rank for TP-split dropout)
belongs here once TP exists.
"""

import torch


def model_parallel_manual_seed(seed: int) -> None:
    """Seeds torch's CPU generator and the default generator of every CUDA device.

    Args:
        seed: The seed; callers add any per-rank offsets (for example per pipeline stage).
    """
    torch.manual_seed(seed)  # also seeds every CUDA device's default generator (lazily)
