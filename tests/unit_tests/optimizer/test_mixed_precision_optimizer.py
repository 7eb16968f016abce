"""MixedPrecisionOptimizer against plain torch references.

fp32 parity is bitwise: the reference runs the same foreach AdamW/SGD kernels and
``clip_grad_norm_`` does the same arithmetic as our clipping.
"""

import copy
import io

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.optimizer.muon import adamw_kwargs
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.parallel_state import ProcessGroups
from megatron.training.config import DDPConfig, PrecisionConfig


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 5, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _wrap(net):
    return DistributedDataParallel(net, config=DDPConfig(ddp_bucket_size=100), pg=ProcessGroups.single())


def _ref_groups(model, wd):
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _train_step(ddp, opt, x):
    ddp.zero_grad_buffer()
    ddp(x).square().mean().backward()
    ddp.finish_grad_sync()
    return opt.step()


@pytest.mark.parametrize("clip_grad", [0.0, 0.05])
def test_fp32_matches_torch_adamw_trajectory(clip_grad):
    torch.manual_seed(0)
    net = _Net()
    ref = copy.deepcopy(net)
    ddp = _wrap(net)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip_grad, adam_beta2=0.95)
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=config, precision=PrecisionConfig())
    ref_opt = torch.optim.AdamW(_ref_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    clipped_any = False
    for _ in range(5):
        x = torch.randn(8, 6)
        success, grad_norm, num_zeros = _train_step(ddp, opt, x)
        assert success is True and num_zeros is None
        assert isinstance(grad_norm, torch.Tensor) and grad_norm.ndim == 0
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        max_norm = clip_grad if clip_grad > 0 else float("inf")
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        clipped_any |= bool(ref_norm > clip_grad > 0)
        assert torch.equal(grad_norm, ref_norm)
        for p, r in zip(ddp.parameters(), ref.parameters()):
            assert torch.equal(p.main_grad, r.grad)  # clipped in place, like the reference
        ref_opt.step()
        for (name, p), r in zip(ddp.module.named_parameters(), ref.parameters()):
            assert torch.equal(p, r), name
            assert p.grad is None, name  # released so the next backward cannot double-add
    assert clipped_any == (clip_grad > 0)


def test_sgd_and_main_params_are_the_fp32_params():
    torch.manual_seed(0)
    net = _Net()
    ref = copy.deepcopy(net)
    ddp = _wrap(net)
    config = OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.9, weight_decay=0.01, clip_grad=0.0)
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=config, precision=PrecisionConfig())
    assert all(m is p for m, p in zip(opt.main_params, ddp.parameters()))
    ref_opt = torch.optim.SGD(_ref_groups(ref, 0.01), lr=0.1, momentum=0.9, foreach=True)
    for _ in range(3):
        x = torch.randn(4, 6)
        _train_step(ddp, opt, x)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    assert all(torch.equal(p, r) for p, r in zip(ddp.parameters(), ref.parameters()))


