"""Mixed-precision optimizer: fp32 main params, grads read from the DDP buffer, clipping.

``MixedPrecisionOptimizer`` drives an inner ``torch.optim`` optimizer (AdamW or SGD)
over fp32 tensors:
- bf16/fp16 model params get an fp32 *main* copy; the copy's ``.grad`` is the model
  param's ``main_grad`` (a view into the DDP buffer; no copy is made), and after the
  inner step the main params are copied back into the model params in place;
- fp32 model params are optimized directly, with ``.grad = main_grad`` during the step;
- bf16/fp16 ``main_grad`` buffers (``--grad-reduce-in-bf16``; ``--fp16`` without fp32
  accumulation): each step the main params' ``.grad`` are fp32 copies of them
  (``fp32_grads.py``), and unscaling, the norm and clipping run on the copies.

Unusual choices:
- No host synchronisation for bf16/fp32: the gradient norm stays a device tensor
  and the clip coefficient is computed and applied on the device. Only fp16 syncs
  once per step, to learn whether the gradients overflowed.
- With ``skip_non_finite`` a step whose gradient norm (or a caller's flag, e.g. a
  non-finite loss) is not finite changes nothing: fused kernels (AdamW/SGD, CUDA)
  take the flag as their ``found_inf`` input and skip on the device, as fp16's
  overflow path does in torch's ``GradScaler``, so the step still has no host sync.
  Unfused optimizers read the flag on the host, which on the CPU costs nothing.
  ``non_finite`` holds the flag of the last step for the caller to count.
- Zeroing gradients is the DDP's job (``zero_grad_buffer``); this class never zeroes
  ``main_grad``, it only unscales and clips it in place (it is the main grad).
- Model params keep their storage (in-place copy), so CUDA graphs that read the
  weights by address stay valid.
- Given the DDP buffer (``grad_buffers``), the gradient norm is one reduction over the
  flat buffer rather than one per parameter.
- Fused AdamW's kernel is called directly with lists built once (``_inner_step``):
  the same launches as ``torch.optim.AdamW.step`` without its per-step Python.
- With model parallelism (or the distributed optimizer's shards) each rank sums the
  squares of its part of the gradients (``grad_norm_tensors``: replicated ones
  counted on one TP rank only) and the sum is all-reduced over ``grad_norm_groups``.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.optimizer.fp32_grads import Fp32GradCopies
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.lion import lion_from_config
from megatron.core.optimizer.muon import MatrixInfo, Muon, adamw_kwargs
from megatron.core.optimizer.optimizer_state import OptimizerState
from megatron.core.optimizer.param_groups import (  # noqa: F401  (re-exported: the optimizer's group rule)
    GROUP_ORDER,
    GroupKey,
    default_group,
    group_order,
    group_settings,
    mup_width_mult_of,
    param_group_rule,
)

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _build_inner(groups: list[dict[str, Any]], config, device: torch.device, **muon) -> torch.optim.Optimizer:
    """AdamW or SGD, fused on CUDA when this torch supports it, else foreach; Lion; or Muon (with AdamW or Lion)."""
    if config.optimizer == "muon":
        return Muon(groups, config=config, **muon)
    if config.optimizer == "lion":
        return lion_from_config(groups, config)
    if config.optimizer == "adam":
        cls, kwargs = torch.optim.AdamW, adamw_kwargs(config)
    elif config.optimizer == "sgd":
        cls = torch.optim.SGD
        kwargs = dict(lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
    else:
        raise ValueError(f"--optimizer {config.optimizer!r} is not supported; use adam, sgd, lion or muon.")
    if device.type == "cuda":
        try:
            return cls(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # fused kernels missing for this optimizer/torch: foreach is the next best
    return cls(groups, foreach=True, **kwargs)


def _unscale_and_check(grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """grads *= inv_scale in place; found_inf becomes 1 if any grad is inf/nan."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    except (AttributeError, NotImplementedError, RuntimeError):
        pass  # older torch without the CPU kernel
    flags = torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads])
    found_inf.copy_(flags.any().to(found_inf.dtype).reshape(found_inf.shape))
    torch._foreach_mul_(grads, inv_scale)


