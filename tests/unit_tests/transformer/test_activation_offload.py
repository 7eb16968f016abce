"""--fine-grained-activation-offloading / --offload-modules: saved tensors go to host memory and back."""

import pytest
import torch

from megatron.core.transformer import offload
from megatron.core.transformer.offload import ActivationOffloader
from megatron.training.arguments import parse_args

BASE = (
    "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
    "--tokenizer-type NullTokenizer --vocab-size 64 --lr 1e-3 --log-interval 1"
).split()
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-grouped-gemm".split()
ALL = "attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act".split()


def test_round_trip_keeps_values_strides_and_skips_parameters_and_small_tensors():
    """fp64 on the CPU (host tensors copied for the test): the loss and gradients are bitwise the
    plain run's; the linear's input went to the host, its weight and the tiny bias did not."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 3, dtype=torch.float64)
    x = torch.randn(8, 5, dtype=torch.float64).t().requires_grad_()  # a transposed (strided) input
    ref = lin(x.exp()).sin().sum()
    ref_grads = torch.autograd.grad(ref, [x, lin.weight, lin.bias])
    off = ActivationOffloader(["qkv_linear"], min_bytes=5 * 8 * 8, include_host_tensors=True)
    h = x.exp()
    with off.scope("qkv_linear"):
        y = lin(h)
    with off.scope("not_named"):
        loss = y.sin().sum()
    assert off.offloaded_bytes == 5 * 8 * 8  # the linear's input only (the weight is a parameter)
    grads = torch.autograd.grad(loss, [x, lin.weight, lin.bias])
    assert torch.equal(loss, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    with torch.no_grad(), off.scope("qkv_linear"):
        lin(h)
    assert off.offloaded_bytes == 5 * 8 * 8  # nothing saved without autograd


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_offloading_trains_like_without(model, tmp_path, monkeypatch):
    """Through the trainer on the CPU, host tensors copied too: losses, gradient norms and final weights
    bitwise equal; tensors did go to the host."""
    from megatron.training.training import pretrain

    offloaded = []
    original = ActivationOffloader._pack

    def counting(self, tensor):
        saved = original(self, tensor)
        if saved is not tensor:
            offloaded.append(tensor.numel())
        return saved

    monkeypatch.setattr(ActivationOffloader, "include_host_tensors", True)
    monkeypatch.setattr(ActivationOffloader, "_pack", counting)
    argv = BASE + [f"--data-cache-path={tmp_path}"] + (MOE if model == "moe" else [])
    modules = ALL if model == "moe" else ALL[:5]
    flags = ["--fine-grained-activation-offloading", "--offload-modules", *modules, "--min-offloaded-tensor-size", "0"]
    runs = [pretrain(argv), pretrain(argv + flags)]
    assert offloaded
    for key in ("lm loss", "grad-norm"):
        values = [[r[key] for r in run.history] for run in runs]
        assert len(values[0]) == 3 and values[0] == values[1], key
    for (name, a), (_, b) in zip(*(run.model.module.named_parameters() for run in runs)):
        assert torch.equal(a, b), name


def test_offloader_is_off_without_the_switch():
    args = parse_args(BASE + ["--offload-modules", "core_attn"]).resolve()
    args.validate()
    assert offload.offloader_for(args.model).modules == frozenset()
    on = parse_args(BASE + ["--fine-grained-activation-offloading", "--offload-modules", "core_attn"]).resolve()
    on.validate()
    assert offload.offloader_for(on.model).modules == {"core_attn"}
    assert on.model.min_offloaded_tensor_size == 1024 * 1024


@pytest.mark.parametrize(
    "extra,match",
    [
        ([], "needs --offload-modules"),
        (["--offload-modules", "attn_proj"], "attn_proj needs core_attn"),
        (["--offload-modules", "bogus"], "invalid choice 'bogus'"),
        (["--offload-modules", "fused_group_mlp"], "op fuser"),
        (["--offload-modules", "gdp_qkv"], "GatedDeltaProduct"),
        (["--offload-modules", "moe_act", "--num-experts", "4"], "needs --moe-grouped-gemm"),
        (["--offload-modules", "moe_act", *MOE, "--recompute-granularity", "selective", "--recompute-modules", "moe"],
         "drop moe from --recompute-modules"),
        (["--offload-modules", "core_attn", "--cuda-graph-impl", "local"], "--cuda-graph-impl local is not supported"),
    ],
)  # fmt: skip
def test_mistakes_name_the_flag(extra, match):
    with pytest.raises(ValueError, match=match):
        args = parse_args(BASE + ["--fine-grained-activation-offloading", *extra]).resolve()
        args.validate()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_offloading_on_cuda_is_bitwise_and_uses_pinned_host_memory(model, tmp_path, monkeypatch):
    """On a GPU (fp32, deterministic): tensors go to pinned host memory; losses and gradient norms
    bitwise equal to the run without offloading."""
    from megatron.training.training import pretrain

    hosts = []
    original = ActivationOffloader._pack

    def watching(self, tensor):
        saved = original(self, tensor)
        if saved is not tensor:
            hosts.append((saved.host.device.type, saved.host.is_pinned(), tensor.device.type))
        return saved

    monkeypatch.setattr(ActivationOffloader, "_pack", watching)
    argv = BASE + [f"--data-cache-path={tmp_path}", "--deterministic-mode", "--hidden-dropout", "0.0"]
    argv += MOE if model == "moe" else []
    modules = ALL if model == "moe" else ALL[:5]
    flags = ["--fine-grained-activation-offloading", "--offload-modules", *modules, "--min-offloaded-tensor-size", "0"]
    runs = [pretrain(argv), pretrain(argv + flags)]
    assert hosts and all(h == ("cpu", True, "cuda") for h in hosts)
    for key in ("lm loss", "grad-norm"):
        assert [r[key] for r in runs[0].history] == [r[key] for r in runs[1].history], key
