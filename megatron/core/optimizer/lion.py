"""Lion (Chen et al., 2023): the sign of an interpolated momentum, in plain PyTorch.

Megatron takes it from ``emerging_optimizers`` as Muon's scalar optimizer
(``--muon-scalar-optimizer lion``, betas ``--lion-beta1`` / ``--lion-beta2``). One step of a
parameter ``p`` with gradient ``g`` and momentum ``m`` (``exp_avg``, zeros at first):
``p <- p - lr * wd * p`` (decoupled weight decay, the group's ``weight_decay``),
``u = sign(beta1 m + (1 - beta1) g)``, ``m <- beta2 m + (1 - beta2) g``, ``p <- p - lr * u``.

The only state is ``exp_avg`` (no step count: Lion has no bias correction), which is all
Megatron checkpoints of it.
"""

import torch


def check_betas(beta1: float, beta2: float) -> None:
    """Raises ``ValueError`` naming the flag when a beta is outside ``[0, 1)``."""
    for flag, beta in (("--lion-beta1", beta1), ("--lion-beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{flag} must be in [0, 1), got {beta} (Megatron's default: 0.95 and 0.98).")


class Lion(torch.optim.Optimizer):
    """Lion over param groups (``lr``, ``betas``, ``weight_decay`` per group).

    Args:
        params: Tensors or param groups.
        lr: Learning rate (the scheduler sets each group's).
        betas: ``(beta1, beta2)``: beta1 mixes momentum and gradient inside the sign, beta2 is the
            momentum's EMA coefficient.
        weight_decay: Decoupled weight decay coefficient, scaled by the lr.
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.95, 0.98), weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"--lr must be non-negative, got {lr}.")
        if weight_decay < 0.0:
            raise ValueError(f"--weight-decay must be >= 0, got {weight_decay}.")
        check_betas(*betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One Lion step of every parameter that has a gradient."""
        if closure is not None:
            raise ValueError("Lion.step takes no closure.")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moments.append(state["exp_avg"])
            lr, weight_decay = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if weight_decay != 0.0:
                torch._foreach_add_(params, params, alpha=-weight_decay * lr)
            updates = torch._foreach_lerp(moments, grads, 1.0 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_lerp_(moments, grads, 1.0 - beta2)
            torch._foreach_add_(params, updates, alpha=-lr)
        return None


def lion_from_config(groups, config) -> Lion:
    """Lion over ``groups`` with the run's ``--lr``, ``--lion-beta1/2`` and ``--weight-decay``."""
    return Lion(groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2), weight_decay=config.weight_decay)
