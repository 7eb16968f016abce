"""Mixture-of-Experts flags: experts, router, load balancing, dispatcher, capacity.

Field names and defaults are Megatron's (``--num-experts`` fills ``num_moe_experts``).
The model reads them as ``TransformerConfig.moe``. Unusual here: ``--moe-layer-freq``
takes an int or a Python list expression such as ``([0]*1+[1]*3)``; the expression is
parsed with ``ast`` and only list literals, integers, ``+`` and ``*`` are evaluated
(no ``eval``). ``finalize()`` turns it into ``moe_layer_pattern`` (one 0/1 per layer).
"""

import ast
import dataclasses
import warnings

from megatron.core.config_utils import Freezable, flag_field, require

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

# Name of each load-balancing loss in the log line and TensorBoard (Megatron's names).
AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def parse_moe_layer_freq(value, num_layers: int) -> list[int]:
    """``--moe-layer-freq`` -> one 0 (dense) or 1 (MoE) per layer.

    Args:
        value: An int N (every N-th layer, starting with the first, is MoE), its string,
            a list of 0/1, or a list expression string such as ``"([0]*1+[1]*3)*2"``.
        num_layers: Number of transformer layers; a pattern must have this length.

    Raises:
        ValueError: For anything else, naming the flag.
    """
    if isinstance(value, str):
        text = value.strip()
        if "[" not in text:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(
                    f"--moe-layer-freq {value!r}: expected an int or a list expression such as ([0]*1+[1]*3)."
                ) from None
        else:
            value = eval_list_expression(text)
    if isinstance(value, bool) or not isinstance(value, int | list):
        raise ValueError(f"--moe-layer-freq {value!r}: expected an int or a list of 0/1.")
    if isinstance(value, int):
        require(value >= 1, f"--moe-layer-freq must be >= 1, got {value}.")
        return [1 if i % value == 0 else 0 for i in range(num_layers)]
    require(
        all(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1) for v in value),
        f"--moe-layer-freq pattern {value} may only hold 0 (dense layer) and 1 (MoE layer).",
    )
    require(
        len(value) == num_layers,
        f"--moe-layer-freq pattern has {len(value)} entries but --num-layers is {num_layers}; give one 0/1 per layer.",
    )
    return list(value)


