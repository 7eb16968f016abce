"""Which layers each pipeline stage holds, and the flag errors of pipeline layouts."""

import pytest

from megatron.core.parallel_config import ParallelConfig
from megatron.core.pipeline_parallel import layout
from tests.conftest import run_config


def _parallel(world=2, **kw):
    cfg = ParallelConfig(world_size=world, **kw).resolve()
    cfg.validate()
    return cfg


def test_even_split_and_virtual_stages_in_megatron_order():
    cfg = _parallel(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2)
    assert layout.stage_layer_counts(cfg, 8) == [2, 2, 2, 2]
    # Chunk c of rank r is virtual stage c * PP + r.
    assert layout.chunk_layers(cfg, 8, 0) == [(0, 2), (4, 2)]
    assert layout.chunk_layers(cfg, 8, 1) == [(2, 2), (6, 2)]


def test_layers_per_virtual_stage_spelling_gives_the_same_chunks():
    cfg = _parallel(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    assert layout.resolve_virtual_stages(cfg, 4) == 2 and cfg.virtual_pipeline_model_parallel_size == 2
    assert layout.chunk_layers(cfg, 4, 1) == [(1, 1), (3, 1)]


def test_uneven_first_and_last_stages_split_the_rest_evenly():
    cfg = _parallel(4, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1)
    assert layout.rank_layer_counts(cfg, 7) == [1, 2, 2, 2]
    cfg = _parallel(4, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
                    decoder_last_pipeline_num_layers=1)  # fmt: skip
    assert layout.rank_layer_counts(cfg, 9) == [2, 3, 3, 1]
    assert [off for off, _ in (layout.chunk_layers(cfg, 9, r)[0] for r in range(4))] == [0, 2, 5, 8]
    cfg = _parallel(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=1)
    assert layout.rank_layer_counts(cfg, 4) == [3, 1]
    cfg = _parallel(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2,
                    num_virtual_stages_per_pipeline_rank=2)  # fmt: skip
    assert layout.stage_layer_counts(cfg, 6) == [1, 2, 1, 2]


@pytest.mark.parametrize(
    "sizes, num_layers, counts",
    [
        (dict(account_for_embedding_in_pipeline_split=True), 3, [1, 2]),
        (dict(account_for_loss_in_pipeline_split=True), 3, [2, 1]),
        (dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), 4, [2, 2]),
        (dict(account_for_embedding_in_pipeline_split=True), 1, [0, 1]),  # Megatron allows a stage of none
        (dict(account_for_embedding_in_pipeline_split=True, num_virtual_stages_per_pipeline_rank=2), 7, [1, 2, 2, 2]),
        (dict(account_for_loss_in_pipeline_split=True, num_layers_per_virtual_pipeline_stage=2), 7, [2, 2, 2, 1]),
    ],
)
def test_embedding_and_loss_count_as_layers_of_the_split(sizes, num_layers, counts):
    cfg = _parallel(pipeline_model_parallel_size=2, **sizes)
    layout.resolve_virtual_stages(cfg, num_layers)
    assert layout.stage_layer_counts(cfg, num_layers) == counts
    chunks = [c for r in range(2) for c in layout.chunk_layers(cfg, num_layers, r)]
    assert sorted(chunks) == sorted(zip([sum(counts[:i]) for i in range(len(counts))], counts))


def test_accounted_split_errors_name_the_flags():
    cfg = _parallel(pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True)
    with pytest.raises(ValueError, match=r"--account-for-embedding-in-pipeline-split, --num-layers \(4\) \+ 1"):
        layout.stage_layer_counts(cfg, 4)
    cfg = _parallel(pipeline_model_parallel_size=2, account_for_loss_in_pipeline_split=True,
                    decoder_first_pipeline_num_layers=1)  # fmt: skip
    with pytest.raises(ValueError, match="--account-for-loss-in-pipeline-split cannot be combined"):
        layout.stage_layer_counts(cfg, 4)


