"""Folding ``param.grad`` into ``main_grad``: one parameter as its gradient arrives, or a set of them
after a backward in a few multi-tensor kernels. Both are the same fp32 add per element, bit for bit."""

import torch


def fold_grad(param: torch.nn.Parameter) -> None:
    """Adds ``param.grad`` into ``param.main_grad`` and drops it.

    If ``param.grad`` already *is* ``main_grad`` (someone left it attached), autograd has
    accumulated into the buffer itself and adding again would double the gradient. No
    ``param.grad`` at all: a fused wgrad GEMM wrote ``main_grad`` directly.
    """
    if param.grad is not None:
        if param.grad.data_ptr() != param.main_grad.data_ptr():
            param.main_grad.add_(param.grad)
        param.grad = None


# Low-precision gradients up to this many elements are upcast through scratch tensors
# before the fold; larger ones are added directly (one launch each, a small share of
# their cost), so the scratch stays small.
_FOLD_SCRATCH_MAX_NUMEL = 1 << 16


class FoldPlan:
    """``main_grad += grad`` for one set of parameters, in a few multi-tensor kernels.

    A multi-tensor add needs one dtype on both sides; with bf16 grads and fp32
    main_grads it falls back to one add (one launch) per tensor: ~70 a step on the
    8-layer model (norms and biases), which is host time in a host-bound step. So the
    small low-precision grads are first copied into fp32 scratch tensors by a
    multi-tensor copy (which converts dtypes in its fast path), then added by one
    multi-tensor add. The upcast is exact and the add is the same fp32 add, so the
    result is the mixed add's, bit for bit. Large grads (the position table) and
    fp32 grads are added directly. The lists and scratch are kept for as long as the
    same parameters arrive with gradients (every step).
    """

    def __init__(self, params: list[torch.nn.Parameter], key: tuple):
        self.key = key
        self.small = [
            i
            for i, p in enumerate(params)
            if p.grad.dtype != p.main_grad.dtype and p.numel() <= _FOLD_SCRATCH_MAX_NUMEL
        ]
        small = set(self.small)
        self.direct = [i for i in range(len(params)) if i not in small]
        self.small_mains = [params[i].main_grad for i in self.small]
        self.direct_mains = [params[i].main_grad for i in self.direct]
        self.scratch = [torch.empty_like(main) for main in self.small_mains]

    def run(self, params: list[torch.nn.Parameter]) -> None:
        if self.small:
            torch._foreach_copy_(self.scratch, [params[i].grad for i in self.small])
            torch._foreach_add_(self.small_mains, self.scratch)
        if self.direct:
            torch._foreach_add_(self.direct_mains, [params[i].grad for i in self.direct])
