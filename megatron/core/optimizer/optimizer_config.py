"""``OptimizerConfig``: the optimizer and learning-rate schedule flags (Megatron's names).

``megatron.training.arguments`` generates the flags from its fields; ``validate`` holds
the checks that read only these flags (the run config calls it with its precision).
"""

import dataclasses
import math

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.optimizer.lion import check_betas
from megatron.core.optimizer.muon import validate_muon


@dataclasses.dataclass
class OptimizerConfig(Freezable):
    """Optimizer and learning-rate schedule."""

    optimizer: str = flag_field("adam", choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"))
    """Optimizer: adam (AdamW, decoupled weight decay, as Megatron), sgd, lion (Lion with --lion-beta1 and
    --lion-beta2, decoupled weight decay), or muon (Newton-Schulz orthogonalized momentum on 2-D hidden weights, the
    --muon-scalar-optimizer elsewhere); dist_muon is the deprecated spelling of --optimizer muon
    --use-distributed-optimizer. soap and adaptive_muon are not supported yet."""

    lr: float = 1e-4
    """Peak learning rate."""

    min_lr: float = 0.0
    """Minimum learning rate at the end of decay."""

    lr_decay_style: str = flag_field("linear", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    """Learning-rate decay after warm-up: inverse-square-root is --lr times sqrt(warm-up / step), at least --min-lr;
    WSD (warm-up, stable, decay) stays at --lr until the last --lr-wsd-decay-iters of the decay, then anneals."""

    lr_wsd_decay_style: str = flag_field("exponential", choices=("exponential", "linear", "cosine", "minus_sqrt"))
    """Shape of WSD's annealing phase (exponential: 2 * 0.5^r - 1 of the way from --lr to --min-lr)."""

    lr_wsd_decay_iters: int | None = None
    """Iterations of WSD's annealing phase (the end of --lr-decay-iters)."""

    lr_wsd_decay_samples: int | None = None
    """Samples of WSD's annealing phase (with --train-samples)."""

    lr_warmup_iters: int = 0
    """Iterations of linear warm-up."""

    lr_warmup_samples: int = 0
    """Samples of linear warm-up (with --train-samples)."""

    lr_decay_samples: int | None = None
    """Samples over which to decay (with --train-samples). Defaults to --train-samples."""

    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."""

    lr_warmup_init: float = 0.0
    """Learning rate the linear warm-up starts from (it rises to --lr, or --decoupled-lr, over the warm-up)."""

    lr_decay_iters: int | None = None
    """Iterations over which to decay. Defaults to --train-iters."""

    decoupled_lr: float | None = None
    """Separate peak learning rate for the input embedding and the output layer weights (their own param
    groups, the same schedule shape)."""

    decoupled_min_lr: float | None = None
    """Minimum learning rate of the --decoupled-lr parameters. Defaults to --min-lr."""

    apply_wd_to_qk_layernorm: bool = False
    """Apply weight decay to the q/k layernorm parameters too (other norm weights and biases get none)."""

    use_checkpoint_opt_param_scheduler: bool = flag_field(
        False, aliases=("--use-checkpoint-opt-param-scheduler",), flag="--use-checkpoint-opt_param-scheduler"
    )
    """Take the learning-rate schedule (lr, min lr, warm-up, decay) from the checkpoint, not the flags."""

    override_opt_param_scheduler: bool = flag_field(
        False, aliases=("--override-opt-param-scheduler",), flag="--override-opt_param-scheduler"
    )
    """Take the learning-rate schedule from the flags even where the checkpoint's differs."""

    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norm weights)."""

    start_weight_decay: float | None = None
    """Weight decay at the start of training, with --weight-decay-incr-style linear or cosine."""

    end_weight_decay: float | None = None
    """Weight decay at the end of training (--train-iters), with --weight-decay-incr-style linear or cosine."""

    weight_decay_incr_style: str = flag_field("constant", choices=("constant", "linear", "cosine"))
    """How weight decay moves from --start-weight-decay to --end-weight-decay over training (constant:
    --weight-decay throughout)."""

    clip_grad: float = 1.0
    """Gradient clipping on the global L2 norm (0 turns it off)."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    muon_momentum: float = 0.9
    """Momentum (EMA coefficient of the gradient) of Muon."""

    muon_split_qkv: bool = flag_field(True, flag="--muon-no-split-qkv")
    """Orthogonalize the query, key and value parts of the fused QKV weight separately."""

    muon_nesterov: bool = False
    """Nesterov-style momentum in Muon: orthogonalize the gradient moved toward the momentum."""

    muon_scale_mode: str = flag_field("spectral", choices=("spectral", "unit_rms_norm", "shape_scaling"))
    """Scale of Muon's orthogonalized update of an (out, in) weight: sqrt(max(out, in)) (spectral),
    sqrt(out / in) (unit_rms_norm) or sqrt(max(1, out / in)) (shape_scaling)."""

    muon_fp32_matmul_prec: str = flag_field("medium", choices=("low", "medium", "high"))
    """fp32 matmul precision of the Newton-Schulz iteration: medium runs it in bfloat16, high in TF32 on CUDA
    (float32 on the CPU); low is refused (torch has no such precision)."""

    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficient set: simple, quintic, polar_express, cans, aol, deepseekv4 or cubic5 (5 steps)."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""

    muon_tp_mode: str = flag_field("duplicated", choices=("blockwise", "duplicated", "distributed"))
    """Newton-Schulz of a tensor-parallel weight: each shard on its own (blockwise), the whole matrix gathered on
    every TP rank (duplicated), or the whole matrix with the Gram matrices all-reduced over TP (distributed); expert
    weights split by --expert-tensor-parallel-size likewise over expert TP, each expert on its own."""

    muon_use_syrk: bool = False
    """Compute the symmetric Gram products with a SYRK kernel (Megatron: Triton on CUDA); here the same products
    through matmul."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's scaled orthogonalized update."""

    muon_scalar_optimizer: str = flag_field("adam", choices=("adam", "lion"))
    """Optimizer of the parameters Muon leaves out (embeddings, output layer, norms, biases): adam (AdamW with the
    Adam flags) or lion (Lion with --lion-beta1 and --lion-beta2)."""

    lion_beta1: float = 0.95
    """Lion's beta1 (--optimizer lion, --muon-scalar-optimizer lion): the weight of the momentum against the
    gradient inside the sign of the update."""

    lion_beta2: float = 0.98
    """Lion's beta2: the EMA coefficient of its momentum."""

    def validate(self, precision) -> None:
        """The optimizer flags' own checks (``precision``: the run's ``PrecisionConfig``); raises ``ValueError``."""
        require(self.lr >= 0 and self.min_lr >= 0, "--lr and --min-lr must be non-negative.")
        require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr}).")
        require(
            0.0 <= self.lr_warmup_init <= self.lr,
            f"--lr-warmup-init ({self.lr_warmup_init}) must be between 0 and --lr ({self.lr}): warm-up rises from it.",
        )
        require(
            not (self.lr_warmup_fraction is not None and self.lr_warmup_iters),
            "--lr-warmup-fraction and --lr-warmup-iters cannot both be set; pick one.",
        )
        require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}.")
        for name in ("adam_beta1", "adam_beta2"):
            beta = getattr(self, name)
            require(0.0 <= beta < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {beta} (e.g. 0.9).")
        require(self.adam_eps > 0, f"--adam-eps must be positive, got {self.adam_eps} (e.g. 1e-8).")
        require(
            self.weight_decay >= 0 and math.isfinite(self.weight_decay),
            f"--weight-decay must be >= 0, got {self.weight_decay} (0 turns it off).",
        )
        require(self.sgd_momentum >= 0, f"--sgd-momentum must be >= 0, got {self.sgd_momentum}.")
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            require(
                ends == (None, None),
                "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine "
                "(constant uses --weight-decay throughout).",
            )
        else:
            require(
                None not in ends and min(ends) >= 0,
                f"--weight-decay-incr-style {self.weight_decay_incr_style} needs --start-weight-decay and "
                "--end-weight-decay (both >= 0).",
            )
        if self.lr_decay_style == "WSD":
            require(
                self.lr_wsd_decay_iters is not None or self.lr_wsd_decay_samples is not None,
                "--lr-decay-style WSD needs the length of its annealing phase: --lr-wsd-decay-iters (or "
                "--lr-wsd-decay-samples with --train-samples).",
            )
        require(
            math.isfinite(self.lr) and math.isfinite(self.min_lr),
            f"--lr ({self.lr}) and --min-lr ({self.min_lr}) must be finite.",
        )
        require(
            self.optimizer not in ("soap", "adaptive_muon"),
            f"--optimizer {self.optimizer} is not supported yet; use adam, sgd, lion or muon.",
        )
        if self.optimizer == "muon":
            validate_muon(self, precision)
        if self.optimizer == "lion":
            check_betas(self.lion_beta1, self.lion_beta2)
        require(
            self.decoupled_min_lr is None or self.decoupled_lr is not None,
            "--decoupled-min-lr needs --decoupled-lr.",
        )
        if self.decoupled_lr is not None:
            require(
                self.decoupled_lr >= 0 and math.isfinite(self.decoupled_lr),
                f"--decoupled-lr must be finite and >= 0, got {self.decoupled_lr}.",
            )
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            require(
                0 <= low <= self.decoupled_lr,
                f"the embedding/output minimum lr ({low}: --decoupled-min-lr, default --min-lr) must be in "
                f"[0, --decoupled-lr ({self.decoupled_lr})]; pass --decoupled-min-lr.",
            )
