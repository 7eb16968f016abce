"""Learning-rate schedule with Megatron's semantics, counted in iterations (or samples).

Warm-up is linear from ``init_lr`` (``--lr-warmup-init``, default 0):
``lr = init_lr + (max_lr - init_lr) * step / warmup_steps`` for ``step <= warmup``.
Then ``constant`` stays at ``max_lr`` forever, while ``linear`` and ``cosine`` decay
from ``max_lr`` to ``min_lr`` at ``lr_decay_steps`` and stay at ``min_lr`` after it;
``inverse-square-root`` is ``max_lr * sqrt(warmup / step)`` (at least ``min_lr``), and
``WSD`` holds ``max_lr`` until the last ``wsd_decay_steps`` of the decay, which anneal
it (``lr_wsd_decay_style``). Weight decay moves from ``start_wd`` to ``end_wd`` over
``wd_incr_steps`` (linear or cosine) in the groups that decay; ``constant`` leaves it.

Megatron counts in samples (iterations x global batch); with a fixed global batch the
ratios are the same, so counting iterations gives the same learning rates. As in
Megatron, the scheduler applies ``get_lr(0)`` on construction, so with warm-up the
first iteration runs at lr 0, and ``step()`` is called after each optimizer step.
When the global batch changes during training (ramp-up, step schedule) the steps are
samples, as in Megatron, and each step advances by that iteration's global batch.
"""

import math
from typing import Any

from megatron.core.config_utils import require

_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


class OptimizerParamScheduler:
    """Sets ``lr`` on every param group of ``optimizer`` as iterations advance.

    Args:
        optimizer: Anything with ``param_groups`` (a torch optimizer or
            ``MixedPrecisionOptimizer``).
        max_lr: Peak learning rate (``--lr``).
        min_lr: Floor at the end of decay (``--min-lr``).
        lr_warmup_steps: Iterations of linear warm-up (may be fractional when it comes
            from ``--lr-warmup-fraction``).
        lr_decay_steps: Iteration at which decay reaches ``min_lr``.
        lr_decay_style: ``constant``, ``linear``, ``cosine``, ``inverse-square-root`` or ``WSD``.
        init_lr: Learning rate at step 0 of the warm-up (``--lr-warmup-init``).
        wsd_decay_steps: Length of WSD's annealing phase (the end of the decay).
        lr_wsd_decay_style: Its shape: ``exponential``, ``linear``, ``cosine`` or ``minus_sqrt``.
        wd_incr_style: ``constant`` (weight decay untouched), ``linear`` or ``cosine``.
        start_wd, end_wd, wd_incr_steps: The weight decay's path for the non-constant styles.
    """

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: float,
        lr_decay_style: str,
        init_lr: float = 0.0,
        wsd_decay_steps: float | None = None,
        lr_wsd_decay_style: str = "exponential",
        wd_incr_style: str = "constant",
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_steps: float | None = None,
    ):
        require(lr_decay_style in _STYLES, f"--lr-decay-style must be one of {_STYLES}, got {lr_decay_style!r}.")
        require(0.0 <= min_lr <= max_lr, f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr}).")
        require(lr_warmup_steps >= 0, f"--lr-warmup-iters must be >= 0, got {lr_warmup_steps}.")
        require(0.0 <= init_lr <= max_lr, f"need 0 <= --lr-warmup-init ({init_lr}) <= --lr ({max_lr}).")
        if lr_decay_style != "constant":
            require(lr_decay_steps > 0, f"--lr-decay-iters must be > 0, got {lr_decay_steps}.")
            require(
                lr_warmup_steps < lr_decay_steps,
                f"warm-up ({lr_warmup_steps} iterations) must end before decay does (--lr-decay-iters, "
                f"default --train-iters = {lr_decay_steps}); shorten --lr-warmup-iters/--lr-warmup-fraction "
                "or lengthen --lr-decay-iters.",
            )
        if lr_decay_style == "WSD":
            require(lr_wsd_decay_style in _WSD_STYLES, f"--lr-wsd-decay-style must be one of {_WSD_STYLES}.")
            require(
                wsd_decay_steps is not None and 0 < wsd_decay_steps <= lr_decay_steps,
                f"--lr-wsd-decay-iters ({wsd_decay_steps}) must be > 0 and at most the decay iterations "
                f"({lr_decay_steps}).",
            )
        if wd_incr_style != "constant":
            require(wd_incr_steps is not None and wd_incr_steps > 0, "a weight-decay schedule needs training steps.")
        self.optimizer = optimizer
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.wd_incr_style = wd_incr_style
        self.start_wd, self.end_wd, self.wd_incr_steps = start_wd, end_wd, wd_incr_steps
        # Each group's share of the scheduled weight decay, fixed at construction (a loaded optimizer
        # state may not carry the key): 0 for biases and norms.
        self._wd_mult = [float(g.get("wd_mult", g.get("weight_decay", 0.0) > 0)) for g in optimizer.param_groups]
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.init_lr = float(init_lr)
        self.num_steps = 0
        self.step(0)

    def get_lr(self, step: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The learning rate after ``step`` iterations (pure); ``max_lr`` / ``min_lr`` give a
        param group's own range (``--decoupled-lr``), the same schedule shape."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        warmup = self.lr_warmup_steps
        if warmup > 0 and step <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(step) / float(warmup)
        if self.lr_decay_style == "constant":
            return max_lr
        if step > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
        ratio = float(step - warmup) / float(self.lr_decay_steps - warmup)
        assert 0.0 <= ratio <= 1.0, ratio
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable, then the annealing phase
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            coeff = (
                1.0
                if step <= anneal_start
                else _anneal(self.lr_wsd_decay_style, (step - anneal_start) / self.wsd_decay_steps)
            )
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self, step: float) -> float | None:
        """The scheduled weight decay after ``step`` steps (pure); None with the constant style."""
        if self.wd_incr_style == "constant":
            return None
        if step > self.wd_incr_steps:
            return self.end_wd
        ratio = float(step) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> float:
        """Advances by ``increment`` iterations and writes the new lr into every group (a group
        with ``max_lr`` / ``min_lr`` keys follows its own range); returns the main lr."""
        self.num_steps += increment
        lr = self.get_lr(self.num_steps)
        wd = self.get_wd(self.num_steps)
        for group, wd_mult in zip(self.optimizer.param_groups, self._wd_mult):
            if "max_lr" in group:
                group["lr"] = self.get_lr(self.num_steps, group["max_lr"], group.get("min_lr"))
            else:
                group["lr"] = lr
            if wd is not None:
                group["weight_decay"] = wd * wd_mult
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_style": self.lr_decay_style,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position; the schedule itself comes from this run's flags."""
        self.num_steps = int(state["num_steps"])
        self.step(0)


