"""``--cuda-graph-impl full_iteration`` and ``transformer_engine`` on the CPU: flags, refusals,
the eager fallback, and the static-input checks (the graphs themselves: test_full_iteration_gpu.py)."""

import warnings

import pytest
import torch

from megatron.training import full_iteration
from megatron.training.arguments import parse_args
from megatron.training.logging_utils import startup_lines
from megatron.training.training import build_trainer

BASE = ["--mock-data", "--vocab-size", "64"]
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --seed 7 --tokenizer-type NullTokenizer --vocab-size 64 "
    "--mock-data --log-interval 1000 --num-workers 0 --attention-dropout 0 --hidden-dropout 0"
)


def validate(*argv, world: int = 1):
    cfg = parse_args(BASE + [str(a) for a in argv]).resolve(world_size=world)
    cfg.validate()
    return cfg


@pytest.mark.parametrize(
    "argv, world, needle",
    [
        (["--cuda-graph-scope", "attn"], 1, "--cuda-graph-scope attn with --cuda-graph-impl full_iteration"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers", "2"],
            2,
            "full_iteration with --pipeline-model-parallel-size > 1 is not supported yet",
        ),
        (["--num-experts", "4"], 1, "full_iteration with --num-experts is not supported yet"),
        (["--fp16"], 1, "full_iteration with --fp16 is not supported yet"),
    ],
)
def test_full_iteration_refuses_what_a_graph_cannot_hold(argv, world, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate("--cuda-graph-impl", "full_iteration", *argv, world=world)


@pytest.mark.parametrize("impl", ["local", "transformer_engine", "full_iteration"])
def test_activation_offloading_is_refused_with_any_graphs(impl):
    with pytest.raises(ValueError, match=f"--fine-grained-activation-offloading with --cuda-graph-impl {impl} is not"):
        validate("--cuda-graph-impl", impl, "--fine-grained-activation-offloading", "--offload-modules", "core_attn")


def test_full_iteration_turns_the_overlap_hooks_off():
    with pytest.warns(UserWarning) as record:
        cfg = validate(
            "--cuda-graph-impl", "full_iteration", "--overlap-grad-reduce", "--overlap-param-gather",
            "--use-distributed-optimizer",
        )  # fmt: skip
    messages = " ".join(str(w.message) for w in record)
    assert "--overlap-grad-reduce is off with --cuda-graph-impl full_iteration" in messages
    assert "--overlap-param-gather is off with CUDA graphs" in messages
    assert not cfg.ddp.overlap_grad_reduce and not cfg.ddp.overlap_param_gather
    assert cfg.cuda_graph.full_iteration and not cfg.cuda_graph.enabled


def test_transformer_engine_impl_runs_the_local_graphs_and_says_so():
    cfg = validate("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "mlp")
    assert cfg.cuda_graph.enabled and not cfg.cuda_graph.full_iteration
    assert cfg.cuda_graph.cuda_graph_scope == ["attn", "mlp"]
    assert any(
        "--cuda-graph-impl transformer_engine: running this trainer's local" in line for line in startup_lines(cfg)
    )
    assert not any("--cuda-graph-impl" in line for line in startup_lines(validate("--cuda-graph-impl", "local")))


@pytest.mark.parametrize("impl", ["full_iteration", "transformer_engine"])
def test_without_cuda_the_run_is_eager_and_equal(impl, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    eager = build_trainer(f"{TINY} --train-iters 3".split()).train()
    with pytest.warns(UserWarning, match=f"--cuda-graph-impl {impl}: CUDA is not available"):
        trainer = build_trainer(f"{TINY} --train-iters 3 --cuda-graph-impl {impl}".split())
    assert trainer.full_graph is None and not trainer.graphs.active
    graphed = trainer.train()
    assert [r["lm loss"] for r in graphed] == [r["lm loss"] for r in eager]


def test_warmup_iterations_run_eagerly_and_fold_after_the_step():
    """Before its capture the graph object is a pass-through: ``step`` then ``then``, per warm-up iteration."""
    graph = full_iteration.FullIterationGraph(warmup=2, log=lambda line: None)
    calls = []

    def step(next_batch):
        batches = [next_batch(), next_batch()]
        calls.append(("step", [int(b["tokens"][0]) for b in batches]))
        return torch.tensor(1.0), {}

    batches = [{"tokens": torch.tensor([i])} for i in range(2)]
    for _ in range(2):
        loss, metrics = graph.run(step, batches, then=lambda: calls.append(("then",)))
        assert loss.item() == 1.0 and metrics == {}
    assert calls == [("step", [0, 1]), ("then",)] * 2
    assert graph.eager_runs == 2 and graph.num_graphs == 0
    assert full_iteration.FullIterationGraph(warmup=0).warmup == 1  # one eager iteration always runs


def test_static_inputs_keep_their_fields_and_shapes():
    static = [{"tokens": torch.zeros(2, 4, dtype=torch.long)}]
    full_iteration._copy_into(static, [{"tokens": torch.ones(2, 4, dtype=torch.long)}])
    assert static[0]["tokens"].sum().item() == 8
    with pytest.raises(RuntimeError, match=r"tokens of micro-batch 0 is torch.int64 \(2, 5\).*--seq-length"):
        full_iteration._copy_into(static, [{"tokens": torch.ones(2, 5, dtype=torch.long)}])
    with pytest.raises(RuntimeError, match=r"micro-batch 0 has the fields \['labels', 'tokens'\]"):
        full_iteration._copy_into(static, [{"tokens": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(1)}])


def test_graph_outputs_must_be_device_tensors():
    with pytest.raises(RuntimeError, match="not a CUDA tensor"):
        full_iteration._check_outputs(torch.tensor(1.0), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            full_iteration.build(validate("--cuda-graph-impl", "local").cuda_graph, torch.device("cpu"), print) is None
        )


def test_the_memory_line_reads_whichever_graphs_were_captured():
    import types

    from megatron.training.training_log import graph_stats

    full_stats = {"pool_reserved_bytes": 7, "pool_live_bytes": 5, "strong_bytes": 0, "graphs": 2}
    partial = types.SimpleNamespace(captured=True, stats=lambda: {"graphs": 18})
    idle = types.SimpleNamespace(captured=False)
    full = types.SimpleNamespace(num_graphs=2, stats=lambda: full_stats)
    assert graph_stats(types.SimpleNamespace(graphs=partial, full_graph=None)) == {"graphs": 18}
    assert graph_stats(types.SimpleNamespace(graphs=idle, full_graph=full)) == full_stats
    assert graph_stats(types.SimpleNamespace(graphs=idle, full_graph=types.SimpleNamespace(num_graphs=0))) is None
    assert graph_stats(types.SimpleNamespace(graphs=idle)) is None


def test_megatrons_deprecated_full_iteration_scopes_migrate_as_upstream():
    with pytest.warns(UserWarning, match="--cuda-graph-scope full_iteration is deprecated") as record:
        cfg = validate("--cuda-graph-scope", "full_iteration")
    assert cfg.cuda_graph.full_iteration and cfg.cuda_graph.cuda_graph_scope == []
    assert not any("has no effect without" in str(w.message) for w in record)
    with pytest.warns(UserWarning, match="full_iteration_inference is deprecated .* no effect here"):
        cfg = validate("--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration_inference")
    assert cfg.cuda_graph.cuda_graph_impl == "local" and cfg.cuda_graph.cuda_graph_scope == []
    with pytest.raises(ValueError, match="full_iteration cannot be combined with --cuda-graph-impl transformer_engine"):
        validate("--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "full_iteration")
    # With another scope left over, full_iteration's own rule applies (as upstream asserts after migrating).
    with pytest.raises(ValueError, match="--cuda-graph-scope attn with --cuda-graph-impl full_iteration"):
        validate("--cuda-graph-scope", "full_iteration", "attn")
