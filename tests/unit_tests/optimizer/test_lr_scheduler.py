"""LR schedule: warm-up, constant, linear, cosine, the min_lr floor, and build_scheduler."""

import math

import pytest
import torch

from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler, build_scheduler
from megatron.core.optimizer.optimizer_config import OptimizerConfig


def _opt():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=123.0)


def _sched(style, warmup=10, decay=110, max_lr=1.0, min_lr=0.1, opt=None):
    return OptimizerParamScheduler(
        opt or _opt(), max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style
    )


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero(style):
    s = _sched(style)
    assert s.get_lr(0) == 0.0
    assert s.get_lr(1) == pytest.approx(0.1)
    assert s.get_lr(5) == pytest.approx(0.5)
    assert s.get_lr(10) == 1.0


def test_linear_values():
    s = _sched("linear")
    assert s.get_lr(60) == pytest.approx(0.1 + 0.5 * 0.9)  # half-way through decay
    assert s.get_lr(35) == pytest.approx(0.1 + 0.75 * 0.9)
    assert s.get_lr(110) == pytest.approx(0.1)
    assert s.get_lr(111) == 0.1 and s.get_lr(10_000) == 0.1  # min_lr floor


def test_cosine_values():
    s = _sched("cosine")
    assert s.get_lr(60) == pytest.approx(0.1 + 0.5 * 0.9)
    assert s.get_lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.25) + 1))
    assert s.get_lr(85) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.75) + 1))
    assert s.get_lr(110) == pytest.approx(0.1)
    assert s.get_lr(500) == 0.1


def test_constant_stays_at_max_after_decay_steps():
    s = _sched("constant")
    assert s.get_lr(50) == 1.0 and s.get_lr(10_000) == 1.0


def test_no_warmup_starts_at_max():
    s = _sched("linear", warmup=0, decay=100, min_lr=0.0)
    assert s.get_lr(0) == 1.0
    assert s.get_lr(25) == pytest.approx(0.75)


def test_step_writes_every_group_and_state_roundtrips():
    opt = _opt()
    s = _sched("cosine", opt=opt)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # applied at construction
    for _ in range(7):
        lr = s.step()
    assert lr == s.get_lr(7)
    assert [g["lr"] for g in opt.param_groups] == [lr, lr]
    s.step(increment=3)
    assert opt.param_groups[0]["lr"] == s.get_lr(10)
    state = s.state_dict()
    assert all(isinstance(v, (int, float, str)) for v in state.values())
    opt2 = _opt()
    s2 = _sched("cosine", opt=opt2)
    s2.load_state_dict(state)
    assert s2.num_steps == 10 and opt2.param_groups[1]["lr"] == s.get_lr(10)


def test_build_scheduler_defaults_and_fraction():
    s = build_scheduler(_opt(), OptimizerConfig(lr=2.0, min_lr=0.5, lr_warmup_iters=4), train_iters=20)
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.lr_decay_style) == (4, 20, "linear")
    assert s.get_lr(2) == 1.0 and s.get_lr(20) == 0.5
    s = build_scheduler(_opt(), OptimizerConfig(lr_warmup_fraction=0.1, lr_decay_iters=50), train_iters=20)
    assert (s.lr_warmup_steps, s.lr_decay_steps) == (5.0, 50)


def test_warmup_rises_from_lr_warmup_init():
    # Megatron: lr = init + (max - init) * step / warmup; a --decoupled-lr group rises from the same init.
    opt = _opt()
    opt.param_groups[1]["max_lr"], opt.param_groups[1]["min_lr"] = 2.0, 0.2
    c = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_warmup_init=0.2, lr_decay_style="cosine")
    s = build_scheduler(opt, c, train_iters=110)
    assert s.get_lr(0) == 0.2 and s.get_lr(5) == pytest.approx(0.6) and s.get_lr(10) == 1.0
    assert opt.param_groups[0]["lr"] == 0.2 and opt.param_groups[1]["lr"] == 0.2
    s.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6) and opt.param_groups[1]["lr"] == pytest.approx(1.1)
    assert s.get_lr(60) == _sched("cosine", min_lr=0.1).get_lr(60)  # decay unchanged