@pytest.mark.parametrize(
    "world, sizes, num_layers, needle",
    [
        (2, dict(pipeline_model_parallel_size=2), 3, "--num-layers (3) must be divisible by --pipeline-model"),
        (
            2,
            dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
            6,
            "x virtual pipeline stages per rank (2, --num-virtual-stages-per-pipeline-rank)",
        ),
        (
            4,
            dict(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2),
            7,
            "the 5 remaining layers of --num-layers (7) must split evenly over the other 3",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=2
            ),  # fmt: skip
            4,
            "must add up to --num-layers (4)",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=3,
                num_virtual_stages_per_pipeline_rank=2,
            ),  # fmt: skip
            6,
            "pipeline stage 0 holds 3 layers, which do not split over 2 virtual stages",
        ),
        (
            2,
            dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
            4,
            "--num-layers (4) must be divisible by --num-layers-per-virtual-pipeline-stage (3) x",
        ),
    ],
)
def test_layer_counts_that_do_not_split_name_the_flags(world, sizes, num_layers, needle):
    cfg = _parallel(world, **sizes)
    with pytest.raises(ValueError) as info:
        layout.virtual_stages_from_layers(cfg, num_layers)
        layout.stage_layer_counts(cfg, num_layers)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "world, sizes, needle",
    [
        (2, dict(num_virtual_stages_per_pipeline_rank=2), "virtual pipeline stages need --pipeline-model-parallel"),
        (2, dict(num_layers_per_virtual_pipeline_stage=1), "drop --num-layers-per-virtual-pipeline-stage"),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_virtual_stages_per_pipeline_rank=2,
                num_layers_per_virtual_pipeline_stage=1,
            ),  # fmt: skip
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both",
        ),
        (
            2,
            dict(
                pipeline_model_parallel_size=2,
                num_virtual_stages_per_pipeline_rank=2,
                virtual_pipeline_model_parallel_size=3,
            ),  # fmt: skip
            "disagree",
        ),
        (2, dict(decoder_first_pipeline_num_layers=1), "--decoder-first-pipeline-num-layers needs --pipeline"),
        (6, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), "world size 6 is not divisible"),
        (
            4,
            dict(pipeline_model_parallel_size=2, microbatch_group_size_per_virtual_pipeline_stage=1),
            "--microbatch-group-size-per-virtual-pipeline-stage (1) must be at least",
        ),
    ],
)
def test_bad_pipeline_layouts_name_the_flags(world, sizes, needle):
    with pytest.raises(ValueError) as info:
        _parallel(world, **sizes)
    assert needle in str(info.value)


def _run_config(extra: str):
    return run_config(extra, world_size=2)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", "must be divisible by"),
    ],
)
def test_run_config_refuses_what_pipelines_do_not_combine_with(extra, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _run_config(extra).validate()


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_pipelines_save_in_both_checkpoint_formats(ckpt_format):
    _run_config(f"--pipeline-model-parallel-size 2 --save /tmp/x --load /tmp/x --ckpt-format {ckpt_format}").validate()


@pytest.mark.parametrize(
    "extra",
    [
        "--pipeline-model-parallel-size 2",
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --cuda-graph-scope attn mlp",
    ],
)
def test_run_config_accepts_cuda_graphs_with_pipelines(extra):
    cfg = _run_config(f"{extra} --cuda-graph-impl local")
    cfg.validate()
    assert cfg.cuda_graph.enabled and cfg.parallel.pipeline_model_parallel_size == 2


def test_run_config_takes_selective_recompute_with_cuda_graphs_under_pipelines_but_not_full():
    base = "--pipeline-model-parallel-size 2 --cuda-graph-impl local --recompute-granularity"
    _run_config(f"{base} selective --recompute-modules core_attn mlp layernorm --attention-dropout 0").validate()
    cfg = _run_config(f"{base} full --recompute-method uniform --recompute-num-layers 1")
    with pytest.raises(ValueError, match="--recompute-granularity full with --cuda-graph-impl local"):
        cfg.validate()


def test_run_config_accepts_pipelines():
    cfg = _run_config("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1")
    cfg.validate()
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