def eval_list_expression(text: str, flag: str = "--moe-layer-freq") -> list:
    """Evaluates list literals of ints combined with ``+`` and ``*``; nothing else (errors name ``flag``)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"{flag} {text!r} is not a valid expression: {exc.msg}.") from None

    def ev(node):
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                if isinstance(left, list) and isinstance(right, list):
                    return left + right
                if isinstance(left, int) and isinstance(right, int):
                    return left + right
            elif isinstance(left, int) and isinstance(right, int):
                return left * right
            elif isinstance(left, list) != isinstance(right, list):
                seq, count = (left, right) if isinstance(left, list) else (right, left)
                if count <= 100_000:
                    return seq * count
        raise ValueError(
            f"{flag} {text!r}: only list literals, integers, + and * are allowed (found {type(node).__name__})."
        )

    result = ev(tree.body)
    if not isinstance(result, list):
        raise ValueError(f"{flag} {text!r} must evaluate to a list, got {result!r}.")
    return result


@dataclasses.dataclass
class MoEConfig(Freezable):
    """Mixture of Experts: experts, router, load balancing, token dispatcher."""

    num_moe_experts: int | None = flag_field(None, flag="--num-experts")
    """Number of experts in each MoE layer. Unset: a dense model."""

    moe_layer_freq: str = "1"
    """Which layers are MoE: an int N (every N-th layer, starting with the first) or a list
    expression with one 0/1 per layer, e.g. ([0]*1+[1]*3)."""

    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert's MLP. Defaults to --ffn-hidden-size."""

    moe_shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared experts (num shared experts x size of each). Unset: none."""

    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by a learned sigmoid gate per token."""

    moe_router_topk: int = 2
    """Number of experts each token is routed to."""

    moe_router_score_function: str = flag_field("softmax", choices=("softmax", "sigmoid", "sqrtsoftplus"))
    """Score function of the router."""

    moe_router_pre_softmax: bool = False
    """Apply the score function before the top-k selection (by default softmax runs after it)."""

    moe_router_topk_scaling_factor: float | None = None
    """Scale the selected routing probabilities by this factor. Defaults to no scaling."""

    moe_router_num_groups: int | None = None
    """Group-limited routing: number of expert groups (e.g. the EP size for device-limited routing)."""

    moe_router_group_topk: int | None = None
    """Group-limited routing: number of groups each token may pick experts from."""

    moe_router_force_load_balancing: bool = False
    """Benchmarks only: route by random logits (a standard normal per token and expert)
    instead of the router's, so every expert gets about as many tokens; gradients flow to
    the router as if its own logits had been used (straight-through)."""

    moe_layer_recompute: bool = False
    """Megatron's deprecated switch for --recompute-granularity selective --recompute-modules moe (added to
    the given or default modules), with its warning."""

    moe_apply_probs_on_input: bool = False
    """Scale each expert's input by the token's routing probability instead of the activation (top-1 routing)."""

    moe_input_jitter_eps: float | None = None
    """Multiply the router's input by noise drawn uniformly from [1 - eps, 1 + eps] (Switch Transformer's
    jitter; the default generator, as Megatron, which jitters evaluation too)."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing: a per-expert bias, updated from the token counts after each
    step, shifts the top-k selection (sigmoid or sqrtsoftplus scores)."""

    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update."""

    moe_router_load_balancing_type: list[str] = flag_field(
        default_factory=lambda: ["aux_loss"], nargs="+", choices=(*LOAD_BALANCING_TYPES, "sinkhorn")
    )
    """Load-balancing loss(es): aux_loss (per micro-batch), seq_aux_loss (per sequence),
    global_aux_loss (over the global batch) or none; several may be combined. sinkhorn
    (alone): S-BASE routing, top-k over the Sinkhorn-balanced logits in training."""

    moe_aux_loss_coeff: list[float] = flag_field(default_factory=lambda: [0.0], nargs="+")
    """Coefficient of each load-balancing loss (one per --moe-router-load-balancing-type)."""

    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss. Unset: no z-loss."""

    moe_router_dtype: str | None = flag_field(None, choices=("fp32", "fp64"))
    """Precision of the router logits, routing and probabilities. Defaults to the model dtype."""

    moe_grouped_gemm: bool = False
    """Run the local experts as grouped GEMMs (torch grouped_mm on CUDA; a loop elsewhere)."""

    moe_token_dispatcher_type: str = flag_field("allgather", choices=("allgather", "alltoall", "flex"))
    """Token dispatcher across expert-parallel ranks. flex (Megatron's DeepEP / HybridEP / NCCL EP kernels)
    runs the alltoall dispatcher here: the same tokens reach the same experts with the same probabilities
    and are combined the same way, exchanged with torch.distributed all-to-all."""

    moe_flex_dispatcher_backend: str = flag_field("deepep", choices=("deepep", "hybridep", "ncclep"))
    """Kernels of --moe-token-dispatcher-type flex in Megatron. Every backend runs the alltoall
    dispatcher here; the flag combinations Megatron refuses for a backend are refused too."""

    moe_enable_deepep: bool = False
    """Deprecated in Megatron for --moe-flex-dispatcher-backend deepep; needs --moe-token-dispatcher-type flex."""

    moe_flex_dispatcher_num_sms: int | None = None
    """SMs of the flex dispatcher's communication kernels in Megatron; no effect here (no such kernels)."""

    moe_deepep_num_sms: int | None = None
    """Deprecated in Megatron for --moe-flex-dispatcher-num-sms; no effect here."""

    moe_hybridep_num_sms: int | None = None
    """Deprecated in Megatron for --moe-flex-dispatcher-num-sms; no effect here."""

    moe_ncclep_zero_copy: bool = False
    """NCCL EP's zero-copy symmetric-memory buffers in Megatron; with the ncclep backend it needs
    --moe-expert-rank-capacity-factor (not supported yet), other backends ignore it."""

    moe_expert_capacity_factor: float | None = None
    """Capacity of each expert as a multiple of its even share of tokens; tokens beyond it are
    dropped. Unset: dropless."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (static shapes; needs --moe-expert-capacity-factor)."""

    moe_token_drop_policy: str = flag_field("probs", choices=("probs", "position"))
    """Which tokens are dropped over capacity: those with the lowest probabilities, or the last ones."""

    moe_per_layer_logging: bool = False
    """Also write each MoE layer's losses to TensorBoard / W&B, as moe/<name>_layer_<i> (i: the layer's
    0-based index), at every log line."""

    moe_layer_pattern: list[int] | None = flag_field(None, no_flag=True)
    """Derived from --moe-layer-freq: 1 for an MoE layer, 0 for a dense one."""

    @property
    def enabled(self) -> bool:
        return self.num_moe_experts is not None

    def aux_loss_coeffs(self) -> dict[str, float]:
        """Load-balancing type -> coefficient, for the types with a positive coefficient."""
        types = list(self.moe_router_load_balancing_type)
        coeffs = list(self.moe_aux_loss_coeff)
        if len(coeffs) == 1 and len(types) > 1:
            coeffs = coeffs * len(types)
        return {t: c for t, c in zip(types, coeffs) if t in AUX_LOSS_NAMES and c > 0}

    def metric_names(self) -> list[str]:
        """The losses the log line reports, Megatron's names, in the statistics' order."""
        coeffs = self.aux_loss_coeffs()
        names = [AUX_LOSS_NAMES[t] for t in ("aux_loss", "seq_aux_loss", "global_aux_loss") if t in coeffs]
        if self.moe_z_loss_coeff is not None:
            names.append("z_loss")
        return names

    @property
    def sinkhorn(self) -> bool:
        """``--moe-router-load-balancing-type sinkhorn``: Sinkhorn routing instead of top-k."""
        return "sinkhorn" in self.moe_router_load_balancing_type

    @property
    def drop_and_pad(self) -> bool:
        """Static expert inputs: capacity factor set and inputs padded to capacity."""
        return self.moe_expert_capacity_factor is not None and self.moe_pad_expert_input_to_capacity

    @property
    def flex_backend(self) -> str:
        """The flex dispatcher's backend: deepep when the deprecated --moe-enable-deepep is given."""
        return "deepep" if self.moe_enable_deepep else self.moe_flex_dispatcher_backend

    def _validate_flex_flags(self) -> None:
        """Megatron's checks of the flex-dispatcher flags that hold with or without experts."""
        flex = self.moe_token_dispatcher_type == "flex"
        if self.moe_enable_deepep:
            require(
                flex,
                "--moe-enable-deepep needs --moe-token-dispatcher-type flex (as in Megatron); it is deprecated "
                "there: pass --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep, or drop it.",
            )
            require(
                self.moe_flex_dispatcher_backend != "hybridep",
                "--moe-enable-deepep cannot be combined with --moe-flex-dispatcher-backend hybridep (the flex "
                "dispatcher has one backend); drop --moe-enable-deepep.",
            )
        if self.moe_flex_dispatcher_backend == "ncclep":
            require(
                flex,
                "--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex (as in Megatron); "
                "drop the backend or pass --moe-token-dispatcher-type flex.",
            )
        deprecated = {
            flag: value
            for flag, value in (
                ("--moe-deepep-num-sms", self.moe_deepep_num_sms),
                ("--moe-hybridep-num-sms", self.moe_hybridep_num_sms),
            )
            if value is not None
        }
        if self.moe_flex_dispatcher_num_sms is None and len(set(deprecated.values())) > 1:
            given = " and ".join(f"{flag} {value}" for flag, value in deprecated.items())
            raise ValueError(
                f"{given} conflict (both are deprecated in Megatron); pass one --moe-flex-dispatcher-num-sms N instead."
            )
        if flex and self.flex_backend == "deepep":
            require(
                not self.moe_pad_expert_input_to_capacity,
                "--moe-token-dispatcher-type flex with the deepep backend does not support "
                "--moe-pad-expert-input-to-capacity (as in Megatron); use --moe-flex-dispatcher-backend hybridep "
                "or --moe-token-dispatcher-type alltoall.",
            )

    def _validate_flex_layout(self, etp_times_ep: int) -> None:
        """Megatron's checks when the flex dispatcher of an MoE layer is built."""
        backend = self.flex_backend
        if backend in ("deepep", "ncclep"):
            require(
                etp_times_ep > 1,
                f"--moe-token-dispatcher-type flex with the {backend} backend needs --expert-tensor-parallel-size x "
                "--expert-model-parallel-size > 1 (as in Megatron); raise --expert-model-parallel-size, or use "
                "--moe-flex-dispatcher-backend hybridep or --moe-token-dispatcher-type alltoall.",
            )
        if backend == "ncclep":
            require(
                self.moe_expert_capacity_factor is None and not self.moe_pad_expert_input_to_capacity,
                "--moe-flex-dispatcher-backend ncclep does not support token dropping (as in Megatron): drop "
                "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity, or use the deepep or "
                "hybridep backend.",
            )
            require(
                not self.moe_ncclep_zero_copy,
                "--moe-ncclep-zero-copy needs --moe-expert-rank-capacity-factor (as in Megatron), which is not "
                "supported yet; drop --moe-ncclep-zero-copy.",
            )

    def finalize(self, model) -> "MoEConfig":
        """Fills derived fields from the model config. Idempotent; returns self."""
        if self.moe_layer_recompute:
            self._recompute_moe_layers(model)
        if not self.enabled:
            return self
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = model.ffn_hidden_size
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None  # Megatron: a negative factor means dropless
        pattern = parse_moe_layer_freq(self.moe_layer_freq, model.num_layers)
        if self.moe_layer_pattern != pattern:  # a second call writes nothing (the config may be frozen)
            self.moe_layer_pattern = pattern
        return self

    @staticmethod
    def _recompute_moe_layers(model) -> None:
        """``--moe-layer-recompute``, Megatron's deprecated spelling of selective recompute of ``moe``."""
        modules = list(model.recompute_modules or ["core_attn"])  # core_attn: the default modules
        if model.recompute_granularity == "selective" and "moe" in modules:
            return  # done (a second call writes nothing: the config may be frozen)
        if model.recompute_granularity == "full":
            raise ValueError("Do not set --moe-layer-recompute with --recompute-granularity full.")
        warnings.warn(
            "--moe-layer-recompute is deprecated. Use --recompute-granularity selective --recompute-modules moe "
            "instead.",
            stacklevel=3,
        )
        model.recompute_granularity = "selective"
        model.recompute_modules = [*modules, "moe"] if "moe" not in modules else modules

    def validate(self, model, expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int = 1) -> None:
        """Raises ``ValueError`` for inconsistent MoE flags (call after ``finalize``)."""
        self._validate_flex_flags()
        eps = self.moe_input_jitter_eps
        require(eps is None or 0 <= eps < 1, f"--moe-input-jitter-eps must be in [0, 1), got {eps}.")
        require(
            not self.moe_apply_probs_on_input or self.moe_router_topk == 1,
            f"--moe-apply-probs-on-input needs --moe-router-topk 1 (Megatron's rule), got {self.moe_router_topk}.",
        )
        if not self.enabled:
            require(
                self.moe_ffn_hidden_size is None and self.moe_shared_expert_intermediate_size is None,
                "--moe-ffn-hidden-size / --moe-shared-expert-intermediate-size need --num-experts N.",
            )
            require(
                expert_model_parallel_size == 1,
                "--expert-model-parallel-size > 1 needs --num-experts N (an MoE model).",
            )
            return
        e, k = self.num_moe_experts, self.moe_router_topk
        if self.moe_token_dispatcher_type == "flex":
            self._validate_flex_layout(expert_model_parallel_size * expert_tensor_parallel_size)
        require(e >= 1, f"--num-experts must be >= 1, got {e}.")
        require(1 <= k <= e, f"--moe-router-topk ({k}) must be between 1 and --num-experts ({e}).")
        require(
            e % expert_model_parallel_size == 0,
            f"--num-experts ({e}) must be divisible by --expert-model-parallel-size "
            f"({expert_model_parallel_size}); every expert-parallel rank holds the same number of experts.",
        )
        require(self.moe_ffn_hidden_size > 0, "--moe-ffn-hidden-size must be positive.")
        etp = expert_tensor_parallel_size
        if etp > 1:
            require(
                self.moe_ffn_hidden_size % etp == 0,
                f"--moe-ffn-hidden-size ({self.moe_ffn_hidden_size}) must be divisible by "
                f"--expert-tensor-parallel-size ({etp}, which defaults to --tensor-model-parallel-size).",
            )
            require(
                not model.add_bias_linear,
                f"biases in experts split over --expert-tensor-parallel-size {etp} (which defaults to "
                "--tensor-model-parallel-size) are not supported yet; pass --disable-bias-linear "
                "or --expert-tensor-parallel-size 1.",
            )
        if self.moe_shared_expert_intermediate_size is not None:
            require(
                self.moe_shared_expert_intermediate_size > 0,
                "--moe-shared-expert-intermediate-size must be positive.",
            )
        types = list(self.moe_router_load_balancing_type)
        for t in types:
            require(
                t in LOAD_BALANCING_TYPES or t == "sinkhorn",
                f"--moe-router-load-balancing-type {t} is not supported; use one of "
                f"{' '.join(LOAD_BALANCING_TYPES)} sinkhorn.",
            )
        if self.sinkhorn:
            require(
                types == ["sinkhorn"],
                "--moe-router-load-balancing-type sinkhorn replaces the top-k routing and cannot be combined "
                f"with other types (got {' '.join(types)}).",
            )
            require(
                all(c == 0 for c in self.moe_aux_loss_coeff),
                "Sinkhorn routing does not support aux loss: pass --moe-aux-loss-coeff 0 with "
                "--moe-router-load-balancing-type sinkhorn.",
            )
            require(
                self.moe_expert_capacity_factor is None,
                "--moe-expert-capacity-factor only works with aux_loss, seq_aux_loss, global_aux_loss or none "
                "load balancing, not sinkhorn.",
            )
        require(
            len(self.moe_aux_loss_coeff) in (1, len(types)),
            f"--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type "
            f"({len(types)}), got {len(self.moe_aux_loss_coeff)}.",
        )
        require(all(c >= 0 for c in self.moe_aux_loss_coeff), "--moe-aux-loss-coeff must be >= 0.")
        require(self.moe_z_loss_coeff is None or self.moe_z_loss_coeff >= 0, "--moe-z-loss-coeff must be >= 0.")
        if k == 1 and self.moe_router_score_function == "softmax" and not self.sinkhorn:
            require(
                self.moe_router_pre_softmax,
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax "
                "(a softmax over one selected logit has zero gradient).",
            )
        if self.moe_router_group_topk is not None or self.moe_router_num_groups is not None:
            g, gk = self.moe_router_num_groups, self.moe_router_group_topk
            require(
                g is not None and gk is not None,
                "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk.",
            )
            require(g >= 1 and e % g == 0, f"--num-experts ({e}) must be divisible by --moe-router-num-groups ({g}).")
            require(
                1 <= gk <= g,
                f"--moe-router-group-topk ({gk}) must be between 1 and --moe-router-num-groups ({g}).",
            )
            require(
                k % gk == 0 and k // gk <= e // g,
                f"--moe-router-topk ({k}) must be a multiple of --moe-router-group-topk ({gk}) "
                f"and at most {gk} x the group size ({e // g}).",
            )
        if self.moe_router_enable_expert_bias:
            require(
                self.moe_router_score_function in ("sigmoid", "sqrtsoftplus"),
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (or sqrtsoftplus).",
            )
        if self.moe_pad_expert_input_to_capacity:
            require(
                self.moe_expert_capacity_factor is not None,
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor X.",
            )
        if self.moe_expert_capacity_factor is not None:
            require(self.moe_expert_capacity_factor > 0, "--moe-expert-capacity-factor must be positive.")
        require(
            self.moe_layer_pattern is not None and len(self.moe_layer_pattern) == model.num_layers,
            "MoEConfig.finalize(model) must run before validate.",
        )


