"""Muon checkpoints: a resumed run continues the uninterrupted one, in both formats (CPU, gloo), with
either scalar optimizer (``--muon-scalar-optimizer adam`` or ``lion``).

One process (bf16, bfloat16 Newton-Schulz): bitwise (the same kernels in the same order).
Two data-parallel ranks with the distributed optimizer (fp32, float32 Newton-Schulz):
bitwise too for the same layout, and the checkpoint resumes in one process without the
flag within 1e-5 relative (the reductions change order).
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 8 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 "
    "--optimizer muon --muon-extra-scale-factor 0.2 --muon-momentum 0.8"
)
FP32 = "--muon-fp32-matmul-prec high"


def _run(argv):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)
    history = trainer.train()
    parallel_state.destroy(trainer.pg)
    return [r["lm loss"] for r in history]


def _runs(rank, world_size, argvs):
    return [_run(argv) for argv in argvs]


def _argv(extra, cache):
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


SCALAR = ["adam", "lion"]


@pytest.mark.parametrize("scalar", SCALAR)
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_one_process_resume_is_bitwise(tmp_path, cache, fmt, scalar):
    bf16 = f"--bf16 --muon-scalar-optimizer {scalar}"
    save = f"{bf16} --ckpt-format {fmt} --save {tmp_path / 'c'}"
    argvs = [_argv(bf16, cache), _argv(f"{save} --exit-interval 4", cache)]
    argvs.append(_argv(f"{bf16} --ckpt-format {fmt} --load {tmp_path / 'c'}", cache))
    full, part, resumed = run_distributed(_runs, 1, argvs, timeout=300)[0]
    assert part == full[:4]
    assert resumed == full[4:]


@pytest.mark.parametrize("scalar", SCALAR)
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_distributed_optimizer_resume_is_bitwise(tmp_path, cache, fmt, scalar):
    fp32 = f"{FP32} --muon-scalar-optimizer {scalar}"
    flags = f"{fp32} --use-distributed-optimizer --ckpt-format {fmt}"
    argvs = [
        _argv(flags, cache),
        _argv(f"{flags} --save {tmp_path / 'c'} --exit-interval 4", cache),
        _argv(f"{flags} --load {tmp_path / 'c'}", cache),
    ]
    for full, part, resumed in run_distributed(_runs, 2, argvs, timeout=400):
        assert part == full[:4]
        assert resumed == full[4:]
    # The checkpoint of two ranks resumes in one process without the distributed optimizer.
    (alone,) = run_distributed(_runs, 1, [_argv(f"{fp32} --ckpt-format {fmt} --load {tmp_path / 'c'}", cache)])[0]
    assert alone == pytest.approx(full[4:], rel=1e-5)


def test_torch_dist_checkpoint_of_tp2_resumes_in_one_process(tmp_path, cache):
    # torch_dist keys the momentum by parameter name: a TP = 2 checkpoint loads whole in one process.
    (full,) = run_distributed(_runs, 1, [_argv(FP32, cache)])[0]
    save = f"{FP32} --ckpt-format torch_dist --save {tmp_path / 'c'} --exit-interval 4 --tensor-model-parallel-size 2"
    run_distributed(_runs, 2, [_argv(save, cache)], timeout=300)
    (resumed,) = run_distributed(_runs, 1, [_argv(f"{FP32} --ckpt-format torch_dist --load {tmp_path / 'c'}", cache)])[
        0
    ]
    assert resumed == pytest.approx(full[4:], rel=1e-5)


def test_torch_dist_checkpoint_of_etp2_with_lion_resumes(tmp_path, cache):
    # Expert weights split over expert TP (their ETP blocks named by partition_dim) and Lion's moments:
    # bitwise at the saving layout, within 1e-5 relative in one process.
    moe = f"{FP32} --muon-scalar-optimizer lion --num-experts 2 --moe-ffn-hidden-size 16 --moe-grouped-gemm --swiglu"
    moe += " --disable-bias-linear --ckpt-format torch_dist"
    etp = f"{moe} --expert-tensor-parallel-size 2"
    argvs = [_argv(etp, cache), _argv(f"{etp} --save {tmp_path / 'c'} --exit-interval 4", cache)]
    argvs.append(_argv(f"{etp} --load {tmp_path / 'c'}", cache))
    for full, part, resumed in run_distributed(_runs, 2, argvs, timeout=400):
        assert part == full[:4]
        assert resumed == full[4:]
    (alone,) = run_distributed(_runs, 1, [_argv(f"{moe} --load {tmp_path / 'c'}", cache)])[0]
    assert alone == pytest.approx(full[4:], rel=1e-5)
