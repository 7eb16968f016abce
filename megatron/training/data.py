"""Tokenizer and data-iterator setup for the training loop.

Each DataLoader gets a torch generator of its own, seeded from ``--seed``: a
DataLoader draws its workers' base seed whenever an iteration over it starts (lazily,
at the first batch), and from torch's global generator that draw would shift the
dropout stream of the run. With a generator of its own the global stream does not
depend on ``--num-workers``, on when evaluation starts a pass, or on a resume.
"""

from collections.abc import Iterable, Iterator

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
    padded = vocab_size_with_padding(tokenizer.vocab_size, cfg.data.make_vocab_size_divisible_by, pg.tp_size)
    if cfg.model.vocab_size != padded:
        cfg.model.vocab_size = padded
    return tokenizer


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


def build_data_iterators(cfg, tokenizer, pg, consumed_samples: int) -> tuple[Iterator, Iterator | None]:
    """Train (and valid, when evaluation is on) iterators of micro-batches for this rank."""
    t = cfg.training
    train_samples = cfg.batch_schedule.samples_after(0, t.train_iters)  # iterations x batch when it is constant
    eval_runs = t.train_iters // t.eval_interval + 1 if t.eval_iters > 0 else 0
    valid_samples = eval_runs * t.eval_iters * t.global_batch_size
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        cfg.data,
        tokenizer,
        seq_length=cfg.model.seq_length,
        seed=t.seed,
        num_samples=(train_samples, valid_samples, 0),
        fim=FIMRewriter.from_config(cfg.data, tokenizer, t.seed),
    )
    d = cfg.data
    order = dict(num_workers=d.num_workers, dataloader_type=d.dataloader_type, data_sharding=d.data_sharding)
    train = build_pretraining_data_loader(
        train_ds, consumed_samples, t.micro_batch_size, pg.dp_rank, pg.dp_size, **order
    )
    train = _own_generator(train, t.seed)
    valid = None
    if valid_ds is not None and valid_samples:
        valid = build_pretraining_data_loader(valid_ds, 0, t.micro_batch_size, pg.dp_rank, pg.dp_size, **order)
        valid = repeat(_own_generator(valid, t.seed + 1))
    # cyclic: each pass over the loader is the next epoch (Megatron's cyclic iterator)
    return (repeat(train) if d.dataloader_type == "cyclic" else iter(train)), valid