def test_bf16_keeps_fp32_masters():
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16)
    ddp = _wrap(net)
    config = OptimizerConfig(lr=1e-4, weight_decay=0.0, clip_grad=1.0)
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=config, precision=PrecisionConfig(bf16=True))
    masters = opt.main_params
    assert all(m.dtype == torch.float32 for m in masters)
    # Reference: the same AdamW on fp32 copies, fed copies of the grads we produce.
    ref_masters = [m.clone() for m in masters]
    ref_opt = torch.optim.AdamW(
        [{"params": [r for r in ref_masters if r.ndim >= 2]}, {"params": [r for r in ref_masters if r.ndim < 2]}],
        lr=1e-4,
        weight_decay=0.0,
        foreach=True,
    )
    for _ in range(3):
        ddp.zero_grad_buffer()
        ddp(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().mean().backward()
        ddp.finish_grad_sync()
        grads = [p.main_grad.clone() for p in ddp.parameters()]
        for r, g in zip(ref_masters, grads):
            r.grad = g
        torch.nn.utils.clip_grad_norm_(ref_masters, 1.0)
        success, _, _ = opt.step()
        ref_opt.step()
        assert success
    for p, m, r in zip(ddp.parameters(), masters, ref_masters):
        assert m.grad.data_ptr() == p.main_grad.data_ptr()  # the DDP view, not a copy
        assert torch.equal(m, r)
        assert torch.equal(p, m.to(torch.bfloat16))  # model param = rounded master
    # lr 1e-4 moves weights by less than a bf16 ulp: the masters remember what bf16 drops.
    assert any(not torch.equal(m, p.float()) for p, m in zip(ddp.parameters(), masters))


def _fp16_params():
    w = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    for p in (w, b):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return [w, b]


def test_fp16_overflow_skips_step_and_backs_off_after_hysteresis():
    params = _fp16_params()
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)
    precision = PrecisionConfig(fp16=True, initial_loss_scale=1024.0, hysteresis=2, loss_scale_window=2)
    opt = MixedPrecisionOptimizer(params, config=config, precision=precision)
    assert opt.get_loss_scale() == 1024.0
    assert opt.scale_loss(torch.tensor(2.0)).item() == 2048.0

    def step_with(value):
        for p in params:
            p.main_grad.fill_(value)
        return opt.step()

    assert step_with(float("inf")) == (False, None, None)
    assert opt.get_loss_scale() == 1024.0  # first overflow uses up hysteresis
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    assert step_with(float("nan"))[0] is False
    assert opt.get_loss_scale() == 512.0  # second overflow halves
    assert step_with(float("inf"))[0] is False
    assert opt.get_loss_scale() == 256.0  # hysteresis stays used up until the scale grows
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)

    success, grad_norm, _ = step_with(256.0 * 0.25)  # a scaled grad of 0.25
    assert success
    assert all(torch.equal(p, torch.full_like(p, 0.75)) for p in params)  # 1 - lr * 0.25
    assert grad_norm.item() == pytest.approx(0.25 * 20**0.5)  # unscaled norm over 20 elements
    step_with(0.0)
    assert opt.get_loss_scale() == 512.0  # two clean steps (window 2) double it
    state = opt.state_dict()["grad_scaler"]
    assert state == {"scale": 512.0, "growth_tracker": 0, "hysteresis_tracker": 2}


def test_fp16_static_loss_scale():
    params = _fp16_params()
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)
    opt = MixedPrecisionOptimizer(params, config=config, precision=PrecisionConfig(fp16=True, loss_scale=8.0))
    params[0].main_grad.fill_(float("inf"))
    assert opt.step()[0] is False and opt.get_loss_scale() == 8.0
    for p in params:
        p.main_grad.fill_(4.0)
    assert opt.step()[0] is True
    assert torch.equal(params[1], torch.full_like(params[1], 0.5))


def test_no_weight_decay_on_biases_and_norms():
    torch.manual_seed(0)
    ddp = _wrap(_Net())
    config = OptimizerConfig(lr=1.0, weight_decay=0.5, clip_grad=0.0)
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=config, precision=PrecisionConfig())
    named = dict(ddp.module.named_parameters())
    by_id = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert by_id[id(named["fc1.weight"])] == 0.5 and by_id[id(named["fc2.weight"])] == 0.5
    for name in ("fc1.bias", "norm.weight", "norm.bias"):
        assert by_id[id(named[name])] == 0.0, name
    # Functionally: zero grads leave Adam's update at 0, so only decay moves weights.
    before = {n: p.detach().clone() for n, p in named.items()}
    ddp.zero_grad_buffer()
    opt.step()
    for name, p in named.items():
        expected = before[name] * 0.5 if p.ndim >= 2 else before[name]
        assert torch.equal(p, expected), name


def test_state_dict_is_plain_and_resumes_bitwise():
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16)
    twin = copy.deepcopy(net)
    config = OptimizerConfig(lr=1e-3)
    ddp = _wrap(net)
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=config, precision=PrecisionConfig(bf16=True))
    xs = [torch.randn(4, 6, dtype=torch.bfloat16) for _ in range(4)]

    def run(d, o, x):
        d.zero_grad_buffer()
        d(x).float().square().mean().backward()
        d.finish_grad_sync()
        o.step()

    for x in xs[:2]:
        run(ddp, opt, x)
    blob = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, blob)
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)  # plain types only
    ddp2 = _wrap(twin)
    opt2 = MixedPrecisionOptimizer(ddp2.parameters(), config=config, precision=PrecisionConfig(bf16=True))
    ddp2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    for x in xs[2:]:
        run(ddp, opt, x)
        run(ddp2, opt2, x)
    assert all(torch.equal(a, b) for a, b in zip(opt.main_params, opt2.main_params))
    assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ddp2.parameters()))
    with pytest.raises(ValueError, match="--no-load-optim"):
        opt2.load_state_dict({**loaded["optim"], "main_params": []})


def test_reload_model_params_refreshes_masters():
    net = _Net().to(torch.bfloat16)
    ddp = _wrap(net)
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=OptimizerConfig(), precision=PrecisionConfig(bf16=True))
    with torch.no_grad():
        net.fc1.weight.fill_(3.0)
    opt.reload_model_params()
    assert torch.equal(opt.main_params[0], torch.full((16, 6), 3.0))