def _anneal(style: str, r: float) -> float:
    """WSD's annealing coefficient at the fraction ``r`` of its phase (1 -> 0)."""
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, r) - 1.0
    return 1.0 - math.sqrt(r)  # minus_sqrt


def build_scheduler(
    optimizer,
    opt_config,
    train_iters: int,
    *,
    samples_per_iteration: int | None = None,
    sample_steps: tuple[int, int | None] | None = None,
) -> OptimizerParamScheduler:
    """The scheduler for ``OptimizerConfig``: resolves --lr-decay-iters and warm-up.

    ``--lr-decay-iters`` defaults to ``train_iters``; ``--lr-warmup-fraction`` (when
    set) is a fraction of the decay iterations and wins over ``--lr-warmup-iters``.
    With ``samples_per_iteration`` (runs given ``--train-samples``) the schedule is in
    samples: ``--lr-warmup-samples`` and ``--lr-decay-samples`` (default: all training
    samples) over the constant global batch, in (fractional) iterations.

    ``sample_steps=(global_batch_size, train_samples)`` (a batch size that changes during
    training) makes the steps samples, as Megatron counts them: the caller steps by
    each iteration's global batch. With ``train_samples`` the sample flags apply;
    without, the iteration flags times ``global_batch_size``.
    """
    o = opt_config
    # WSD's annealing phase in the units of the schedule: samples flags for a --train-samples run,
    # iterations otherwise (the other spelling converted by the global batch, when it is fixed).
    wsd_iters, wsd_samples = o.lr_wsd_decay_iters, o.lr_wsd_decay_samples
    if sample_steps is not None:
        batch, train_samples = sample_steps
        if train_samples is not None:
            decay = o.lr_decay_samples if o.lr_decay_samples is not None else train_samples
            warmup = o.lr_warmup_samples
            wsd = wsd_samples if wsd_samples is not None else (wsd_iters * batch if wsd_iters is not None else None)
            wd_steps = train_samples
        else:
            decay = (o.lr_decay_iters if o.lr_decay_iters is not None else train_iters) * batch
            warmup = o.lr_warmup_iters * batch
            wsd = wsd_iters * batch if wsd_iters is not None else wsd_samples
            wd_steps = train_iters * batch
    elif samples_per_iteration is not None:
        decay = (o.lr_decay_samples / samples_per_iteration) if o.lr_decay_samples is not None else train_iters
        warmup = o.lr_warmup_samples / samples_per_iteration
        wsd = wsd_samples / samples_per_iteration if wsd_samples is not None else wsd_iters
        wd_steps = train_iters
    else:
        decay = o.lr_decay_iters if o.lr_decay_iters is not None else train_iters
        warmup = o.lr_warmup_iters
        wsd, wd_steps = (wsd_iters if wsd_iters is not None else wsd_samples), train_iters
        if o.lr_warmup_fraction is not None:
            require(
                0.0 <= o.lr_warmup_fraction < 1.0,
                f"--lr-warmup-fraction must be in [0, 1), got {o.lr_warmup_fraction}.",
            )
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    return OptimizerParamScheduler(
        optimizer,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        init_lr=o.lr_warmup_init,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
        wd_incr_style=o.weight_decay_incr_style,
        start_wd=o.start_weight_decay,
        end_wd=o.end_weight_decay,
        wd_incr_steps=wd_steps,
    )
