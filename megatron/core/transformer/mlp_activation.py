"""The MLP's nonlinearity, for dense MLPs, shared experts and routed experts alike.

GeLU, squared ReLU (``--squared-relu``), SwiGLU (``--swiglu``) or quick-GEGLU
(``--quick-geglu``: ``quick_gelu(x) = x * sigmoid(1.702 x)`` on the gate half). A gated
activation reads fc1's output as ``[gate | linear]`` halves (Megatron's order) and returns
``act(gate) * (linear + --glu-linear-offset)``; with ``--activation-func-clamp-value C``
the gate half is first clamped from above at C and the linear half to ``[-C, C]``, as
GPT-OSS does. Plain PyTorch ops, so autograd gives the backward.
"""

import dataclasses

import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``: the sigmoid approximation of GeLU."""
    return x * torch.sigmoid(1.702 * x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``."""
    return F.relu(x).square()


_FUNCS = {"gelu": F.gelu, "silu": F.silu, "quick_gelu": quick_gelu, "squared_relu": squared_relu}


@dataclasses.dataclass(frozen=True)
class MLPActivation:
    """One MLP activation: which function, gated or not, and the gated form's offset and clamp.

    Attributes:
        name: ``gelu``, ``silu``, ``quick_gelu`` or ``squared_relu``.
        gated: fc1 gives ``[gate | linear]`` halves (twice the FFN width).
        linear_offset: Added to the linear half (gated only).
        clamp: Clamp of the halves (gated only), or None.
    """

    name: str
    gated: bool
    linear_offset: float = 0.0
    clamp: float | None = None

    @classmethod
    def from_config(cls, config) -> "MLPActivation":
        """The activation a finalized ``TransformerConfig`` asks for."""
        if getattr(config, "quick_geglu", False):
            name = "quick_gelu"
        elif config.gated_linear_unit:
            name = "silu"
        elif getattr(config, "squared_relu", False):
            name = "squared_relu"
        else:
            name = "gelu"
        gated = bool(config.gated_linear_unit or getattr(config, "quick_geglu", False))
        if not gated:
            return cls(name, False)
        return cls(name, True, float(getattr(config, "glu_linear_offset", 0.0)), config.activation_func_clamp_value)

    @property
    def is_plain(self) -> bool:
        """GeLU or SwiGLU without offset or clamp: the form the fused expert loop computes itself."""
        return self.name in ("gelu", "silu") and self.gated == (self.name == "silu") and self._unmodified

    @property
    def _unmodified(self) -> bool:
        return self.linear_offset == 0.0 and self.clamp is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., 2f] -> [..., f]`` when gated, else elementwise."""
        fn = _FUNCS[self.name]
        if not self.gated:
            return fn(x)
        gate, linear = torch.chunk(x, 2, dim=-1)
        if self.clamp is not None:
            gate = gate.clamp(max=self.clamp)
            linear = linear.clamp(min=-self.clamp, max=self.clamp)
        if self.linear_offset != 0.0:
            linear = linear + self.linear_offset
        return fn(gate) * linear