def test_params_without_main_grad_are_rejected():
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        MixedPrecisionOptimizer(
            torch.nn.Linear(2, 2).parameters(), config=OptimizerConfig(), precision=PrecisionConfig()
        )


@pytest.mark.gpu
def test_cuda_uses_fused_and_matches_reference():
    torch.manual_seed(0)
    net = _Net().cuda().to(torch.bfloat16)
    ddp = DistributedDataParallel(net, config=DDPConfig(), pg=ProcessGroups.single(torch.device("cuda")))
    opt = MixedPrecisionOptimizer(
        ddp.parameters(), config=OptimizerConfig(lr=1e-3), precision=PrecisionConfig(bf16=True)
    )
    assert opt.optimizer.defaults.get("fused") is True
    ref_masters = [m.clone() for m in opt.main_params]
    ref_opt = torch.optim.AdamW(
        [
            {"params": [r for r in ref_masters if r.ndim >= 2]},
            {"params": [r for r in ref_masters if r.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        weight_decay=0.01,
        fused=True,
    )
    for _ in range(3):
        ddp.zero_grad_buffer()
        ddp(torch.randn(4, 6, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
        ddp.finish_grad_sync()
        for r, p in zip(ref_masters, ddp.parameters()):
            r.grad = p.main_grad.clone()
        torch.nn.utils.clip_grad_norm_(ref_masters, 1.0)
        success, grad_norm, _ = opt.step()
        ref_opt.step()
        assert success and grad_norm.is_cuda
    assert all(torch.equal(m, r) for m, r in zip(opt.main_params, ref_masters))


def test_preallocated_adam_state_matches_lazy_state_bitwise():
    """Allocating Adam's moments up front (done with CUDA graphs) changes no number."""
    torch.manual_seed(0)
    nets = [_Net(), None]
    nets[1] = copy.deepcopy(nets[0])
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05)
    ddps = [_wrap(n) for n in nets]
    opts = [
        MixedPrecisionOptimizer(d.parameters(), config=config, precision=PrecisionConfig(), preallocate_state=pre)
        for d, pre in zip(ddps, (False, True))
    ]
    assert len(opts[0].optimizer.state) == 0
    assert len(opts[1].optimizer.state) == len(opts[1].main_params)
    ptrs = [s["exp_avg"].data_ptr() for s in opts[1].optimizer.state.values()]
    for _ in range(4):
        x = torch.randn(8, 6)
        for d, o in zip(ddps, opts):
            _train_step(d, o, x)
    for a, b in zip(ddps[0].parameters(), ddps[1].parameters()):
        assert torch.equal(a, b)
    assert ptrs == [s["exp_avg"].data_ptr() for s in opts[1].optimizer.state.values()]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        for s0, s1 in zip(opts[0].optimizer.state.values(), opts[1].optimizer.state.values()):
            assert torch.equal(s0[key], s1[key]) and s0[key].dtype == s1[key].dtype, key


def test_norm_over_the_flat_grad_buffer():
    """With the DDP buffer given, the norm is one reduction over it (gaps are zero)."""
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(8, 6)
    norms = []
    for buffers in (False, True):
        ddp = _wrap(copy.deepcopy(net))
        opt = MixedPrecisionOptimizer(
            ddp.parameters(),
            config=OptimizerConfig(clip_grad=0.0),
            precision=PrecisionConfig(),
            grad_buffers=[ddp.grad_buffer.data] if buffers else (),
        )
        norms.append(_train_step(ddp, opt, x)[1])
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-6, atol=0)  # another summation order
    other = _wrap(_Net())
    with pytest.raises(ValueError, match="grad_buffers"):
        MixedPrecisionOptimizer(
            ddp.parameters(),
            config=OptimizerConfig(),
            precision=PrecisionConfig(),
            grad_buffers=[other.grad_buffer.data],
        )


@pytest.mark.parametrize("preallocate", [False, True])
def test_direct_fused_adamw_equals_torch_fused_step(monkeypatch, preallocate):
    """The direct ``torch._fused_adamw_`` call is bitwise torch's fused AdamW step (run
    here with torch's CPU fused kernel), with clipping through its grad_scale input and
    lazily created state (first step by torch, then direct)."""
    import megatron.core.optimizer.optimizer as optim_module

    if not hasattr(torch, "_fused_adamw_"):
        pytest.skip("this torch has no fused AdamW")

    def fused_inner(groups, config, device):
        return torch.optim.AdamW(groups, fused=True, **adamw_kwargs(config))

    monkeypatch.setattr(optim_module, "_build_inner", fused_inner)
    torch.manual_seed(0)
    nets = [_Net(), None]
    nets[1] = copy.deepcopy(nets[0])
    ddps = [_wrap(n) for n in nets]
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05)
    opts = [
        MixedPrecisionOptimizer(
            d.parameters(), config=config, precision=PrecisionConfig(), preallocate_state=preallocate
        )
        for d in ddps
    ]
    opts[1]._build_fused_lists = lambda: None  # torch's own AdamW.step every time
    for step in range(4):
        x = torch.randn(8, 6)
        for d, o in zip(ddps, opts):
            _train_step(d, o, x)
        assert bool(opts[0]._fused_lists) == (preallocate or step > 0)
    for a, b in zip(ddps[0].parameters(), ddps[1].parameters()):
        assert torch.equal(a, b)
    for s0, s1 in zip(opts[0].optimizer.state.values(), opts[1].optimizer.state.values()):
        assert all(torch.equal(s0[k], s1[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _states(opt):
    return [{k: v.clone() for k, v in opt.optimizer.state[m].items()} for m in opt.main_params]


def _snapshot(ddp, opt):
    return [p.detach().clone() for p in ddp.parameters()], _states(opt)


def _assert_unchanged(ddp, opt, snapshot):
    params, states = snapshot
    for p, q in zip(ddp.parameters(), params):
        assert torch.equal(p, q)
    for now, before in zip(_states(opt), states):
        assert now.keys() == before.keys()
        for k in now:
            assert torch.equal(now[k], before[k]), k


def _x(ddp):
    return torch.randn(4, 6, dtype=next(iter(ddp.parameters())).dtype)


def _poison_step(ddp, opt, skip=None):
    """A step whose first gradient holds a NaN (or a finite one with ``skip`` set)."""
    ddp.zero_grad_buffer()
    ddp(_x(ddp)).float().square().mean().backward()
    ddp.finish_grad_sync()
    if skip is None:
        next(iter(ddp.parameters())).main_grad.view(-1)[0] = float("nan")
    return opt.step(skip=skip)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_non_finite_step_is_skipped(monkeypatch, fused, bf16):
    # fused=True takes the device path (the kernel's found_inf input); on the CPU that
    # is torch's fused AdamW, forced here, and the host must not read the flag.
    import megatron.core.optimizer.optimizer as optimizer_module

    if fused:
        monkeypatch.setattr(
            optimizer_module,
            "_build_inner",
            lambda groups, config, device: torch.optim.AdamW(groups, lr=config.lr, fused=True),
        )
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16) if bf16 else _Net()
    ddp = _wrap(net)
    config = OptimizerConfig(lr=1e-2, clip_grad=1.0)
    opt = MixedPrecisionOptimizer(
        ddp.parameters(),
        config=config,
        precision=PrecisionConfig(bf16=bf16),
        skip_non_finite=True,
        preallocate_state=True,
        grad_buffers=[ddp.grad_buffer.data],
    )
    assert opt._fused == fused
    _train_step(ddp, opt, _x(ddp))  # a good step first: moments are non-zero
    assert opt.non_finite is not None and float(opt.non_finite) == 0.0
    before = _snapshot(ddp, opt)

    def no_host_read(*args, **kwargs):
        raise AssertionError("the host read a device value during the step")

    for skip in (None, torch.tensor(True)):
        with monkeypatch.context() as m:
            if fused:
                m.setattr(torch.Tensor, "item", no_host_read)
                m.setattr(torch.Tensor, "__bool__", no_host_read)
            success, grad_norm, _ = _poison_step(ddp, opt, skip)
        assert success is True and float(opt.non_finite) == 1.0
        assert torch.isfinite(grad_norm) == (skip is not None)
        _assert_unchanged(ddp, opt, before)
    # The next good step goes on from the state before the skipped ones.
    _train_step(ddp, opt, _x(ddp))
    assert float(opt.non_finite) == 0.0
    assert not torch.equal(next(iter(ddp.parameters())), before[0][0])
    assert {int(float(s["step"])) for s in _states(opt)} == {2}


def test_non_finite_step_is_applied_without_the_guard():
    torch.manual_seed(0)
    ddp = _wrap(_Net())
    opt = MixedPrecisionOptimizer(ddp.parameters(), config=OptimizerConfig(lr=1e-2), precision=PrecisionConfig())
    _poison_step(ddp, opt)
    assert opt.non_finite is None
    assert not torch.isfinite(next(iter(ddp.parameters()))).all()  # Megatron's behaviour
