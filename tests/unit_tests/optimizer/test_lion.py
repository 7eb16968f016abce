"""Lion, Muon's ``--muon-scalar-optimizer lion``: steps against a hand-written float64 reference, state dicts, flags.

Tolerance of the float32 parameters and momentum against float64: 1e-6 relative (every update
is ``lr`` times a sign; the data keep the interpolated momentum far from zero, so no sign flips).
"""

import copy

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer.lion import Lion
from megatron.core.optimizer.muon import MatrixInfo, Muon
from megatron.training.training import build_trainer
from tests.unit_tests.optimizer.test_muon import FLAGS, config

RTOL = 1e-6


def reference_step(w, m, g, lr, wd, beta1, beta2):
    """float64 Lion, written from the paper: decoupled decay, sign of the interpolation, then the EMA."""
    w = w - lr * wd * w
    u = torch.sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    return w - lr * u, m


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_steps_match_float64_reference(wd):
    torch.manual_seed(0)
    w = torch.randn(64, 8)
    opt = Lion([w], lr=0.01, betas=(0.9, 0.99), weight_decay=wd)
    ref_w, ref_m = w.double(), torch.zeros(64, 8, dtype=torch.float64)
    for step, lr in enumerate((0.01, 0.005, 0.02, 0.01)):
        opt.param_groups[0]["lr"] = lr  # as the scheduler sets it
        g = torch.randn(64, 8)
        w.grad = g
        opt.step()
        ref_w, ref_m = reference_step(ref_w, ref_m, g.double(), lr, wd, 0.9, 0.99)
        assert _rel(w, ref_w) < RTOL, step
        assert _rel(opt.state[w]["exp_avg"], ref_m) < RTOL, step
    assert set(opt.state[w]) == {"exp_avg"}  # Megatron checkpoints exp_avg only: no step count


def test_lion_betas_and_first_step_is_the_sign_of_the_gradient():
    w = torch.zeros(4)
    opt = Lion([w], lr=0.5, betas=(0.95, 0.98))
    w.grad = torch.tensor([3.0, -2.0, 0.0, 1e-9])
    opt.step()
    assert torch.equal(w, torch.tensor([-0.5, 0.5, 0.0, -0.5]))
    assert torch.allclose(opt.state[w]["exp_avg"], 0.02 * w.grad)
    with pytest.raises(ValueError, match="--lion-beta2"):
        Lion([w], betas=(0.9, 1.0))


def _muon_with_lion(wd_bias=0.0):
    cfg = config(muon_scalar_optimizer="lion", lion_beta1=0.9, lion_beta2=0.99)
    w, b, e = torch.randn(16, 8), torch.randn(16), torch.randn(32, 8)
    groups = [
        {"params": [w], "weight_decay": cfg.weight_decay, "use_muon": True},
        {"params": [e], "weight_decay": cfg.weight_decay, "use_muon": False},  # an embedding: decays
        {"params": [b], "weight_decay": wd_bias, "use_muon": False},
    ]
    return Muon(groups, config=cfg, info_of=lambda t: MatrixInfo((16, 8))), cfg, (w, e, b)


def test_muon_steps_its_scalar_groups_with_lion():
    torch.manual_seed(2)
    opt, cfg, (w, e, b) = _muon_with_lion()
    assert isinstance(opt.scalar, Lion) and opt.scalar.state is opt.state
    refs = {"e": (e.double(), torch.zeros_like(e, dtype=torch.float64), cfg.weight_decay)}
    refs["b"] = (b.double(), torch.zeros_like(b, dtype=torch.float64), 0.0)
    for _ in range(3):
        grads = {"w": torch.randn(16, 8), "e": torch.randn(32, 8), "b": torch.randn(16)}
        w.grad, e.grad, b.grad = grads["w"], grads["e"], grads["b"]
        opt.step()
        for name, tensor in (("e", e), ("b", b)):
            ref_w, ref_m, wd = refs[name]
            ref_w, ref_m = reference_step(ref_w, ref_m, grads[name].double(), cfg.lr, wd, 0.9, 0.99)
            refs[name] = (ref_w, ref_m, wd)
            assert _rel(tensor, ref_w) < RTOL, name
    assert set(opt.state[e]) == set(opt.state[b]) == {"exp_avg"}
    assert set(opt.state[w]) == {"momentum_buffer"}
    assert opt.state_names_for(opt.param_groups[1]) == ["exp_avg"]
    assert opt.param_groups[1]["betas"] == (0.9, 0.99)


