"""Weighted blend of datasets (``--data-path 0.3 pA 0.7 pB``), as Megatron's BlendedDataset.

Sample i of the blend comes from the dataset whose share so far lags its weight the
most: ``argmax_d(weight_d * max(i, 1) - taken_d)``, first dataset on ties, then that
dataset's next unused sample. The rule is deterministic (no RNG) and keeps every prefix
of the blend within one sample of the target proportions; sample order inside each
dataset is already shuffled by the dataset itself.

Unusual here: the greedy loop is plain Python (Megatron compiles it in C++); it is linear
in the blend size and its result is cached next to the GPT indices when a cache folder
is known.
"""

from collections.abc import Sequence

import numpy as np
import torch

from megatron.core.datasets.index_cache import CachedIndices


def build_blending_indices(weights: Sequence[float], size: int) -> dict[str, np.ndarray]:
    """Chooses the source dataset of each blended sample.

    Args:
        weights: Normalised weights, one per dataset.
        size: Number of blended samples.

    Returns:
        ``dataset_index`` int16 [size] (which dataset) and ``dataset_sample_index`` int64
        [size] (which sample of it).
    """
    weights = [float(w) for w in weights]
    n = len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * n
    for i in range(size):
        t = float(max(i, 1))
        best, best_error = 0, weights[0] * t - taken[0]
        for d in range(1, n):
            error = weights[d] * t - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = taken[best]
        taken[best] += 1
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


class BlendedDataset(torch.utils.data.Dataset):
    """Mixes datasets by weight.

    Args:
        datasets: The component datasets (each long enough for its share, with the builder's surplus;
            a ``ValueError`` names --mid-level-dataset-surplus otherwise).
        weights: Non-negative weights (normalised here).
        size: Number of samples of the blend.
        description: What the datasets are (for the cache key); None disables caching.
        cache_dir: ``--data-cache-path``.
        default_cache_dir: Cache folder to use when ``cache_dir`` is None.
        split_name: Names the cache files.
    """

    def __init__(
        self,
        datasets: list[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        *,
        description: dict | None = None,
        cache_dir: str | None = None,
        default_cache_dir: str | None = None,
        split_name: str = "train",
    ):
        assert len(datasets) == len(weights) and len(datasets) < np.iinfo(np.int16).max
        total = float(sum(weights))
        assert total > 0 and all(w >= 0 for w in weights)
        self.datasets = datasets
        self.weights = [w / total for w in weights]
        self.size = int(size)
        full_description = {
            "class": "BlendedDataset",
            "format": 1,
            "weights": self.weights,
            "size": self.size,
            "datasets": description,
        }
        cache = CachedIndices(
            full_description,
            f"BlendedDataset-{split_name}",
            ("dataset_index", "dataset_sample_index"),
            cache_dir if description is not None else None,
            default_cache_dir if description is not None else None,
        )
        arrays = cache.get(lambda: build_blending_indices(self.weights, self.size))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, dataset in enumerate(datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(dataset):  # the builder's surplus was too small
                raise ValueError(
                    f"blend component {d} has {len(dataset)} samples but the blend reads {int(used.max()) + 1}: "
                    "raise --mid-level-dataset-surplus (e.g. ten-fold)."
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
