"""The loop's counters and this rank's RNG streams, as one ``Stateful`` for checkpoints.

RNG states are stored as plain values and tensors (numpy's keys as an int64 tensor),
so a checkpoint holding them loads with ``torch.load(weights_only=True)``.
"""

import dataclasses
import random
from typing import Any

import numpy as np
import torch


@dataclasses.dataclass
class TrainState:
    """Counters of the loop and this rank's RNG streams, as one ``Stateful``.

    ``state_dict`` reads the RNG generators at the time of the call and
    ``load_state_dict`` restores them (when the state holds them: ``--no-load-rng``
    drops the entry).
    """

    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    include_cuda_rng: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "consumed_valid_samples": self.consumed_valid_samples,
            "skipped_train_samples": self.skipped_train_samples,
            "skipped_iterations": self.skipped_iters,
            "nan_iterations": self.nan_iters,
            "rng_state": get_rng_state(self.include_cuda_rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
        # Files written before the counters were saved lack them.
        self.consumed_valid_samples = int(state.get("consumed_valid_samples", 0))
        self.skipped_train_samples = int(state.get("skipped_train_samples", 0))
        self.skipped_iters = int(state.get("skipped_iterations", 0))
        self.nan_iters = int(state.get("nan_iterations", 0))
        if state.get("rng_state") is not None:
            set_rng_state(state["rng_state"], include_cuda=self.include_cuda_rng)


def get_rng_state(include_cuda: bool) -> dict[str, Any]:
    """Python, numpy, torch CPU (and the current CUDA device's) generator states, as plain values."""
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "random_rng_state": [version, list(internal), gauss],
        "np_rng_state": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # uint32 values fit in int64
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if include_cuda else None,
    }
    return state


def set_rng_state(state: dict[str, Any], include_cuda: bool) -> None:
    """Restores what ``get_rng_state`` returned."""
    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state(
        (
            np_state["algorithm"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_rng_state"])
    if include_cuda and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
