"""Fine-grained activation offloading (``--fine-grained-activation-offloading --offload-modules ...``).

What a named module saves for its backward (its input, for the norms and linears) is
copied to host memory during the forward and copied back when its backward unpacks it,
through saved-tensor hooks scoped to that module's call. Values and layouts come back
unchanged (the host copy keeps the dimension order of the strides), so losses and
gradients equal the run without offloading. Parameters and tensors smaller than
``--min-offloaded-tensor-size`` bytes stay where they are. With CUDA the host copies
are pinned and both copies are issued on the current stream without waiting; the
caching host allocator keeps a pinned buffer until its copy has run.
"""

import contextlib

import torch

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""``--offload-modules`` values this trainer implements (Megatron's, less fused_group_mlp and gdp_qkv)."""


class _OnHost:
    """A saved tensor's host copy and the device it returns to."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host = host
        self.device = device


class ActivationOffloader:
    """Scopes in which the tensors saved for backward move to host memory.

    Args:
        modules: The ``--offload-modules`` names to offload.
        min_bytes: Tensors smaller than this stay on the device.
        include_host_tensors: Copy tensors that are already on the host too (tests on the CPU:
            the round trip then runs without a GPU).
    """

    include_host_tensors = False

    def __init__(self, modules, min_bytes: int = 0, include_host_tensors: bool | None = None):
        self.modules = frozenset(modules)
        self.min_bytes = min_bytes
        if include_host_tensors is not None:
            self.include_host_tensors = include_host_tensors
        self.offloaded_bytes = 0  # since construction: what went to the host

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        if tensor.device.type == "cpu" and not self.include_host_tensors:
            return tensor
        pin = tensor.device.type == "cuda"
        host = torch.empty_like(tensor, device="cpu", pin_memory=pin)  # same stride order, dense
        host.copy_(tensor, non_blocking=pin)
        self.offloaded_bytes += host.numel() * host.element_size()
        return _OnHost(host, tensor.device)

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _OnHost):
            return saved
        back = torch.empty_like(saved.host, device=saved.device)
        back.copy_(saved.host, non_blocking=saved.device.type == "cuda")
        return back

    def scope(self, module: str, active: bool = True):
        """A context in which ``module``'s saved tensors are offloaded (a no-op unless it is named
        and ``active``: training with autograd recording)."""
        if module not in self.modules or not active or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


_NOTHING = ActivationOffloader(())


def offloader_for(config) -> ActivationOffloader:
    """The config's offloader (one that offloads nothing without --fine-grained-activation-offloading)."""
    if not getattr(config, "fine_grained_activation_offloading", False):
        return _NOTHING
    return ActivationOffloader(config.offload_modules, config.min_offloaded_tensor_size)
