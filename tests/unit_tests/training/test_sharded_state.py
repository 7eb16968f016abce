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


# ---------------------------------------------------------------------- whole models, per stage

GPT = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 63 --seed 7"
)
HYBRID = (
    "--hidden-size 32 --num-attention-heads 4 --mamba-state-dim 8 --mamba-head-dim 8 --mamba-num-groups 2 "
    "--position-embedding-type none --normalization RMSNorm --disable-bias-linear --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --mock-data --vocab-size 64 "
    "--tokenizer-type NullTokenizer --seed 7"
)


def _stage_entries(flags: str, pp: int) -> dict[str, list]:
    """Every stage's model entries (fake groups: building needs no collectives):
    ``{key: [(pp rank, writes, first chunk's tensor), ...]}``."""
    from megatron.core.models.gpt.gpt_model import build_gpt_model, build_gpt_stage_chunks
    from megatron.core.models.hybrid.hybrid_model import build_hybrid_model, build_hybrid_stage_chunks
    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.pipeline_parallel import layout
    from megatron.training.arguments import parse_args

    out: dict[str, list] = {}
    for rank in range(pp):
        cfg = parse_args((flags + (f" --pipeline-model-parallel-size {pp}" if pp > 1 else "")).split())
        cfg = cfg.resolve(world_size=pp)
        cfg.validate()
        pg = ProcessGroups(rank=rank, world_size=pp, device=torch.device("cpu"), ranks={"pp": list(range(pp))})
        vocab = 64  # a padded vocabulary size
        torch.manual_seed(7)
        if cfg.mamba.hybrid_layer_pattern is not None:
            model = (
                build_hybrid_model(cfg.model, cfg.mamba, vocab, pg=pg)
                if pp == 1
                else build_hybrid_stage_chunks(cfg.model, cfg.mamba, vocab, pg)
            )
        elif pp == 1:
            model = build_gpt_model(cfg.model, vocab, pg=pg)
        else:
            chunks = layout.chunk_layers(cfg.parallel, cfg.model.num_layers, rank)
            model = build_gpt_stage_chunks(cfg.model, vocab, pg, chunks)
        for e in sharded_state.model_entries(model, pg):
            out.setdefault(e.key, []).append((rank, e.write, e.chunks[0].view.detach().clone()))
    return out


@pytest.mark.parametrize(
    "one_process, staged",
    [
        (GPT, GPT + " --num-layers-per-virtual-pipeline-stage 1"),
        (GPT, GPT + " --decoder-first-pipeline-num-layers 1"),
        (GPT + " --untie-embeddings-and-output-weights", GPT + " --untie-embeddings-and-output-weights"),
        (HYBRID + " --hybrid-layer-pattern M*M-", HYBRID + " --hybrid-layer-pattern M*|M-"),
        (HYBRID + " --hybrid-layer-pattern M*M-M*M-", HYBRID + " --hybrid-layer-pattern M*|M-|M*|M-"),
    ],
    ids=["vpp2", "uneven", "untied", "hybrid_stages", "hybrid_vpp2"],
)
def test_pipeline_stages_together_hold_the_one_process_keys_each_written_once(one_process, staged):
    one, stages = _stage_entries(one_process, 1), _stage_entries(staged, 2)
    assert sorted(stages) == sorted(one)
    for key, held in stages.items():
        writers = [tensor for _, write, tensor in held if write]
        assert len(writers) == 1, f"{key}: written by {len(writers)} stages"
        assert torch.equal(writers[0], one[key][0][2]), key  # layout-free initialisation: the same values
    tied = stages.get("model." + sharded_state.TIED_EMBEDDING)
    assert [rank for rank, *_ in tied] == ([0, 1] if "untie" not in staged else [0])
