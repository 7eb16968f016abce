"""GPT pretraining samples cut from a token stream, as Megatron's GPTDataset does.

A split is a set of sequences (documents) of a low-level dataset (``IndexedDataset``, or
``MockGPTLowLevelDataset`` for ``--mock-data``; both go through this one code path).
Three index arrays turn it into samples of ``seq_length + 1`` tokens:

- document index: the split's documents repeated for as many epochs as the requested
  samples need, shuffled with ``numpy.random.RandomState(seed)``. When the last epoch
  would contribute under 80% of an epoch's samples it is shuffled separately, so the
  partial epoch is not diluted across the earlier ones (Megatron's rule);
- sample index [N + 1, 2]: (position in the document index, token offset) of each sample
  boundary. Sample i runs from boundary i to boundary i + 1 inclusive, so consecutive
  samples share one token and samples run across document boundaries;
- shuffle index: a permutation of the samples (same RandomState, same epoch rule).

Labels that are the tokenizer's pad id carry no loss and the id is fed as 0 (Megatron's
rule, ``pad_id_to_mask``: only a pad id distinct from end of document and sentence).

Same seed, data and split give Megatron's sample order. Unusual here: the sample index is
computed with a cumulative sum and a binary search instead of Megatron's C++ loop (same
result, no compiled helper), and the arrays are cached atomically (see ``index_cache``).
"""

import hashlib
import logging
import os

import numpy as np
import torch

from megatron.core.datasets.index_cache import CachedIndices

logger = logging.getLogger(__name__)

# Below this share of an epoch's samples, the last epoch is shuffled on its own (Megatron: 0.80).
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def _build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    last = _build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def _build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, num_samples: int, seq_length: int
) -> np.ndarray:
    """Sample boundaries [num_samples + 1, 2] = (document-index position, token offset).

    Boundary i is global token i * seq_length of the concatenated (shuffled) documents.
    Megatron's loop lands on the same places: a boundary that falls on a document's
    last token stays in that document, and empty documents are never landed on.
    """
    doc_lengths = sequence_lengths[document_index].astype(np.int64)  # [num_docs_in_epochs]
    ends = np.cumsum(doc_lengths)  # exclusive end of each document in the stream
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    which = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[which] - doc_lengths[which])
    big = max(len(document_index), int(doc_lengths.max(initial=0))) >= np.iinfo(np.int32).max
    sample_index = np.stack([which, offsets], axis=1).astype(np.int64 if big else np.int32)
    sample_index[0] = 0  # Megatron starts at (0, 0) even before an empty first document.
    return sample_index


