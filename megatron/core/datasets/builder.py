"""Builds the train/valid/test datasets from ``DataConfig`` (``--data-path``, ``--split``, ``--mock-data``).

- ``--data-path PREFIX`` (one dataset), ``--data-path 0.3 pA 0.7 pB`` (weighted blend)
  or ``--data-path pA pB`` (equal weights). Prefixes are given without ``.bin``/``.idx``.
- ``--split 969,30,1``: each dataset's documents are cut into consecutive train, valid
  and test ranges in these proportions (Megatron's book-end rounding).
- A blend asks each component for ``ceil(ceil(n * weight) * 1.005)`` samples, 0.5% spare
  so the greedy blend never runs a component dry, as Megatron does.

Every rank builds its own datasets; index caches are written atomically, so concurrent
builders are safe without a barrier (the first to finish wins, the others' identical
files replace it).
"""

import logging
import math
import re
from collections.abc import Sequence

import numpy as np

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    default_cache_dir,
    pad_id_to_mask,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, exists

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """``["0.3", "pA", "0.7", "pB"]`` -> (prefixes, normalised weights).

    Entries holding spaces are split, so ``["0.3 pA 0.7 pB"]`` works too. Without weights
    every prefix weighs the same.
    """
    words = [w for entry in data_path for w in str(entry).split()]
    if not words:
        raise ValueError("--data-path is empty; pass a dataset prefix (or --mock-data).")

    def as_float(word: str) -> float | None:
        try:
            return float(word)
        except ValueError:
            return None

    is_number = [as_float(w) is not None for w in words]
    if len(words) % 2 == 0 and all(is_number[0::2]) and not any(is_number[1::2]):
        weights, prefixes = [float(w) for w in words[0::2]], words[1::2]
    elif not any(is_number):
        prefixes, weights = words, [1.0] * len(words)
    else:
        raise ValueError(
            f"--data-path {' '.join(words)} mixes weights and prefixes; write 'W1 P1 W2 P2 ...' "
            "(a weight before every prefix) or only prefixes."
        )
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights must be >= 0 with a positive sum, got {weights}.")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised [train, valid, test] weights (missing ones are 0).

    Quotes around the numbers are dropped, as Megatron's parser drops everything but them: upstream's
    example scripts pass ``--split '99,1,0'`` from inside a shell array, quotes and all.
    """
    numbers = re.findall(r"[^,/\s]+", split.strip().strip("'\""))
    try:
        values = [float(x) for x in numbers]
    except ValueError:
        raise ValueError(f"--split {split!r} must be comma-separated numbers, e.g. 969,30,1.") from None
    values += [0.0] * (3 - len(values))
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise ValueError(
            f"--split {split!r} needs up to three non-negative weights (train,valid,test) with a positive sum."
        )
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: Sequence[float], num_documents: int) -> list[tuple[int, int] | None]:
    """Document [begin, end) of each split; None where the split's weight is 0.

    Book-ends are the cumulative weights, each rounded to a document index, so adjacent
    splits touch and together cover every document.
    """
    ranges: list[tuple[int, int] | None] = []
    edge = 0.0
    for weight in split:
        lo, hi = edge, edge + weight
        edge = hi
        if weight == 0:
            ranges.append(None)
            continue
        ranges.append((int(round(lo * num_documents)), int(round(min(hi, 1.0) * num_documents))))
    return ranges


def _blend_sizes(weights: Sequence[float], target: int, surplus: float) -> list[int]:
    """Samples each blend component builds: its share and ``surplus`` (--mid-level-dataset-surplus) more."""
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in weights]


def _kept_blend(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """``(prefixes, weights)`` of a --data-path style blend, prefixes of weight 0 dropped."""
    prefixes, weights = parse_data_path(data_path)
    kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]
    return [p for p, _ in kept], [w for _, w in kept]


def _open_prefix(prefix: str) -> IndexedDataset:
    if exists(prefix):
        return IndexedDataset(prefix)
    hint = ""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix) and exists(prefix[: -len(suffix)]):
            hint = f" Drop the suffix: --data-path {prefix[: -len(suffix)]}"
    raise ValueError(
        f"--data-path {prefix}: no {prefix}.bin/{prefix}.idx found. Give the prefix without "
        f".bin/.idx (as tools/preprocess_data.py writes it, e.g. corpus_text_document).{hint}"
    )


def build_train_valid_test_datasets(
    data_config,
    tokenizer,
    *,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    fim=None,
):
    """Builds (train, valid, test) datasets; a split is None when its weight or sample count is 0.

    Args:
        data_config: ``DataConfig`` (mock_data, data_path, split, data_cache_path; or the per-split
            train/valid/test_data_path, each split then a blend of all of its prefixes' documents).
        tokenizer: Gives ``eod`` (and ``vocab_size`` for mock data).
        seq_length: ``--seq-length``.
        seed: ``--seed`` (shuffles documents and samples).
        num_samples: Samples wanted per split (train, valid, test).
        fim: A ``fim.FIMRewriter`` for ``--fim-data`` (every split, as Megatron), or None.

    Returns:
        Three datasets (``GPTDataset``, ``MockGPTDataset`` or ``BlendedDataset``) or None each.
    """
    split = parse_split(data_config.split)
    cache_dir = data_config.data_cache_path
    eod_mask_loss = bool(getattr(data_config, "eod_mask_loss", False))
    common = dict(
        seq_length=seq_length,
        seed=seed,
        eod=tokenizer.eod,
        cache_dir=cache_dir,
        eod_mask_loss=eod_mask_loss,
        vocab_size=tokenizer.vocab_size,
        fim=fim,
        pad=pad_id_to_mask(tokenizer, bool(getattr(data_config, "allow_ambiguous_pad_tokens", False))),
        reset_position_ids=bool(getattr(data_config, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(data_config, "reset_attention_mask", False)),
    )
    wanted = [n if n else 0 for n in num_samples]

    if data_config.mock_data:
        low = MockGPTLowLevelDataset(tokenizer)
        out = []
        for name, bounds, n in zip(SPLIT_NAMES, split_ranges(split, len(low)), wanted):
            if bounds is None or n == 0:
                out.append(None)
                continue
            out.append(MockGPTDataset(low, np.arange(*bounds), n, split_name=name, path_prefix=None, **common))
        return tuple(out)

    per_split = [getattr(data_config, f"{name}_data_path", None) or [] for name in SPLIT_NAMES]
    own_blends = any(per_split)  # each split its own blend, every document of its prefixes (--split unused)
    if own_blends:
        blends = [_kept_blend(words) if words else ([], []) for words in per_split]  # a split may have none
    else:
        blends = [_kept_blend(data_config.data_path)] * 3
    opened: dict[str, IndexedDataset] = {}
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        prefixes, weights = blends[s]
        n = wanted[s]
        if not prefixes or (not own_blends and split[s] == 0) or n == 0:
            out.append(None)
            continue
        surplus = getattr(data_config, "mid_level_dataset_surplus", 0.005)
        sizes = [n] if len(prefixes) == 1 else _blend_sizes(weights, n, surplus)
        parts = []
        for prefix, size in zip(prefixes, sizes):
            if prefix not in opened:
                opened[prefix] = _open_prefix(prefix)
            low = opened[prefix]
            begin, end = (0, len(low)) if own_blends else split_ranges(split, len(low))[s]
            if begin == end:
                raise ValueError(
                    f"--split {data_config.split} leaves the {name} split of {prefix} no documents "
                    f"(it has {len(low)}); give that split more weight, set it to 0, or use more data."
                )
            parts.append(GPTDataset(low, np.arange(begin, end), size, split_name=name, path_prefix=prefix, **common))
        if len(parts) == 1:
            out.append(parts[0])
            continue
        description = [d.cache.key for d in parts]
        out.append(
            BlendedDataset(
                parts,
                weights,
                n,
                description=description,
                cache_dir=cache_dir,
                default_cache_dir=default_cache_dir(prefixes[0], "BlendedDataset"),
                split_name=name,
            )
        )
    return tuple(out)