def test_bad_schedules_name_the_flags():
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        _sched("linear", warmup=100, decay=100)
    with pytest.raises(ValueError, match="--lr-warmup-init"):
        OptimizerConfig(lr=1.0, lr_warmup_init=2.0).validate(None)
    with pytest.raises(ValueError, match="--lr-decay-style"):
        _sched("exponential")
    with pytest.raises(ValueError, match="--lr-warmup-fraction"):
        build_scheduler(_opt(), OptimizerConfig(lr_warmup_fraction=1.5), train_iters=10)
    _sched("constant", warmup=100, decay=10)  # decay length is irrelevant for constant


def test_inverse_square_root():
    # Megatron: max_lr * sqrt(max(warmup, 1)) / sqrt(max(step, 1)), floored at min_lr; min_lr after decay.
    s = _sched("inverse-square-root", warmup=4, decay=1000, max_lr=1.0, min_lr=0.1)
    assert s.get_lr(2) == 0.5 and s.get_lr(4) == 1.0
    assert s.get_lr(16) == 0.5 and s.get_lr(64) == 0.25 and s.get_lr(900) == 0.1
    assert _sched("inverse-square-root", warmup=0, decay=100).get_lr(4) == 0.5
    assert s.get_lr(1001) == 0.1


@pytest.mark.parametrize(
    "style, at_half",
    [("exponential", 2 * 0.5**0.5 - 1), ("linear", 0.5), ("cosine", 0.5), ("minus_sqrt", 1 - 0.5**0.5)],
)
def test_wsd_holds_then_anneals(style, at_half):
    c = OptimizerConfig(
        lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="WSD", lr_wsd_decay_style=style, lr_wsd_decay_iters=40
    )
    s = build_scheduler(_opt(), c, train_iters=110)
    assert s.get_lr(5) == 0.5 and s.get_lr(10) == 1.0 and s.get_lr(70) == 1.0  # stable until 110 - 40
    assert s.get_lr(90) == pytest.approx(0.1 + 0.9 * at_half)
    assert s.get_lr(110) == pytest.approx(0.1) and s.get_lr(111) == 0.1


def test_wsd_in_samples():
    c = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="WSD", lr_wsd_decay_samples=80, lr_wsd_decay_style="linear")
    s = build_scheduler(_opt(), c, train_iters=50, samples_per_iteration=4)  # 200 samples: the last 20 iterations
    assert s.get_lr(30) == 1.0 and s.get_lr(40) == pytest.approx(0.5)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_schedule_moves_decaying_groups_only(style):
    opt = _opt()  # group 0 decays, group 1 (biases) does not
    opt.param_groups[0]["weight_decay"] = 0.01
    c = OptimizerConfig(weight_decay_incr_style=style, start_weight_decay=0.01, end_weight_decay=0.1)
    s = build_scheduler(opt, c, train_iters=100)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.01) and opt.param_groups[1]["weight_decay"] == 0.0
    s.step(50)
    half = 0.5 if style == "linear" else 0.5 * (math.cos(math.pi * 0.5) + 1.0)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.01 + 0.09 * half)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    s.step(60)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)


def test_constant_weight_decay_is_left_alone():
    opt = _opt()
    opt.param_groups[0]["weight_decay"] = 0.03
    build_scheduler(opt, OptimizerConfig(weight_decay=0.01), train_iters=10).step(5)
    assert opt.param_groups[0]["weight_decay"] == 0.03


def test_schedule_flag_errors():
    with pytest.raises(ValueError, match="--lr-wsd-decay-iters"):
        OptimizerConfig(lr_decay_style="WSD").validate(None)
    with pytest.raises(ValueError, match="needs --start-weight-decay and --end-weight-decay"):
        OptimizerConfig(weight_decay_incr_style="linear", start_weight_decay=0.1).validate(None)
    with pytest.raises(ValueError, match="need --weight-decay-incr-style linear or cosine"):
        OptimizerConfig(end_weight_decay=0.1).validate(None)
    with pytest.raises(ValueError, match="at most the decay iterations"):
        c = OptimizerConfig(lr_decay_style="WSD", lr_wsd_decay_iters=200)
        build_scheduler(_opt(), c, train_iters=100)