def _build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """Builds the document, sample and shuffle indices of one split.

    Args:
        sequence_lengths: int [S] tokens per sequence of the low-level dataset.
        documents: int [D] sequence ids in this split.
        num_samples: Samples wanted (None: one epoch).
        seq_length: Tokens per sample input (each sample reads seq_length + 1).
        seed: Seed of the RandomState that shuffles documents and samples.

    Returns:
        ``{"document_index", "sample_index", "shuffle_index"}``; the dataset length is
        ``len(shuffle_index)`` >= num_samples (whole epochs are cut).
    """
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError("the split has no tokens; change --split or use a larger dataset.")
    num_epochs = 1
    if num_samples is not None:
        # Enough tokens for num_samples samples of seq_length + 1 tokens that overlap by one.
        num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_from_final = num_samples - samples_before_final
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= samples_from_final <= samples_per_epoch + 1
        separate_final_epoch = samples_from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)

    rng = np.random.RandomState(seed)
    document_index = _build_document_index(documents, num_epochs, rng, separate_final_epoch)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = _build_sample_index(sequence_lengths, document_index, total_samples, seq_length)
    shuffled = samples_before_final if separate_final_epoch else total_samples
    shuffle_index = _build_shuffle_index(shuffled, total_samples, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def default_cache_dir(path_prefix: str, class_name: str = "GPTDataset") -> str:
    """``<folder of the data>/cache/<class>_indices``."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache", f"{class_name}_indices")


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length GPT samples from one split of a low-level dataset.

    Args:
        low_level_dataset: Has ``sequence_lengths`` and ``get(idx, offset, length)``
            (``IndexedDataset`` or ``MockGPTLowLevelDataset``).
        documents: int [D] sequence ids of this split.
        num_samples: Samples wanted (None: one epoch).
        seq_length: Sample length (``--seq-length``).
        seed: ``--seed``.
        eod: End-of-document id (``tokenizer.eod``).
        split_name: ``train``, ``valid`` or ``test`` (names the cache files).
        path_prefix: Data prefix; keys the cache and places its default folder. None for mock.
        cache_dir: ``--data-cache-path`` (None: next to the data; no cache for mock data).
        eod_mask_loss: Zero the loss where the input token is end-of-document (Megatron's
            ``--eod-mask-loss``; it masks predicting a new document's first token).
        vocab_size: The tokenizer's vocabulary size: a sample holding a larger id raises
            ``ValueError`` naming the data (instead of an index error in the embedding).
        fim: A ``fim.FIMRewriter`` (``--fim-data``): each sample's tokens are rewritten in
            fill-in-the-middle format with its own random stream.
        pad: Megatron's pad id (``pad_id_to_mask(tokenizer)``) or None: where a label is this id
            its loss is zeroed, and the id is replaced by 0 in tokens and labels.
        reset_position_ids: Positions count again from 0 after each end-of-document input token
            (``--reset-position-ids``; read by learned absolute position embeddings).
        reset_attention_mask: Each item also holds ``attention_mask`` bool ``[1, s, s]``, True where
            query i may attend key j: ``j <= i`` within one document (``--reset-attention-mask``;
            Megatron's document mask: no token attends across an end-of-document input token).

    Each item is a dict of tensors: ``tokens`` int64 [s], ``labels`` int64 [s] (tokens
    shifted by one), ``loss_mask`` float32 [s], ``position_ids`` int64 [s].
    """

    def __init__(
        self,
        low_level_dataset,
        documents: np.ndarray,
        num_samples: int | None,
        *,
        seq_length: int,
        seed: int,
        eod: int,
        split_name: str = "train",
        path_prefix: str | None = None,
        cache_dir: str | None = None,
        eod_mask_loss: bool = False,
        vocab_size: int | None = None,
        fim=None,
        pad: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
    ):
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}.")
        self.dataset = low_level_dataset
        self.documents = np.asarray(documents, dtype=np.int64)
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.seed = seed
        self.eod = eod
        self.split_name = split_name
        self.path_prefix = path_prefix
        self.eod_mask_loss = eod_mask_loss
        self.vocab_size = vocab_size
        self.fim = fim
        self.pad = pad
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        if len(self.documents) == 0:
            raise ValueError(
                f"the {split_name} split of {path_prefix or 'the mock data'} has no documents; "
                "change --split or use a larger dataset."
            )
        lengths = low_level_dataset.sequence_lengths
        description = {
            "class": type(self).__name__,
            "format": 1,
            "path_prefix": os.path.abspath(path_prefix) if path_prefix else "mock",
            "num_sequences": int(len(lengths)),
            "num_tokens": int(lengths.sum(dtype=np.int64)),
            "split": split_name,
            "documents": [int(self.documents[0]), int(self.documents[-1]) + 1, int(len(self.documents))],
            "documents_md5": _md5(self.documents),
            "seq_length": int(seq_length),
            "seed": int(seed),
            "num_samples": None if num_samples is None else int(num_samples),
            "add_extra_token": True,
        }
        # Keys the FIM random streams: what the split holds, not where the files are.
        self._fim_key = f"{split_name}:{description['num_tokens']}:{description['documents_md5']}"
        fingerprint = getattr(low_level_dataset, "fingerprint", None)
        if fingerprint is not None:
            description["files"] = fingerprint()  # re-preprocessed data never reuses stale indices
        default_dir = default_cache_dir(path_prefix, type(self).__name__) if path_prefix else None
        self.cache = CachedIndices(
            description,
            f"{type(self).__name__}-{split_name}",
            _INDEX_NAMES,
            cache_dir,
            default_dir,
            identity=("class", "path_prefix", "split"),
        )
        arrays = self.cache.get(lambda: build_gpt_indices(lengths, self.documents, num_samples, seq_length, seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._position_ids = torch.arange(seq_length, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample ``idx`` (after shuffling), int64."""
        i = int(self.shuffle_index[idx])
        doc_beg, offset_beg = (int(v) for v in self.sample_index[i])
        doc_end, offset_end = (int(v) for v in self.sample_index[i + 1])
        if doc_beg == doc_end:
            parts = [self.dataset.get(int(self.document_index[doc_beg]), offset_beg, offset_end - offset_beg + 1)]
        else:
            parts = [self.dataset.get(int(self.document_index[doc_beg]), offset_beg)]
            parts.extend(self.dataset.get(int(self.document_index[d])) for d in range(doc_beg + 1, doc_end))
            # The boundary token is the last one of this sample and the first of the next.
            parts.append(self.dataset.get(int(self.document_index[doc_end]), 0, offset_end + 1))
        text = np.concatenate(parts).astype(np.int64)
        assert len(text) == self.seq_length + 1, (len(text), self.seq_length)
        if self.vocab_size is not None and (text.max() >= self.vocab_size or text.min() < 0):
            bad = int(text.max()) if text.max() >= self.vocab_size else int(text.min())
            raise ValueError(
                f"{self.path_prefix or 'the mock data'}: sample {idx} holds token id {bad}, outside the tokenizer's "
                f"{self.vocab_size} ids: the data was preprocessed with another tokenizer. Pass the tokenizer flags "
                "that tools/preprocess_data.py used (--tokenizer-type, --vocab-file, --tokenizer-model, "
                "--vocab-size) or re-preprocess the data."
            )
        return text

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = self.sample_tokens(idx)
        if self.fim is not None:
            text = self.fim(text, self.fim.rng_for(self._fim_key, idx))
        text = torch.from_numpy(text)
        tokens = text[:-1].contiguous()
        labels = text[1:].contiguous()
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod] = 0.0
        if self.pad is not None:
            loss_mask[labels == self.pad] = 0.0
            tokens[tokens == self.pad] = 0
            labels[labels == self.pad] = 0
        positions = self._position_ids.clone()
        if self.reset_position_ids:  # count again from 0 after each end-of-document input
            after_eod = torch.zeros_like(positions)
            after_eod[1:] = torch.where(tokens[:-1] == self.eod, positions[1:], 0)
            positions -= torch.cummax(after_eod, dim=0).values
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
        if self.reset_attention_mask:
            item["attention_mask"] = document_mask(tokens, self.eod)
        return item


def document_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[1, s, s]`` bool for ``tokens [s]``: True where query i may attend key j, ``j <= i`` and no
    end-of-document token at a position in ``[j, i)`` (Megatron's ``--reset-attention-mask``)."""
    doc = torch.zeros_like(tokens)
    doc[1:] = torch.cumsum(tokens[:-1] == eod, dim=0)  # documents started before each position
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril_()
    return (causal & (doc.unsqueeze(1) == doc.unsqueeze(0))).unsqueeze(0)


def _md5(array: np.ndarray) -> str:
    return hashlib.md5(np.ascontiguousarray(array).tobytes()).hexdigest()


def pad_id_to_mask(tokenizer, allow_ambiguous: bool = False) -> int | None:
    """Megatron's pad rule: the tokenizer's ``pad`` id, unless it has none (or -1) or the id is also
    its end of document or sentence (then no id is masked, unless ``allow_ambiguous``:
    ``--allow-ambiguous-pad-tokens``, which masks that id, ends of documents included)."""
    pad = getattr(tokenizer, "pad", None)
    if pad is None or pad < 0:
        return None
    if pad in (getattr(tokenizer, "eod", None), getattr(tokenizer, "eos", None)) and not allow_ambiguous:
        return None
    return int(pad)


class MockGPTLowLevelDataset:
    """Megatron's synthetic documents for ``--mock-data``.

    100,000 documents whose lengths are drawn once with ``numpy.random.default_rng(0)``
    from [1, 4096); document i is ``(arange(len - 1) + 1) % vocab_size`` then ``eod``.

    Args:
        tokenizer: Gives ``vocab_size`` and ``eod``.
    """

    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, tokenizer):
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod = int(tokenizer.eod)
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        return np.concatenate([(np.arange(length - 1, dtype=np.int64) + 1) % self.vocab_size, [self.eod]]).astype(
            np.int64
        )

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """``GPTDataset`` over ``MockGPTLowLevelDataset`` (cached only with ``--data-cache-path``)."""