def test_muon_with_lion_state_dict_round_trip_is_bitwise():
    torch.manual_seed(3)
    a, _cfg, tensors_a = _muon_with_lion()
    grads = [[torch.randn_like(t) for t in tensors_a] for _ in range(4)]
    for t, g in zip(tensors_a, grads[0]):
        t.grad = g
    a.step()
    b, _cfg, tensors_b = _muon_with_lion()
    for tb, ta in zip(tensors_b, tensors_a):
        tb.copy_(ta)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # torch would alias the live tensors
    assert b.scalar.state is b.state and b.scalar.param_groups[0] is b.param_groups[1]
    for step in grads[1:]:
        for ta, tb, g in zip(tensors_a, tensors_b, step):
            ta.grad, tb.grad = g, g.clone()
        a.step()
        b.step()
    assert all(torch.equal(ta, tb) for ta, tb in zip(tensors_a, tensors_b))


def _trainer(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    return trainer


def test_flags_megatron_defaults_and_mistakes_name_the_flag():
    trainer = _trainer("--train-iters", 3, "--muon-scalar-optimizer", "lion")
    o = trainer.cfg.optimizer
    assert (o.muon_scalar_optimizer, o.lion_beta1, o.lion_beta2) == ("lion", 0.95, 0.98)
    scalar = [g for g in trainer.optimizer.param_groups if not g["use_muon"]]
    assert scalar and all(g["betas"] == (0.95, 0.98) for g in scalar)
    assert isinstance(trainer.optimizer.optimizer.scalar, Lion)
    with pytest.raises(ValueError, match="--lion-beta1"):
        build_trainer(FLAGS + ["--muon-scalar-optimizer", "lion", "--lion-beta1", "1.5", "--train-iters", "3"])


def test_tiny_gpt_trains_with_lion_and_clipping():
    losses = [r["lm loss"] for r in _trainer("--train-iters", 24, "--muon-scalar-optimizer", "lion",
                                             "--clip-grad", "0.5", "--lr", "1e-3").train()]  # fmt: skip
    assert losses[-1] < losses[0] - 0.05


def test_state_dict_of_the_other_scalar_optimizer_is_refused_naming_the_flag():
    torch.manual_seed(4)
    lion, _cfg, tensors = _muon_with_lion()
    cfg = config(muon_scalar_optimizer="adam")
    groups = [{k: (list(v) if k == "params" else v) for k, v in g.items()} for g in lion.param_groups]
    adam = Muon(groups, config=cfg, info_of=lambda t: MatrixInfo((16, 8)))
    for t in tensors:
        t.grad = torch.randn_like(t)
    adam.step()
    with pytest.raises(ValueError, match="--muon-scalar-optimizer adam"):
        lion.load_state_dict(copy.deepcopy(adam.state_dict()))


@pytest.mark.gpu
def test_cuda_lion_follows_the_cpu_one_gpu():
    torch.manual_seed(5)
    w = torch.randn(256, 16)
    grads = [torch.randn(256, 16) for _ in range(3)]
    results = []
    for device in ("cpu", "cuda"):
        p = w.clone().to(device)
        opt = Lion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
        for g in grads:
            p.grad = g.to(device)
            opt.step()
        results.append((p.cpu(), opt.state[p]["exp_avg"].cpu()))
    (cpu_w, cpu_m), (gpu_w, gpu_m) = results
    assert _rel(gpu_w, cpu_w.double()) < RTOL and _rel(gpu_m, cpu_m.double()) < RTOL  # FMA rounding only
