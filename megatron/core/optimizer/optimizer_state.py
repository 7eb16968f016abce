"""The optimizer's state for checkpoints: what each rank holds per parameter, its
allocation ahead of the first step, and the torch-format state dict.

``OptimizerState`` is a mixin of ``optimizer.MixedPrecisionOptimizer`` (the distributed
optimizer overrides ``_piece_range`` and the state dict). Its methods read the
optimizer's ``config``, ``optimizer`` (the inner torch optimizer), ``model_params``,
``main_params``, ``_lowp_model``/``_lowp_main`` (bf16/fp16 params and their fp32
copies), ``grad_scaler`` and reset ``_fused_lists`` when state tensors change.
"""

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from megatron.core.optimizer.muon import scalar_state_names


class StatePiece(NamedTuple):
    """What the optimizer holds for (a flat range of) one model parameter.

    Attributes:
        param: The model parameter (this rank's TP shard of it, whole).
        start: First flat element of ``param`` covered.
        end: One past the last one.
        main: The optimized fp32 tensor (``end - start`` elements).
        fp32_copy: ``main`` is an fp32 copy of a bf16/fp16 parameter (else it is the
            parameter's own memory).
        state: The inner optimizer's live state dict of ``main`` (moments, ``step``).
    """

    param: torch.nn.Parameter
    start: int
    end: int
    main: torch.Tensor
    fp32_copy: bool
    state: dict


class OptimizerState:
    """The state half of ``MixedPrecisionOptimizer`` (see the module docstring for what it reads)."""

    def _allocate_adam_state(self) -> None:
        """Allocates Adam's moments now, exactly as torch would at the first step.

        Used with CUDA graphs. Lazily, the moments land in the blocks that the eager
        recording iteration's activations just freed; from iteration 2 on those
        activations live in the graph pool, and what is left of those blocks stays
        reserved for nothing, which raises the graphed run's peak. Eager runs keep
        torch's lazy allocation (it is the cheaper one for them).
        """
        self.allocate_state(self.state_names(), only_empty=True)

    def state_names(self) -> list[str]:
        """The state the inner optimizer keeps per tensor once it has stepped."""
        if self.config.optimizer == "adam":
            amsgrad = any(group.get("amsgrad") for group in self.optimizer.param_groups)
            return ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
        if self.config.optimizer == "muon":
            return scalar_state_names(self.config) + ["momentum_buffer"]
        if self.config.optimizer == "lion":
            return ["exp_avg"]
        return ["momentum_buffer"] if self.config.sgd_momentum else []

    def allocate_state(self, names: Iterable[str], *, only_empty: bool = False) -> None:
        """Creates the named state entries that are missing (zeros; ``step`` 0-d, where torch keeps it).

        A loader calls this before copying a checkpoint's state in place. With
        ``only_empty`` a tensor whose state exists already is left alone.
        """
        names = list(names)
        names_for = getattr(self.optimizer, "state_names_for", None)  # Muon: what each kind of group holds
        for group in self.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            wanted = names if names_for is None else [n for n in names if n in names_for(group)]
            for p in group["params"]:
                state = self.optimizer.state[p]
                if only_empty and state:
                    continue
                for name in wanted:
                    if name in state:
                        continue
                    if name == "step":
                        state[name] = (
                            torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
                        )
                    else:
                        state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._fused_lists = None

    sharded_over_dp = False
    """Whether each data-parallel rank holds only its part of the state (the distributed optimizer)."""

    def _piece_range(self, index: int) -> tuple[torch.nn.Parameter, int, int]:
        """``(model param, start, end)`` of ``model_params[index]``: here the whole parameter."""
        param = self.model_params[index]
        return param, 0, param.numel()

    def state_pieces(self) -> list[StatePiece]:
        """What this rank optimizes, per model parameter (range), with its live state.

        The layout-free checkpoint (``training/sharded_state.py``) keys these by the
        parameter's name; copying into ``main`` and ``state`` in place and then calling
        ``after_state_load`` restores the optimizer.
        """
        pieces = []
        for i, (own, main) in enumerate(zip(self.model_params, self.main_params)):
            param, start, end = self._piece_range(i)
            pieces.append(StatePiece(param, start, end, main, main is not own, self.optimizer.state[main]))
        return pieces

    @torch.no_grad()
    def after_state_load(self) -> None:
        """After state was copied in place: fp32 main params into the model params, caches reset."""
        self._fused_lists = None
        for param, main in zip(self._lowp_model, self._lowp_main):
            param.copy_(main)

    def _main_params_order(self) -> list[torch.Tensor]:
        """The low-precision params in the order of ``state_dict()['main_params']``."""
        return self._lowp_model

    @torch.no_grad()
    def load_main_params(self, saved: list[torch.Tensor], where: str) -> None:
        """``--load-main-params-from-ckpt``: the fp32 copies of the low-precision params alone, from a
        saved ``state_dict()['main_params']`` (no moments), and from them the model params."""
        order = self._main_params_order()
        if len(saved) != len(order):
            raise ValueError(
                f"{where} holds {len(saved)} fp32 main params but this model has {len(order)} bf16/fp16 params: "
                "it was saved with another model or precision; drop --load-main-params-from-ckpt."
            )
        index = {id(p): i for i, p in enumerate(order)}
        for piece in self.state_pieces():
            if piece.fp32_copy:
                value = torch.as_tensor(saved[index[id(piece.param)]]).reshape(-1)[piece.start : piece.end]
                piece.main.view(-1).copy_(value)
        self.after_state_load()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copies model params into the fp32 main params (after loading model weights alone)."""
        for param, main in zip(self._lowp_model, self._lowp_main):
            main.copy_(param)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, fp32 copies of low-precision params, scaler numbers.

        Only tensors, lists, dicts, strings and numbers: loadable with
        ``torch.load(weights_only=True)``.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "main_params": [main.detach() for main in self._lowp_main],
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` saved; main params are copied into the model params too."""
        saved = state["main_params"]
        if len(saved) != len(self._lowp_main):
            raise ValueError(
                f"optimizer checkpoint holds {len(saved)} fp32 main params but this model has "
                f"{len(self._lowp_main)} bf16/fp16 params: the checkpoint was saved with another "
                "model or precision; load it with the same --bf16/--fp16 setting, or pass --no-load-optim."
            )
        # Saved groups carry the implementation flags of the saving run (fused on CUDA);
        # keep this run's, so a GPU checkpoint resumes on the CPU and vice versa.
        impl_keys = ("fused", "foreach", "capturable", "differentiable")
        impl = [{k: g[k] for k in impl_keys if k in g} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        self._fused_lists = None  # new state tensors
        for group, flags in zip(self.optimizer.param_groups, impl):
            group.update(flags)
        for main, value, param in zip(self._lowp_main, saved, self._lowp_model):
            main.copy_(value)
            param.copy_(main)
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
