"""Layout-free keys and chunks (training/sharded_state.py), without processes: fake groups."""

import random
import types

import pytest
import torch

from megatron.core.tensor_parallel.layers import shard_of
from megatron.training import sharded_state


def _pg(tp_size=1, tp_rank=0, dp_rank=0):
    return types.SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank, dp_rank=dp_rank)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_range_boxes_cover_the_range_once(shape):
    rng = random.Random(0)
    numel = torch.Size(shape).numel()
    for _ in range(40):
        start = rng.randrange(numel)
        end = rng.randrange(start + 1, numel + 1)
        marks = torch.zeros(shape, dtype=torch.int64)
        boxes = list(sharded_state.flat_range_boxes(shape, start, end))
        assert len(boxes) <= 2 * len(shape) - 1
        for offsets, sizes in boxes:
            marks[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
        expected = torch.zeros(numel, dtype=torch.int64)
        expected[start:end] = 1
        assert torch.equal(marks.reshape(-1), expected), (start, end, boxes)


def _split_param(full, dim, tp, rank, stride=1, sizes=None):
    if sizes is None:
        local = shard_of(full, dim, tp, rank, stride)
    else:  # blocks of unequal sizes (Mamba's in_proj: z, x, B, C, dt)
        blocks = torch.split(full, [s * tp for s in sizes], dim=dim)
        local = torch.cat([b.narrow(dim, rank * s, s) for b, s in zip(blocks, sizes)], dim=dim)
    param = torch.nn.Parameter(local.clone())
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride
    if sizes is not None:
        param.partition_sizes = sizes
    return param


@pytest.mark.parametrize(
    "shape, dim, stride, sizes",
    [
        ((12, 6), 0, 1, None),
        ((12, 6), 0, 2, None),
        ((6, 8), 1, 1, None),
        ((10, 3), 0, 1, [1, 2, 2]),
        ((8,), 0, 2, None),
    ],
    ids=["column", "swiglu_stride2", "row", "partition_sizes", "bias_stride2"],
)
def test_dp_pieces_of_tp_shards_are_rectangles_of_the_full_tensor(shape, dim, stride, sizes):
    tp, dp = 2, 3
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    marks = torch.zeros(shape, dtype=torch.int64)
    for tp_rank in range(tp):
        param = _split_param(full, dim, tp, tp_rank, stride, sizes)
        layout = sharded_state._layout("w", param, _pg(tp, tp_rank), {}, "w")
        assert layout.full_shape == shape and layout.replica_owner
        numel = param.numel()
        cuts = sorted(random.Random(tp_rank).sample(range(1, numel), dp - 1))
        state = param.detach().reshape(-1).clone()  # a moment laid out like the shard
        for start, end in zip([0, *cuts], [*cuts, numel]):
            piece = state[start:end]
            for chunk in sharded_state.chunks_of(layout, piece, start):
                region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                assert torch.equal(chunk.view, full[region])
                marks[region] += 1
                chunk.view.mul_(-1)  # views alias the piece: loading writes in place
        assert torch.equal(state, -param.detach().reshape(-1))
    assert torch.equal(marks, torch.ones_like(marks))


def test_replicated_tensors_have_one_writer_per_tp_group():
    norm = torch.nn.Parameter(torch.ones(4))
    owners = [sharded_state._layout("n", norm, _pg(2, r), {}, "n").replica_owner for r in range(2)]
    assert owners == [True, False]


class _Layer(torch.nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.linear = torch.nn.Linear(2, 2)


class _Stage(torch.nn.Module):
    """A later pipeline stage: layers 3 and 4 (global numbers), the tied output weight's copy."""

    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(3), _Layer(4)])
        self.output_layer = torch.nn.Module()
        self.output_layer.weight = torch.nn.Parameter(torch.zeros(5, 2))
        self.output_layer.weight.shared_embedding = True


def test_layers_are_keyed_by_global_layer_number_and_the_tied_copy_by_the_embedding():
    layouts = sharded_state.model_layouts(_Stage(), _pg())
    assert set(layouts) == {
        "decoder.layers.2.linear.weight",
        "decoder.layers.2.linear.bias",
        "decoder.layers.3.linear.weight",
        "decoder.layers.3.linear.bias",
        sharded_state.TIED_EMBEDDING,
    }
    assert not layouts[sharded_state.TIED_EMBEDDING][1].replica_owner  # the first stage writes it
    entries = {e.key: e for e in sharded_state.model_entries(_Stage(), _pg())}
    assert entries["model.decoder.layers.3.linear.weight"].write
    assert not entries["model." + sharded_state.TIED_EMBEDDING].write
    # Virtual-pipeline chunks: a list of modules gives one name space.
    assert "decoder.layers.2.linear.weight" in sharded_state.model_layouts([_Stage()], _pg())
