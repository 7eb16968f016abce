"""--overlap-param-gather: no op reads a parameter before its bucket's all-gather was waited on.

The all-gathers of the distributed optimizer run while the next forward starts; each module's
forward pre-hook waits for the buckets of the parameters it uses. A module that reads weights
its hooks do not cover reads half-gathered parameters, silently and only when the gather is
slow. The sequential experts did (their fused loop reads the experts' weights directly). Here
every bucket stays "in flight" until a hook waits on it, and a dispatch mode records every op that
reads a bucket's memory before that: the race made certain.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import parallel_state
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer

FLAGS = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 3e-3 --seed 1234 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 63 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 "
    "--use-cpu --swiglu --disable-bias-linear --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
)
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24"


class _InFlight:
    """A gather handle that is done once waited on."""

    def __init__(self, bucket, pending: set):
        self.bucket, self.pending = bucket, pending

    def wait(self):
        self.pending.discard(id(self.bucket))


class _EarlyReads(TorchDispatchMode):
    """Records ops whose inputs lie in a bucket whose gather nobody waited on yet."""

    def __init__(self, buckets, pending: set):
        super().__init__()
        self.storage = {b.param_data.untyped_storage().data_ptr(): b for b in buckets}
        self.pending, self.early = pending, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                bucket = self.storage.get(a.untyped_storage().data_ptr())
                if bucket is not None and id(bucket) in self.pending:
                    self.early.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "model",
    [
        "",
        MOE,
        f"{MOE} --moe-grouped-gemm",
        "--untie-embeddings-and-output-weights",
        "--hybrid-layer-pattern M*- --mamba-num-groups 2 --mamba-head-dim 16 --num-layers 3",
    ],
    ids=["dense", "moe_sequential", "moe_grouped", "dense_untied", "hybrid"],
)
def test_every_parameter_read_waits_for_its_gather(model):
    import pretrain_hybrid

    argv = f"{FLAGS} {model}".split()
    trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))  # as pretrain_hybrid.py builds it
    try:
        ddp = trainer.model
        assert ddp.overlap_param_gather and ddp.buckets
        pending = {id(b) for b in ddp.buckets}
        for bucket in ddp.buckets:
            bucket.param_handle = _InFlight(bucket, pending)
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
        with _EarlyReads(ddp.buckets, pending) as watch:
            trainer.train_step(it)
        assert not watch.early, f"read before their parameters' gather was waited on: {sorted(watch.early)}"
        assert not pending, "every bucket's gather is waited on in the forward"
    finally:
        parallel_state.destroy(trainer.pg)
