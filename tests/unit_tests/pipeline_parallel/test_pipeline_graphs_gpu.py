"""CUDA graphs under the real pipeline schedules, over NCCL on two GPUs (``pytest -m gpu``).

Two processes (one GPU each) train the same model eagerly and with ``--cuda-graph-impl
local`` (whole layers, and ``attn mlp``), as PP=2 1F1B, as PP=2 with two virtual
stages per rank and as a ``--pipeline-model-parallel-layout`` with chunks of no layers.
Losses are compared bitwise over a few iterations (deterministic mode, dropout 0: the
same kernels run eagerly and in the graphs, and the first iteration records eagerly).
Each rank's graph count is printed (``pytest -s``) and checked against 2 (forward,
backward) x regions x micro-batches in flight of its order; the post-capture line and
the memory line name the rank's pipeline stage.
Skipped unless two CUDA devices are visible.
"""

import contextlib
import io
import json
import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
    "--micro-batch-size 2 --global-batch-size 16"  # 8 micro-batches per iteration (issue 17)
)
COMMON = (
    "--lr 1e-4 --lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer --vocab-size 32000 "
    "--mock-data --log-interval 1000000 --num-workers 0 --deterministic-mode "
    "--attention-dropout 0.0 --hidden-dropout 0.0"
)
MICROBATCHES = 8
ITERATIONS = 4  # one recording, then captured replays
LAYOUTS = {
    "pp2": "--pipeline-model-parallel-size 2",
    "pp2_vpp2": "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
    # Three virtual stages per rank, some without layers (rank 0: embedding, nothing, layer 4).
    "pp2_layout_empty_stages": "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|tt||t|t|L",
}
SCOPES = {"eager": None, "layer": "", "attn mlp": "attn mlp"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, port: int, argv: list[str], out_dir: str) -> None:
    """One rank: trains ``ITERATIONS`` iterations; writes losses and graph counts as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ["LOCAL_RANK"] = str(rank)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import model_chunks
    from megatron.training.data import build_data_iterators
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)  # NCCL: the trainer initialises the process group
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses = [trainer.train_step(it)[0].item() for _ in range(ITERATIONS)]
        torch.cuda.synchronize()
        graphs = trainer.graphs
        chunk_regions = []
        for chunk in model_chunks(trainer.model.module):
            modules = {id(m) for m in chunk.modules()}
            chunk_regions.append(sum(id(r.module) in modules for r in graphs.regions))
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # the post-capture line and the memory line
            trainer._log_capture()
            trainer._log_memory()
        result = {
            "log": log.getvalue(),
            "losses": losses,
            "captured": graphs.captured,
            "graphs": graphs.num_graphs(),
            "chunk_regions": chunk_regions,
            "summary": graphs.summary_line(stage=(trainer.pg.pp_rank, trainer.pg.pp_size)) if graphs.captured else "",
        }
    finally:
        parallel_state.destroy(trainer.pg)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _run(layout: str, scope: str | None, tmp_path) -> list[dict]:
    """Per-rank results of a two-process run (a rank that raises fails the test)."""
    import torch.multiprocessing as mp

    graphs = "" if scope is None else f" --cuda-graph-impl local --cuda-graph-scope {scope}".rstrip()
    argv = f"{MODEL} {COMMON} {LAYOUTS[layout]} --train-iters {ITERATIONS}{graphs}".split()
    out_dir = tmp_path / f"{layout}_{scope}".replace(" ", "_")
    out_dir.mkdir()
    mp.spawn(_rank_main, args=(_free_port(), argv, str(out_dir)), nprocs=2, join=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelined_graphs_equal_eager_bitwise(layout, tmp_path):
    from megatron.core.pipeline_parallel import schedules, simulate

    eager = _run(layout, None, tmp_path)
    assert eager[0]["losses"] == eager[1]["losses"]  # the last stage's loss, broadcast to every stage
    for scope in ("layer", "attn mlp"):
        graphed = _run(layout, SCOPES[scope], tmp_path)
        for rank, (e, g) in enumerate(zip(eager, graphed)):
            assert g["captured"], f"{layout} {scope} rank {rank}: no graphs captured"
            assert g["losses"] == e["losses"], (
                f"{layout} {scope} rank {rank}: graphed losses {g['losses']} differ from eager {e['losses']}"
            )
            chunks = len(g["chunk_regions"])
            order = schedules.rank_order(MICROBATCHES, 2, rank, chunks)
            bound = 2 * sum(g["chunk_regions"]) * simulate.max_in_flight(order)  # regions x in flight
            print(
                f"{layout} scope {scope!r} pipeline rank {rank}: {g['graphs']} graphs (bound {bound}); {g['summary']}"
            )
            assert 0 < g["graphs"] <= bound
            assert g["summary"].startswith(f"graph pool | pipeline rank: {rank} of 2 |")
            capture_line, memory_line = g["log"].splitlines()
            assert capture_line == f"> {g['summary']}"
            assert f"| graphs: {g['graphs']} |" in memory_line and memory_line.endswith(f"| pipeline rank: {rank}")