OVERLAP_SWITCHES = ("--moe-shared-expert-overlap", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute")
"""Megatron's MoE communication-overlap switches. They only reorder work against the
expert-parallel all-to-all (the same values), so they are accepted with no effect here;
``validate_overlap_switches`` still refuses what Megatron refuses."""


def validate_overlap_switches(given, moe: MoEConfig, model, parallel, half_precision: bool) -> None:
    """Megatron's rules for the MoE overlap and kernel switches (accepted, no effect), on the ones ``given``.

    Args:
        given: Flags given on the command line (``RunConfig.ignored_flags``).
        moe: The MoE config.
        model: The transformer config (recompute settings).
        parallel: The parallel config (pipeline, virtual pipeline and expert sizes).
        half_precision: Whether ``--bf16`` or ``--fp16`` is on.

    Raises:
        ValueError: Naming the switch, what it needs and the fix.
    """
    given = set(given)
    if "--moe-shared-expert-overlap" in given and moe.moe_shared_expert_intermediate_size is not None:
        require(
            moe.moe_token_dispatcher_type in ("alltoall", "flex"),
            "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type alltoall or flex (as in "
            "Megatron).",
        )
    if "--delay-wgrad-compute" in given:
        require(
            "--overlap-moe-expert-parallel-comm" in given,
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (as in Megatron).",
        )
    for kernel in ("--moe-use-grouped-tensor", "--moe-single-grouped-weight", "--moe-single-grouped-bias"):
        require(kernel not in given or moe.moe_grouped_gemm, f"{kernel} needs --moe-grouped-gemm (as in Megatron).")
    if "--overlap-dispatch-backward-with-experts-wgrad" in given:
        for other in ("--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"):
            require(
                other not in given,
                f"--overlap-dispatch-backward-with-experts-wgrad and {other} cannot be combined (as in Megatron).",
            )
    if "--ep-overlap-early-attn-memory-release" in given:
        require(
            "--overlap-moe-expert-parallel-comm" in given,
            "--ep-overlap-early-attn-memory-release needs --overlap-moe-expert-parallel-comm (as in Megatron).",
        )
    if "--overlap-moe-expert-parallel-comm" not in given:
        return
    flag = "--overlap-moe-expert-parallel-comm"
    if parallel.pipeline_model_parallel_size > 1:
        require(
            parallel.virtual_pipeline_model_parallel_size is not None,
            f"{flag} with --pipeline-model-parallel-size > 1 needs virtual pipeline stages "
            "(--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank or a "
            "--pipeline-model-parallel-layout of more stages than ranks), as in Megatron.",
        )
    require(
        parallel.expert_model_parallel_size > 1,
        f"{flag} overlaps the expert-parallel all-to-all: it needs --expert-model-parallel-size > 1.",
    )
    require(
        moe.moe_token_dispatcher_type in ("alltoall", "flex"),
        f"{flag} needs --moe-token-dispatcher-type alltoall or flex (as in Megatron).",
    )
    require(
        model.recompute_granularity != "full" and model.recompute_method is None and model.recompute_num_layers is None,
        f"{flag} cannot be combined with full recomputation: drop --recompute-granularity full, "
        "--recompute-method and --recompute-num-layers (as in Megatron).",
    )
    require(half_precision, f"{flag} needs --bf16 or --fp16 (as in Megatron).")
    require(
        "--moe-shared-expert-overlap" not in given,
        f"{flag} and --moe-shared-expert-overlap cannot be combined; drop --moe-shared-expert-overlap.",
    )
