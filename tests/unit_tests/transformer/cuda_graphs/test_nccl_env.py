"""NCCL_GRAPH_REGISTER handling for graphs that capture collectives (environment only)."""

import os

import pytest

from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.nccl_env import configure_nccl_for_graphs, expandable_segments_on
from megatron.training import training
from megatron.training.arguments import parse_args

GRAPHS = CudaGraphConfig(cuda_graph_impl="local")


@pytest.mark.parametrize("impl", ["local", "transformer_engine", "full_iteration"])
def test_tp_with_graphs_turns_graph_registration_off_once(impl):
    env = {}
    graphs = CudaGraphConfig(cuda_graph_impl=impl)
    line = configure_nccl_for_graphs(graphs, tensor_parallel=2, environ=env)
    assert env == {"NCCL_GRAPH_REGISTER": "0"}
    assert "NCCL_GRAPH_REGISTER=0" in line and "--tensor-model-parallel-size 2" in line
    # Set now: a second call (another build in the same process) changes and says nothing.
    assert configure_nccl_for_graphs(graphs, tensor_parallel=2, environ=env) is None
    assert env == {"NCCL_GRAPH_REGISTER": "0"}


@pytest.mark.parametrize("sizes", [{"expert_parallel": 2}, {"expert_tensor_parallel": 2}])
def test_expert_collectives_count_as_captured(sizes):
    env = {}
    assert configure_nccl_for_graphs(GRAPHS, environ=env, **sizes) is not None
    assert env["NCCL_GRAPH_REGISTER"] == "0"


@pytest.mark.parametrize(
    "config,sizes,env",
    [
        (CudaGraphConfig(), {"tensor_parallel": 2}, {}),  # graphs off
        (GRAPHS, {}, {}),  # nothing captured (TP 1)
        (CudaGraphConfig(cuda_graph_impl="local", cuda_graph_expandable_segments=False), {"tensor_parallel": 2}, {}),
        (GRAPHS, {"tensor_parallel": 2}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
        (GRAPHS, {"tensor_parallel": 2}, {"NCCL_GRAPH_REGISTER": "0"}),  # already safe
    ],
    ids=["graphs off", "tp1", "--no-cuda-graph-expandable-segments", "alloc conf off", "already 0"],
)
def test_safe_or_unrelated_runs_are_left_alone(config, sizes, env):
    before = dict(env)
    assert configure_nccl_for_graphs(config, environ=env, **sizes) is None
    assert env == before


def test_alloc_conf_turning_expandable_segments_on_wins_over_the_flag():
    off = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_expandable_segments=False)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}
    assert expandable_segments_on(off, env)
    configure_nccl_for_graphs(off, tensor_parallel=4, environ=env)
    assert env["NCCL_GRAPH_REGISTER"] == "0"
    assert expandable_segments_on(off, {"PYTORCH_ALLOC_CONF": "expandable_segments:true"})
    assert not expandable_segments_on(off, {})


@pytest.mark.parametrize("value", ["1", "2"])
def test_explicit_graph_registration_is_refused(value):
    env = {"NCCL_GRAPH_REGISTER": value, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(ValueError, match=rf"NCCL_GRAPH_REGISTER={value}.*--tensor-model-parallel-size 2.*set it to 0"):
        configure_nccl_for_graphs(GRAPHS, tensor_parallel=2, environ=env)
    assert env["NCCL_GRAPH_REGISTER"] == value
    # Without expandable segments the user's registration is theirs to keep.
    env = {"NCCL_GRAPH_REGISTER": value}
    off = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_expandable_segments=False)
    assert configure_nccl_for_graphs(off, tensor_parallel=2, environ=env) is None


def test_trainer_hook_reads_the_parsed_flags(monkeypatch, capsys):
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "")  # so that teardown restores the variable ...
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")  # ... that the hook sets
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    flags = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 64 --cuda-graph-impl local --tensor-model-parallel-size 2"
    )
    cfg = parse_args(flags.split())
    training._configure_nccl_for_graphs(cfg)
    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"
    assert capsys.readouterr().out.count("NCCL_GRAPH_REGISTER=0") == 1
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    with pytest.raises(ValueError, match="NCCL_GRAPH_REGISTER=1"):
        training._configure_nccl_for_graphs(cfg)
