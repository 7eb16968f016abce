"""The dense MLP of a transformer layer: fc1 -> activation -> fc2.

The activation (``mlp_activation``) is GeLU, squared ReLU (``--squared-relu``:
``relu(x) ** 2``), SwiGLU or quick-GEGLU. Gated ones (``--swiglu``, ``--quick-geglu``)
make fc1 produce ``2 * ffn_hidden_size`` features, gate half first: ``act(a) * b`` with
``a, b = chunk(fc1(x), 2)``, Megatron's order, so checkpoints match. Both biases are
added inside their GEMMs (the cuBLAS epilogue): with no fused bias-GeLU or
bias-dropout-add kernel, that is one kernel and one autograd node fewer each than a
separate add. So fc2 returns no bias for the layer's dropout-add.

Tensor parallelism splits the FFN features: gated, each rank's fc1 shard is
``[gate_r; up_r]`` (``stride=2``), so the local ``chunk(2)`` pairs them up as the full
model does.
"""

import torch

from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
)
from megatron.core.transformer.mlp_activation import MLPActivation


class MLP(torch.nn.Module):
    """Position-wise feed-forward block.

    Args:
        config: Finalized ``TransformerConfig`` (``ffn_hidden_size``, ``gated_linear_unit``,
            ``add_bias_linear``, ``init_method_std``, ``num_layers``).
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(self, config, pg=None, *, device=None):
        super().__init__()
        self.config = config
        self.activation = MLPActivation.from_config(config)
        self.gated = self.activation.gated
        ffn = config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn if self.gated else ffn,
            config=config,
            init_method=init_method_normal(config.hidden_init_std()),
            bias=config.add_bias_linear,
            gather_output=False,
            pg=pg,
            stride=2 if self.gated else 1,
            device=device,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            config=config,
            init_method=init_method_normal(config.output_init_std()),
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,  # in the GEMM (after the all-reduce at TP > 1); see the module docstring
            pg=pg,
            device=device,
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h] -> (output [s, b, h], None)``: the fc2 bias is already added."""
        intermediate, _ = self.linear_fc1(hidden_states)  # [s, b, ffn] or [s, b, 2 * ffn]
        return self.linear_fc2(self.activation(intermediate))
