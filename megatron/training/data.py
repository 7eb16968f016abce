"""Tokenizer and data-iterator setup for the training loop.

Each DataLoader gets a torch generator of its own, seeded from ``--seed``: a
DataLoader draws its workers' base seed whenever an iteration over it starts (lazily,
at the first batch), and from torch's global generator that draw would shift the
dropout stream of the run. With a generator of its own the global stream does not
depend on ``--num-workers``, on when evaluation starts a pass, or on a resume.
"""

import signal
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.core.datasets.data_samplers import build_pretraining_data_loader
from megatron.core.datasets.fim import FIMRewriter
from megatron.core.tokenizers import build_tokenizer, vocab_size_with_padding


def setup_tokenizer(cfg, pg):
    """Builds the tokenizer and sets the padded vocabulary size on the model config.

    The one value set after ``RunConfig.resolve()``: it needs the tokenizer's files.
    On a frozen config that already holds the same size nothing is written.
    """
    tokenizer = build_tokenizer(cfg.data)
    padded = model_vocab_size(cfg.data, tokenizer.vocab_size, pg.tp_size)
    if cfg.model.vocab_size != padded:
        cfg.model.vocab_size = padded
    return tokenizer


def model_vocab_size(d, tokenizer_vocab_size: int, tp_size: int) -> int:
    """The model's vocabulary: --padded-vocab-size, else the tokenizer's padded (Megatron's rule) or, with
    --no-pad-vocab-size, as it is; raises ``ValueError`` when it is smaller or does not split over TP."""
    if d.padded_vocab_size is not None:
        size, flag = d.padded_vocab_size, f"--padded-vocab-size {d.padded_vocab_size}"
    elif d.pad_vocab_size:
        return vocab_size_with_padding(tokenizer_vocab_size, d.make_vocab_size_divisible_by, tp_size)
    else:
        size, flag = tokenizer_vocab_size, f"--no-pad-vocab-size (the tokenizer's {tokenizer_vocab_size})"
    if size < tokenizer_vocab_size:
        raise ValueError(f"{flag} is smaller than the tokenizer's vocabulary ({tokenizer_vocab_size}); raise it.")
    if size % tp_size:
        raise ValueError(
            f"{flag} does not split over --tensor-model-parallel-size {tp_size}; give a multiple of it "
            "(or let the vocabulary be padded)."
        )
    return size


def _own_generator(loader: Iterable, seed: int) -> Iterable:
    """Gives the DataLoader behind ``loader`` a generator of its own (module docstring)."""
    data_loader = getattr(loader, "loader", loader)  # WorkerBatches wraps the DataLoader
    assert isinstance(data_loader, torch.utils.data.DataLoader), type(loader)
    data_loader.generator = torch.Generator().manual_seed(seed)
    return loader


def repeat(loader: Iterable) -> Iterator:
    """Iterates ``loader`` again and again. Unlike ``itertools.cycle`` it keeps no batch."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


class DataIterators(NamedTuple):
    """This rank's micro-batch iterators; a split that is not read is None."""

    train: Iterator | None
    valid: Iterator | None
    test: Iterator | None


def evaluations_until(t, iteration: int) -> int:
    """Validations the training loop runs up to ``iteration``: at multiples of --eval-interval from
    --start-eval-at-iter on (``TrainingConfig`` ``t``)."""
    before_start = max(0, ((t.start_eval_at_iter or 0) - 1) // t.eval_interval)  # multiples < the start
    return max(0, iteration // t.eval_interval - before_start)


def eval_samples(t) -> tuple[int, int]:
    """Samples the valid and test splits are built with (Megatron's counts, from ``TrainingConfig``).

    Validation runs every --eval-interval iterations (from --start-eval-at-iter on) and once more at the
    end (once with --skip-train), the test split once at the end; each run reads --eval-iters batches of
    --eval-global-batch-size.
    """
    if t.eval_iters == 0:
        return 0, 0
    runs = 1 if t.skip_train else evaluations_until(t, t.train_iters) + 1
    per_run = t.eval_iters * t.eval_global_batch_size
    return runs * per_run, per_run


def build_data_iterators(cfg, tokenizer, pg, consumed_samples: int, consumed_valid_samples: int = 0) -> DataIterators:
    """Train, valid and test iterators of micro-batches for this rank.

    Training reads from ``consumed_samples`` and validation from ``consumed_valid_samples`` (both
    restored from a checkpoint); the test split, and validation with --skip-train, from sample 0.
    With --skip-train there is no train iterator; with --phase-transition-iterations the training
    data is the current phase's, read from its first sample at the phase's first iteration.
    """
    t = cfg.training
    if t.phase_transition_iterations:  # this data phase's own samples (the global batch is fixed then)
        first, end = t.phase_of(consumed_samples // t.global_batch_size)
        train_samples = (end - first) * t.global_batch_size
        consumed_samples -= first * t.global_batch_size
    else:
        train_samples = cfg.batch_schedule.samples_after(0, t.train_iters)
    if t.skip_train:
        train_samples = 0  # no train iterator
    valid_samples, test_samples = eval_samples(t)
    datasets = build_train_valid_test_datasets(
        cfg.data,
        tokenizer,
        seq_length=cfg.model.seq_length,
        seed=t.seed,
        num_samples=(train_samples, valid_samples, test_samples),
        fim=FIMRewriter.from_config(cfg.data, tokenizer, t.seed),
    )
    d = cfg.data
    order = dict(num_workers=d.num_workers, dataloader_type=d.dataloader_type, data_sharding=d.data_sharding)
    if t.exit_signal_handler:  # the workers outlive the signal that asks the trainer to save and stop
        order["workers_ignore"] = signal.Signals[t.exit_signal]

    def loader(dataset, consumed: int, micro_batch_size: int, seed: int):
        if dataset is None:
            return None
        built = build_pretraining_data_loader(dataset, consumed, micro_batch_size, pg.dp_rank, pg.dp_size, **order)
        return _own_generator(built, seed)

    train_ds, valid_ds, test_ds = datasets
    train = loader(train_ds, consumed_samples, t.micro_batch_size, t.seed)
    valid = loader(valid_ds, 0 if t.skip_train else consumed_valid_samples, t.eval_micro_batch_size, t.seed + 1)
    test = loader(test_ds, 0, t.eval_micro_batch_size, t.seed + 2)
    if train is not None:  # cyclic: each pass over the loader is the next epoch (Megatron's cyclic iterator)
        train = repeat(train) if d.dataloader_type == "cyclic" else iter(train)
    return DataIterators(train, valid and repeat(valid), test and repeat(test))
