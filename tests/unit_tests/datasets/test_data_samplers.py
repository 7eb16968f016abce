"""Megatron pretraining sampler order across data-parallel ranks, and the data loader."""

import numpy as np
import pytest
import torch

from megatron.core.datasets.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader


def batches(total, consumed, mbs, rank, size, drop_last=True):
    return list(MegatronPretrainingSampler(total, consumed, mbs, rank, size, drop_last=drop_last))


def test_single_rank_is_consecutive():
    assert batches(10, 0, 3, 0, 1) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batches(10, 4, 3, 0, 1) == [[4, 5, 6], [7, 8, 9]]
    assert batches(10, 0, 3, 0, 1, drop_last=False)[-1] == [9]
    assert len(MegatronPretrainingSampler(10, 0, 3, 0, 1)) == 3


def test_ranks_split_each_global_step_in_megatron_order():
    total, mbs = 23, 2
    rank0, rank1 = batches(total, 1, mbs, 0, 2), batches(total, 1, mbs, 1, 2)
    assert rank0[:2] == [[1, 2], [5, 6]] and rank1[:2] == [[3, 4], [7, 8]]
    single = batches(total, 1, 2 * mbs, 0, 1)
    # Step k of dp=1 with batch mbs*dp holds exactly rank 0's then rank 1's micro-batch of step k.
    assert [a + b for a, b in zip(rank0, rank1)] == single
    assert len(rank0) == len(rank1) == len(MegatronPretrainingSampler(total, 1, mbs, 1, 2)) == 5


def test_partial_last_step_without_drop_last():
    assert batches(11, 0, 2, 0, 2, drop_last=False)[-1] == [8, 9]
    assert batches(11, 0, 2, 1, 2, drop_last=False)[-1] == [10]
    assert len(MegatronPretrainingSampler(9, 0, 2, 1, 2, drop_last=False)) == 2  # rank 1 has nothing left


def test_invalid_arguments():
    with pytest.raises(ValueError, match="consumed samples"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="rank 2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i, i * i]), "loss_mask": torch.ones(2)}


@pytest.mark.parametrize("workers", [0, 1])
def test_data_loader_batches(workers):
    loader = build_pretraining_data_loader(Squares(), 4, 3, 1, 2, num_workers=workers)
    first = next(iter(loader))
    assert first["tokens"].tolist() == [[7, 49], [8, 64], [9, 81]]
    assert len(list(loader)) == 2  # (20 - 4) // 6 global steps
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None


def test_worker_batches_travel_as_numpy_and_arrive_as_tensors():
    from megatron.core.datasets.data_samplers import collate_to_numpy

    sent = collate_to_numpy([Squares()[2], Squares()[3]])
    assert isinstance(sent["tokens"], np.ndarray) and sent["tokens"].tolist() == [[2, 4], [3, 9]]
    assert collate_to_numpy([torch.ones(2), torch.zeros(2)]).tolist() == [[1, 1], [0, 0]]  # not a dict: tensors
    loader = build_pretraining_data_loader(Squares(), 0, 2, 0, 1, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 10
    assert all(isinstance(v, torch.Tensor) for b in batches for v in b.values())
    assert batches[1]["tokens"].tolist() == [[2, 4], [3, 9]] and batches[1]["loss_mask"].dtype == torch.float32


def _epoch(sampler):
    return [i for batch in sampler for i in batch]


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_sampler_is_megatrons_epoch_order(sharding):
    from megatron.core.datasets.data_samplers import MegatronPretrainingRandomSampler

    total, mbs, dp = 50, 2, 3  # 48 samples in whole global steps of 6
    ranks = [MegatronPretrainingRandomSampler(total, 0, mbs, r, dp, data_sharding=sharding) for r in range(dp)]
    epochs = [[_epoch(s) for s in ranks] for _ in range(2)]  # each pass is the next epoch
    for e, drawn in enumerate(epochs):
        g = torch.Generator().manual_seed(e)
        if sharding:  # rank r walks a permutation of its own bucket of 16 = 50 // 6 * 2
            for r, mine in enumerate(drawn):
                assert mine == [16 * r + i for i in torch.randperm(16, generator=g.manual_seed(e)).tolist()]
        else:  # one permutation of the 50 samples' 25 whole micro-batches' worth, dealt out in turn
            order = torch.randperm(50, generator=g).tolist()
            assert [i for r in range(dp) for i in drawn[r]] == [i for r in range(dp) for i in order[r::dp][:16]]
        assert len({i for mine in drawn for i in mine}) == 48  # no sample twice in an epoch
    assert epochs[0] != epochs[1]
    assert all(s.consumed_samples == 2 * 48 for s in ranks)


def test_cyclic_sampler_resumes_mid_epoch():
    from megatron.core.datasets.data_samplers import MegatronPretrainingRandomSampler

    whole = _epoch(MegatronPretrainingRandomSampler(40, 0, 2, 1, 2))
    later = _epoch(MegatronPretrainingRandomSampler(40, 40 + 12, 2, 1, 2))  # epoch 1, three steps in
    epoch1 = _epoch(MegatronPretrainingRandomSampler(40, 40, 2, 1, 2))
    assert later == epoch1[6:] and epoch1 != whole


def test_cyclic_training_runs_epochs():
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    argv = (
        "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 2 --train-iters 6 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 64 --num-workers 0 --log-interval 1 --dataloader-type cyclic"
    ).split()
    trainer = build_trainer(argv)
    parallel_state.destroy(trainer.pg)
    history = trainer.train()
    trainer.close()
    assert len(history) == 6 and all(np.isfinite(r["lm loss"]) for r in history)