class MixedPrecisionOptimizer(OptimizerState):
    """Optimizer over fp32 main params whose grads are the DDP ``main_grad`` views.

    Args:
        model_params: Trainable model parameters, each with ``.main_grad`` (wrap the
            model in ``DistributedDataParallel`` first).
        grad_buffers: Optional flat tensors that hold every ``main_grad`` and zeros
            elsewhere (the DDP grad buffer): the gradient norm is taken over them, in
            one reduction instead of one per parameter.
        config: ``OptimizerConfig`` (optimizer, lr, weight decay, betas, clip_grad, ...).
        precision: ``PrecisionConfig`` (fp16 loss scaling settings).

    Attributes:
        optimizer: The inner ``torch.optim`` optimizer.
        model_params: Model params, in the order given.
        main_params: The tensor optimized for each model param (same order): an fp32
            copy for bf16/fp16 params, the param itself for fp32 ones.
        grad_scaler: Loss scaler for fp16, else ``None``.

    Model-parallel keyword arguments:
        grad_norm_tensors: The gradients whose squares this rank adds to the global norm,
            when not all of them (TP ranks but the first leave out replicated ones).
        grad_norm_groups: Process groups over which the squared norm is summed.
        grad_norm_parts: Instead of the two above, ``[(tensors, groups), ...]``: parts of
            the gradients whose squared norms are summed over different groups (dense
            and expert gradients under expert parallelism); the global norm adds them.
        group_of: ``param -> (decays, decoupled lr, muP-scaled[, Muon])`` (``param_group_rule``;
            default: 2-D and larger params decay, no decoupled lr, no muP). --optimizer muon
            needs the rule.
        mup_width_mult: muP's width multiplier for the muP-scaled groups (``group_settings``).
        muon_info: ``param -> MatrixInfo`` of the Muon parameters (--optimizer muon).
        muon_assemble: How Muon gets whole matrices (``muon.Assemble``; the distributed optimizer's).
    """

    def __init__(
        self,
        model_params: Iterable[torch.nn.Parameter],
        *,
        config,
        precision,
        preallocate_state: bool = False,
        grad_buffers: Sequence[torch.Tensor] = (),
        skip_non_finite: bool = False,
        grad_norm_tensors: Sequence[torch.Tensor] | None = None,
        grad_norm_groups: Sequence[Any] = (),
        grad_norm_parts: Sequence[tuple[Sequence[torch.Tensor], Sequence[Any]]] | None = None,
        group_of: Callable[[torch.Tensor], GroupKey] = default_group,
        mup_width_mult: float = 1.0,
        muon_info: Callable[[torch.Tensor], MatrixInfo] | None = None,
        muon_assemble=None,
    ):
        self.config = config
        self.mup_width_mult = mup_width_mult
        self.skip_non_finite = skip_non_finite
        self.non_finite: torch.Tensor | None = None
        self.precision = precision
        self.model_params: list[torch.nn.Parameter] = []
        seen = set()
        for param in model_params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            if not hasattr(param, "main_grad"):
                raise ValueError(
                    "every parameter given to the optimizer needs .main_grad; wrap the model in "
                    "DistributedDataParallel before building the optimizer."
                )
            self.model_params.append(param)
        if not self.model_params:
            raise ValueError("the optimizer got no trainable parameters.")

        # Main params: fp32 copies of low-precision params, the fp32 params themselves.
        self.main_params: list[torch.Tensor] = []
        self._lowp_model: list[torch.nn.Parameter] = []
        self._lowp_main: list[torch.Tensor] = []
        self._fp32_model: list[torch.nn.Parameter] = []
        for param in self.model_params:
            if param.dtype in _LOW_PRECISION:
                main = param.detach().clone().float()
                self._lowp_model.append(param)
                self._lowp_main.append(main)
            elif param.dtype == torch.float32:
                main = param
                self._fp32_model.append(param)
            else:
                raise ValueError(f"cannot optimize a parameter of dtype {param.dtype}; use fp32, bf16 or fp16.")
            self.main_params.append(main)
        self.grad_buffers = self._check_grad_buffers(grad_buffers)
        self._grad_copies = None  # fp32 copies of bf16/fp16 main_grads, made each step
        if any(p.main_grad.dtype != torch.float32 for p in self.model_params):
            self._grad_copies = Fp32GradCopies([p.main_grad for p in self.model_params], self.grad_buffers)
        self._attach_grads()
        self._release_fp32_grads()

        keys = [group_of(p) for p in self.model_params]
        groups = []
        for key in group_order(config):
            members = [m for m, k in zip(self.main_params, keys) if k == key]
            if members:
                groups.append({"params": members, **group_settings(key, config, mup_width_mult)})
        assert sum(len(g["params"]) for g in groups) == len(self.main_params), "group_of gave keys out of order"
        self.device = self.main_params[0].device
        muon = {}
        if config.optimizer == "muon":
            if muon_info is None:
                raise ValueError("--optimizer muon needs muon_info (build the optimizer with build_optimizer).")
            param_of = {id(m): p for m, p in zip(self.main_params, self.model_params)}
            muon = dict(info_of=lambda main: muon_info(param_of[id(main)]), assemble=muon_assemble)
        self.optimizer = _build_inner(groups, config, self.device, **muon)
        self._fused = bool(self.optimizer.param_groups[0].get("fused"))  # takes found_inf on the device
        self._fused_adam = config.optimizer == "adam" and self._fused
        self._fused_lists: tuple | None = None  # see _build_fused_lists
        self._norm_tensors = None if grad_norm_tensors is None else list(grad_norm_tensors)
        self._norm_groups = [g for g in grad_norm_groups if g is not None]
        self._norm_parts = None
        if grad_norm_parts is not None:
            self._norm_parts = [(list(t), [g for g in groups if g is not None]) for t, groups in grad_norm_parts]
            for _tensors, groups in self._norm_parts:  # fp16's overflow flag reaches every rank of each part
                self._norm_groups += [g for g in groups if all(g is not h for h in self._norm_groups)]
        if self._grad_copies is not None:
            norm_tensors = list(self._norm_tensors or []) + [t for ts, _ in self._norm_parts or [] for t in ts]
            self._grad_copies.check_known(norm_tensors)
        if preallocate_state and config.optimizer == "adam":
            self._allocate_adam_state()

        self.grad_scaler = None
        if precision.fp16:
            if precision.loss_scale is not None:
                self.grad_scaler = ConstantGradScaler(precision.loss_scale)
            else:
                self.grad_scaler = DynamicGradScaler(
                    initial_scale=precision.initial_loss_scale,
                    min_scale=precision.min_loss_scale,
                    growth_interval=precision.loss_scale_window,
                    hysteresis=precision.hysteresis,
                )

    def _check_grad_buffers(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Flat buffers that hold every ``main_grad`` (and zeros elsewhere): the gradient
        norm is then taken over them. Checked to hold every parameter's ``main_grad``."""
        buffers = list(buffers)
        if not buffers:
            return []
        ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
        for param in self.model_params:
            g = param.main_grad
            start, end = g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()
            if g.dtype != buffers[0].dtype or not any(lo <= start and end <= hi for lo, hi in ranges):
                raise ValueError("grad_buffers must hold every parameter's main_grad (pass the DDP grad buffer).")
        if sum(b.numel() for b in buffers) < sum(p.numel() for p in self.model_params):
            raise ValueError("grad_buffers are smaller than the parameters' gradients together.")
        return buffers

    # ------------------------------------------------------------------ accessors

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (the LR scheduler writes ``lr`` here)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        """Current loss scale (1.0 unless fp16)."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` for fp16, ``loss`` otherwise. Call before backward."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale

    # ------------------------------------------------------------------ step

    def _attach_grads(self) -> list[torch.Tensor]:
        """Points every main param's ``.grad`` at its model param's ``main_grad``.

        Re-done each step because the attribute is cheap to set and someone may have
        cleared ``.grad`` in between. Returns the grads in ``main_params`` order.
        bf16/fp16 ``main_grad`` tensors are given as fp32 copies made now.
        """
        if self._grad_copies is not None:
            grads = self._grad_copies.make()
            for main, grad in zip(self.main_params, grads):
                main.grad = grad
            return grads
        grads = []
        for param, main in zip(self.model_params, self.main_params):
            main.grad = param.main_grad
            grads.append(param.main_grad)
        return grads

    def _release_fp32_grads(self) -> None:
        # fp32 params were given .grad = main_grad for the step. Left in place, the next
        # backward would accumulate into main_grad through .grad and then the DDP hook
        # would add that same tensor again.
        for param in self._fp32_model:
            param.grad = None
        if self._grad_copies is not None:  # the fp32 copies live for one step
            for main in self._lowp_main:
                main.grad = None
            self._grad_copies.clear()

    def _fp32(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (gradients or grad buffers), as the fp32 tensors this step reads."""
        return list(tensors) if self._grad_copies is None else self._grad_copies.of(tensors)

    @torch.no_grad()
    def clip_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of ``grads`` (device tensor); clips if --clip-grad > 0.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_``: the clip coefficient is
        ``clamp(max_norm / (norm + 1e-6), max=1)``, computed and applied on the device.
        With fused AdamW the gradients are not rewritten: the kernel divides them by
        ``1 / coeff`` as it reads them (its ``grad_scale`` input), which saves one pass
        over every gradient per step.
        """
        # Every grad is a view into the DDP buffer(s), whose gaps stay zero: one reduction
        # over the flat buffer gives the same norm as one per tensor, in one kernel.
        if self._norm_parts is not None:
            total = self._norm_over_parts()
        elif self._norm_tensors is not None or self._norm_groups:
            total = self._model_parallel_norm(grads)
        else:
            norms = torch._foreach_norm(self._fp32(self.grad_buffers) or grads, 2)
            total = torch.linalg.vector_norm(torch.stack(list(norms)), 2)
        if self.config.clip_grad > 0:
            if self._fused_adam:
                self.optimizer.grad_scale = torch.clamp((total + 1e-6) / self.config.clip_grad, min=1.0)
                if getattr(self.optimizer, "found_inf", None) is None:
                    self.optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=total.device)
            else:
                coeff = torch.clamp(self.config.clip_grad / (total + 1e-6), max=1.0)
                torch._foreach_mul_(grads, coeff)
        return total

    def _norm_over_parts(self) -> torch.Tensor:
        """sqrt of the sum over ``grad_norm_parts`` of each part's squares, summed over its groups."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for tensors, groups in self._norm_parts:
            tensors = self._fp32(tensors)
            if tensors:
                squares = torch.stack(list(torch._foreach_norm(tensors, 2))).square().sum()
            else:
                squares = torch.zeros((), dtype=torch.float32, device=self.device)
            for group in groups:
                dist.all_reduce(squares, group=group)
            total = total + squares
        return total.sqrt()

    def _model_parallel_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """sqrt of the squared norms of this rank's part, summed over ``grad_norm_groups``."""
        if self._norm_tensors is not None:
            tensors = self._fp32(self._norm_tensors)
        else:
            tensors = self._fp32(self.grad_buffers) or grads
        if tensors:
            squares = torch.stack(list(torch._foreach_norm(tensors, 2))).square().sum()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for group in self._norm_groups:
            dist.all_reduce(squares, group=group)
        return squares.sqrt()

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> tuple[bool, torch.Tensor | None, int | None]:
        """Unscales (fp16), clips, steps the inner optimizer and updates the model params.

        Args:
            skip: Optional 0-d device flag (bool or number); with ``skip_non_finite``, a
                true value skips this update like a non-finite gradient norm does.

        Returns:
            ``(success, grad_norm, num_zeros)``. ``success`` is False only for an fp16
            step skipped on overflow; then ``grad_norm`` is None (as Megatron). Otherwise
            ``grad_norm`` is the pre-clip global norm as a 0-d device tensor: call
            ``.item()`` only when logging. ``num_zeros`` is None (not counted). A step
            skipped for a non-finite value still reports success (the host does not
            know yet); ``non_finite`` is its flag (float 0-d, 1.0 when skipped).
        """
        self.non_finite = None
        grads = self._attach_grads()
        if self.grad_scaler is not None:
            found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
            inv_scale = torch.full((1,), 1.0 / self.grad_scaler.scale, dtype=torch.float32, device=self.device)
            _unscale_and_check(grads, inv_scale, found_inf)
            for group in self._norm_groups:  # every rank of the model skips together
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
            overflow = bool(found_inf.item())  # the one host sync of fp16 training
            self.grad_scaler.update(overflow)
            if overflow:
                self._release_fp32_grads()
                return False, None, None

        grad_norm = self.clip_grad_norm(grads)
        found = None
        if self.skip_non_finite:
            bad = torch.logical_not(torch.isfinite(grad_norm))
            if skip is not None:
                bad = torch.logical_or(bad, skip.to(device=bad.device, dtype=torch.bool).reshape(()))
            found = self.non_finite = bad.to(torch.float32)
            if not self._fused and bool(found):  # the host reads it: free on the CPU
                self._release_fp32_grads()
                return True, grad_norm, None
        self._inner_step(found if self._fused else None)
        if self._lowp_model:
            # In place: model params keep their storage (graphs read them by address).
            try:
                torch._foreach_copy_(self._lowp_model, self._lowp_main)
            except (AttributeError, RuntimeError):
                for param, main in zip(self._lowp_model, self._lowp_main):
                    param.copy_(main)
        self._release_fp32_grads()
        return True, grad_norm, None

    def _inner_step(self, found_inf: torch.Tensor | None = None) -> None:
        """The inner optimizer's step; a fused kernel skips it when ``found_inf`` is 1.

        Fused AdamW with all its state in place: the two launches torch's ``AdamW.step``
        makes per group (step += 1, then ``torch._fused_adamw_``), called directly on
        lists built once. Same kernels, same arguments, bitwise the same update; it saves
        torch's per-step Python (state lookups, grouping by device and dtype), which is
        host time in a host-bound step. With ``found_inf`` the steps are counted back down
        afterwards, as torch does. Any other setting goes through
        ``self.optimizer.step()``, which reads ``found_inf`` from the optimizer.
        """
        if self._fused_lists is None and self._fused_adam:
            self._fused_lists = self._build_fused_lists()
        if not self._fused_lists:
            if found_inf is not None:
                self.optimizer.found_inf = found_inf
            self.optimizer.step()
            return
        groups, all_steps = self._fused_lists
        if self._grad_copies is not None:  # this step's fp32 copies
            groups = [(g, ps, [p.grad for p in ps], *rest) for g, ps, _grads, *rest in groups]
        grad_scale = getattr(self.optimizer, "grad_scale", None)  # clipping, as torch's step reads it
        torch._foreach_add_(all_steps, 1)
        for group, params, grads, exp_avgs, exp_avg_sqs, steps in groups:
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                amsgrad=False,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
        if found_inf is not None:
            torch._foreach_sub_(all_steps, [found_inf] * len(all_steps))

    def _build_fused_lists(self):
        """``(per group: (group, params, grads, exp_avgs, exp_avg_sqs, steps), all steps)``,
        or ``None`` (torch's own step) when a group or its state is outside the direct path."""
        if not hasattr(torch, "_fused_adamw_"):
            return None
        groups, all_steps = [], []
        for group in self.optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("differentiable"):
                return None
            if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
                return None
            states = [self.optimizer.state.get(p) for p in group["params"]]
            if not all(
                st and torch.is_tensor(st.get("step")) and st["step"].device == p.device
                for st, p in zip(states, group["params"])
            ):
                return None  # lazily allocated state: torch's first step creates it
            steps = [st["step"] for st in states]
            groups.append(
                (
                    group,
                    list(group["params"]),
                    [p.grad for p in group["params"]],
                    [st["exp_avg"] for st in states],
                    [st["exp_avg_sq"] for st in states],
                    steps,
                )
            )
            all_steps += steps
        return groups, all_steps
