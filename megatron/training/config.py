"""Training-side configuration: batch, optimizer, precision, DDP, data, logging, checkpoints.

One small dataclass per concern; ``megatron.training.arguments`` generates the flags.
``RunConfig`` bundles every concern (model, parallel and cuda-graph configs live with
the core code they configure) and runs the cross-concern checks.

A run's config goes through four steps, once each: ``parse_args`` fills the
dataclasses; ``RunConfig.resolve(world_size)`` returns a copy with every derived value
computed (defaults that depend on other flags, the data-parallel sizes, the dtype, the
iteration count); ``validate()`` only reads and raises ``ValueError`` naming the flag;
the trainer sets the padded vocabulary size from the tokenizer and calls ``freeze()``,
after which assigning a field raises.
"""

import copy
import dataclasses
import math
import warnings

import torch

from megatron.core.config_utils import Freezable, flag_field, freeze, require
from megatron.core.datasets.builder import parse_split
from megatron.core.datasets.fim import validate_fim_config
from megatron.core.optimizer.muon import validate_muon
from megatron.core.parallel_state import ParallelConfig
from megatron.core.ssm.gated_delta_net.config import LinearAttentionConfig
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.tokenizers.tokenizer import TOKENIZER_TYPES
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.moe.moe_config import MoEConfig, validate_overlap_switches
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.batch_schedule import BatchSchedule, parse_step_schedule


@dataclasses.dataclass
class TrainingConfig(Freezable):
    """Batch sizes, iteration count and determinism."""

    micro_batch_size: int = 2
    """Batch size per model instance (per data-parallel rank) and micro-batch."""

    global_batch_size: int | None = None
    """Samples per optimizer step across all ranks. Defaults to micro batch * DP."""

    rampup_batch_size: list[int] | None = flag_field(None, nargs=3)
    """Batch-size ramp-up: START INCREMENT SAMPLES grows the global batch from START by INCREMENT
    over SAMPLES samples, in equal steps, then holds --global-batch-size."""

    step_batch_size_schedule: str | None = None
    """Step-wise global batch size: "THRESHOLD:BATCH ..." (e.g. "0:384 200B:768"), thresholds in tokens
    (K/M/B/T suffixes) from which the batch applies; replaces --global-batch-size."""

    train_iters: int | None = None
    """Number of training iterations (or give --train-samples). Defaults to 100 here when neither is set."""

    train_samples: int | None = None
    """Number of training samples; iterations follow from the (ramped) global batch size."""

    calculate_per_token_loss: bool = False
    """Average the loss over all tokens of the global batch instead of per micro-batch and then over
    micro-batches (the same when every micro-batch has as many loss tokens)."""

    manual_gc: bool = False
    """Turn Python's automatic garbage collector off and collect every --manual-gc-interval iterations."""

    manual_gc_interval: int = 0
    """Iterations between manual collections with --manual-gc (0: only at the start)."""

    exit_duration_in_mins: int | None = None
    """Exit (saving a checkpoint when --save is set) once training has run this many minutes."""

    eval_global_batch_size: int | None = None
    """Global batch size of evaluation. Defaults to --global-batch-size."""

    seed: int = 1234
    """Random seed for initialisation, data and dropout."""

    deterministic_mode: bool = False
    """Use deterministic kernels (torch.use_deterministic_algorithms) for bitwise-repeatable runs."""

    exit_interval: int | None = None
    """Exit after the iteration that is a multiple of this value."""

    exit_duration_in_mins: float | None = None
    """Save and exit once the run has trained this many minutes (checked after every iteration)."""

    exit_signal_handler: bool = False
    """On SIGTERM, save a checkpoint at the end of the current iteration and exit with status 0."""

    eval_interval: int = 1000
    """Iterations between evaluations on the validation split."""

    eval_iters: int = 0
    """Global batches per evaluation (0 turns evaluation off)."""

    use_cpu: bool = False
    """Train on the CPU even when CUDA is available."""

    rerun_mode: str = flag_field(
        "validate_results", choices=("disabled", "validate_results", "report_determinism_stats", "report_stats")
    )
    """Re-run an iteration whose loss fails a check, from the same state, to tell a transient fault from a
    reproducible result (validate_results), re-run every iteration to report non-determinism
    (report_determinism_stats; report_stats is the same), or never (disabled)."""

    error_injection_rate: int = 0
    """Inject a rejected result into about one in this many loss checks (0: never), to test --rerun-mode."""

    error_injection_type: str = flag_field(
        "transient_error", choices=("correct_result", "transient_error", "persistent_error")
    )
    """What an injected result turns out to be when re-run."""

    check_for_spiky_loss: bool = False
    """Validate the loss against 10x the largest of its first 100 values (re-run with --rerun-mode
    validate_results; training continues whatever the re-run shows)."""


@dataclasses.dataclass
class OptimizerConfig(Freezable):
    """Optimizer and learning-rate schedule."""

    optimizer: str = flag_field("adam", choices=("adam", "sgd", "muon", "dist_muon"))
    """Optimizer: adam (AdamW, decoupled weight decay, as Megatron), sgd, or muon (Newton-Schulz orthogonalized
    momentum on 2-D hidden weights, the --muon-scalar-optimizer elsewhere); dist_muon is the deprecated spelling of
    --optimizer muon --use-distributed-optimizer."""

    lr: float = 1e-4
    """Peak learning rate."""

    min_lr: float = 0.0
    """Minimum learning rate at the end of decay."""

    lr_decay_style: str = flag_field("linear", choices=("constant", "linear", "cosine"))
    """Learning-rate decay after warm-up."""

    lr_warmup_iters: int = 0
    """Iterations of linear warm-up."""

    lr_warmup_samples: int = 0
    """Samples of linear warm-up (with --train-samples)."""

    lr_decay_samples: int | None = None
    """Samples over which to decay (with --train-samples). Defaults to --train-samples."""

    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."""

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
    every TP rank (duplicated), or the whole matrix with the Gram matrices all-reduced over TP (distributed)."""

    muon_use_syrk: bool = False
    """Compute the symmetric Gram products with a SYRK kernel (Megatron: Triton on CUDA); here the same products
    through matmul."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's scaled orthogonalized update."""

    muon_scalar_optimizer: str = flag_field("adam", choices=("adam", "lion"))
    """Optimizer of the parameters Muon leaves out (embeddings, output layer, norms, biases): adam (lion is not
    supported yet)."""


@dataclasses.dataclass
class PrecisionConfig(Freezable):
    """Mixed precision and loss scaling."""

    bf16: bool = False
    """bfloat16 model with fp32 main parameters in the optimizer."""

    fp16: bool = False
    """float16 model with fp32 main parameters and loss scaling."""

    loss_scale: float | None = None
    """Static loss scale for fp16 (default: dynamic loss scaling)."""

    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale."""

    min_loss_scale: float = 1.0
    """Minimum dynamic loss scale."""

    loss_scale_window: int = 1000
    """Iterations without overflow before the dynamic loss scale grows."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic loss scale shrinks."""

    accumulate_allreduce_grads_in_fp32: bool = True
    """Keep main_grad buffers in fp32 (reduced-precision grad buffers are not supported yet)."""

    attention_softmax_in_fp32: bool = True
    """Softmax in fp32 (SDPA always accumulates in fp32; kept for Megatron command lines)."""

    @property
    def params_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return torch.float32


@dataclasses.dataclass
class DDPConfig(Freezable):
    """Data-parallel gradient reduction."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient all-reduce of each bucket with the rest of backward."""

    ddp_bucket_size: int | None = None
    """Elements per gradient bucket (default: max(40M, 1M * DP))."""

    use_distributed_optimizer: bool = False
    """Shard the fp32 main parameters and the optimizer state across data-parallel ranks
    (gradients reduce-scattered, parameters all-gathered after the step)."""

    overlap_param_gather: bool = False
    """With --use-distributed-optimizer: overlap the parameter all-gather with the next forward."""

    ddp_average_in_collective: bool = False
    """Average the gradients inside the data-parallel collective (ReduceOp.AVG) instead of scaling them
    by 1/DP first and summing."""

    check_for_nan_in_loss_and_grad: bool = flag_field(True, flag="--no-check-for-nan-in-loss-and-grad")
    """Raise when the loss or the gradient norm is NaN."""


@dataclasses.dataclass
class DataConfig(Freezable):
    """Data and tokenizer."""

    mock_data: bool = False
    """Train on Megatron-style synthetic documents (no files needed)."""

    data_path: list[str] = flag_field(default_factory=list, nargs="*")
    """Dataset prefix, or a weighted blend: 0.3 prefixA 0.7 prefixB."""

    split: str = "969,30,1"
    """Train/valid/test split of each dataset, as weights."""

    data_cache_path: str | None = None
    """Folder for the cached document/sample/shuffle indices."""

    tokenizer_type: str | None = flag_field(
        None,
        choices=(
            "NullTokenizer",
            "ByteLevelTokenizer",
            "GPT2BPETokenizer",
            "HuggingFaceTokenizer",
            # Megatron's other tokenizers: they parse and are refused in validate().
            "BertWordPieceLowerCase",
            "BertWordPieceCase",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
            "MultimodalTokenizer",
            "NullMultimodalTokenizer",
            "SFTTokenizer",
        ),
    )
    """Tokenizer. Defaults to GPT2BPETokenizer with --vocab-file/--merge-file, else NullTokenizer."""

    vocab_size: int | None = None
    """Vocabulary size of NullTokenizer: ids 0..N-1, the last one (N-1) the end-of-document token."""

    vocab_file: str | None = None
    """GPT-2 BPE vocab.json."""

    merge_file: str | None = None
    """GPT-2 BPE merges.txt."""

    tokenizer_model: str | None = None
    """Hugging Face tokenizer.json."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary so its size is divisible by this value (times TP)."""

    num_workers: int = 2
    """Data-loader worker processes."""

    fim_data: bool = False
    """Fill-in-the-middle: rewrite training samples as prefix/suffix/middle (PSM) or suffix/prefix/middle (SPM)."""

    fim_rate: float = 0.5
    """Probability to convert a training sample (each document in it) into a FIM format."""

    fim_spm_rate: float = 0.5
    """Probability that a FIM sample uses the SPM format over the PSM format."""

    fim_split_sample: str | None = None
    """Token around which to split the sample for FIM (each fragment permuted on its own)."""

    fim_fragment_rate: float | None = None
    """Rate of FIM on each fragment when --fim-split-sample is set."""

    fim_no_prefix: str | None = None
    """Do not apply FIM to fragments whose text starts with this prefix."""

    fim_prefix_token: str = "<fim_prefix>"
    """FIM prefix token (a token of the tokenizer's vocabulary)."""

    fim_middle_token: str = "<fim_middle>"
    """FIM middle token."""

    fim_suffix_token: str = "<fim_suffix>"
    """FIM suffix token."""

    fim_pad_token: str = "<fim_pad>"
    """FIM pad token: fills a rewritten sample back to the sequence length."""

    fim_eod_token: str = "<|endoftext|>"
    """FIM end-of-document token: documents in a sample are rewritten one by one between these."""


@dataclasses.dataclass
class LoggingConfig(Freezable):
    """Logging, metrics and TensorBoard."""

    log_interval: int = 100
    """Iterations between log lines."""

    log_throughput: bool = False
    """Add TFLOP/s per GPU to the log line."""

    log_memory_interval: int | None = None
    """Iterations between memory lines (default: after the first iteration and when graphs are captured)."""

    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (needs the tensorboard package)."""

    log_memory_to_tensorboard: bool = False
    """Also write memory scalars (mem-*-bytes, graph pool bytes) to TensorBoard."""

    metrics_file: str | None = None
    """Write one JSON object per logged iteration to this file (JSONL)."""

    log_params_norm: bool = False
    """Add the parameter L2 norm to the log line."""

    log_num_zeros_in_grad: bool = False
    """Count the zeros in the (clipped) gradients and add them to the log line."""

    timing_log_level: int = flag_field(0, choices=(0, 1, 2))
    """Timers to print with each log line: 0 the iteration time only, 1 the main parts of a step,
    2 also finer ones. Timers synchronise the device, so higher levels cost speed."""

    timing_log_option: str = flag_field("minmax", choices=("max", "minmax", "all"))
    """How timers are reduced across ranks: max, min and max, or every rank."""

    log_timers_to_tensorboard: bool = False
    """Write the timers to TensorBoard."""

    log_validation_ppl_to_tensorboard: bool = False
    """Write the validation perplexity to TensorBoard."""

    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard writes of the per-iteration scalars."""

    wandb_project: str = ""
    """Weights & Biases project to log the TensorBoard scalars to (needs the wandb package); empty: none."""

    wandb_exp_name: str = ""
    """Weights & Biases run name (required with --wandb-project)."""

    wandb_save_dir: str = ""
    """Folder for the local Weights & Biases files (default: <--save>/wandb)."""

    wandb_entity: str = ""
    """Weights & Biases entity (user or team) that owns the project; empty: wandb's default."""

    logging_level: int | None = None
    """Python logging level of the trainer's loggers (e.g. 10 debug, 20 info, 40 error)."""


@dataclasses.dataclass
class CheckpointConfig(Freezable):
    """Saving and loading checkpoints."""

    save: str | None = None
    """Folder to save checkpoints to."""

    load: str | None = None
    """Folder to load a checkpoint from."""

    save_interval: int | None = None
    """Iterations between checkpoint saves."""

    save_retain_interval: int | None = None
    """Keep the checkpoints of iterations that are multiples of this value; a save deletes the previous
    checkpoint otherwise (the latest is always kept). A multiple of --save-interval."""

    no_load_optim: bool = False
    """Do not load optimizer state."""

    no_load_rng: bool = False
    """Do not load RNG state."""

    finetune: bool = False
    """Load model weights only and start from iteration 0."""

    ckpt_format: str = flag_field("torch_dist", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"))
    """Checkpoint format: torch_dist (torch.distributed.checkpoint, sharded, layout-free keys) or
    torch (one model_optim_rng.pt per model-parallel rank)."""

    auto_detect_ckpt_format: bool = False
    """Load whichever format the --load checkpoint has (and save in that format)."""

    async_save: bool = False
    """Write torch_dist checkpoints in the background while training goes on."""

    dist_ckpt_strictness: str = flag_field(
        "assume_ok_unexpected",
        choices=(
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ),
    )
    """torch_dist loads: what to do with keys the checkpoint has and the model lacks (unexpected) or the
    other way round (missing): log, raise or ignore them; assume_ok_unexpected skips the check."""


@dataclasses.dataclass
class RunConfig(Freezable):
    """Every concern of one run, as parsed from the command line."""

    model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    ddp: DDPConfig = dataclasses.field(default_factory=DDPConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    cuda_graph: CudaGraphConfig = dataclasses.field(default_factory=CudaGraphConfig)
    mamba: MambaConfig = dataclasses.field(default_factory=MambaConfig)
    linear_attention: LinearAttentionConfig = dataclasses.field(default_factory=LinearAttentionConfig)
    ignored_flags: list[str] = dataclasses.field(default_factory=list)
    """Given Megatron flags that are accepted with no effect (speed and I/O knobs), for the start-up line."""

    def resolve(self, world_size: int = 1) -> "RunConfig":
        """A copy of this config with every derived value computed, for a run of ``world_size`` processes.

        The only place derived values are set (but the padded vocabulary size, which
        needs the tokenizer); with ``--auto-detect-ckpt-format`` the format is the one of
        the ``--load`` checkpoint. Values the flags leave undefined (a batch size of 0, say)
        stay as given for ``validate()`` to name; a hybrid pattern that cannot be parsed
        raises ``ValueError`` here.
        """
        cfg = copy.deepcopy(self)
        cfg._warn_ignored_flags()  # on the flags as given, before defaults fill them in
        cfg.model.moe = cfg.moe  # the model reads its MoE flags as config.moe
        cfg.model.linear_attention = cfg.linear_attention  # and its attention variant as config.linear_attention
        cfg.mamba.resolve(cfg.model, cfg.parallel)  # before finalize: the hybrid pattern sets --num-layers
        cfg.model.finalize()
        cfg.model.params_dtype = cfg.precision.params_dtype
        cfg.parallel.world_size = world_size
        cfg.parallel.resolve()
        cfg.parallel.resolve_model(cfg.model, stages_from_pattern=cfg.mamba.parsed_pattern is not None)
        cfg.cuda_graph.resolve()
        if cfg.optimizer.optimizer == "dist_muon":  # Megatron's deprecated spelling
            warnings.warn(
                "--optimizer dist_muon is deprecated; use --optimizer muon --use-distributed-optimizer.", stacklevel=2
            )
            cfg.optimizer.optimizer = "muon"
            cfg.ddp.use_distributed_optimizer = True
        t = cfg.training
        if t.step_batch_size_schedule is not None:
            require(
                t.global_batch_size is None,
                "--step-batch-size-schedule and --global-batch-size cannot both be set (as in Megatron); the "
                "schedule gives every batch size, drop --global-batch-size.",
            )
            require(
                t.rampup_batch_size is None,
                "--step-batch-size-schedule and --rampup-batch-size cannot both be set; pick one.",
            )
            steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
            t.global_batch_size = steps[-1][1]  # the batch the schedule ends with (eval, lr in iterations)
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * cfg.parallel.data_parallel_size
        require(  # the iteration count derives from one of them
            t.train_iters is None or t.train_samples is None,
            "--train-iters and --train-samples cannot both be set; pick one.",
        )
        if t.rerun_mode == "report_stats":  # Megatron's config spells it so; its state machine the other way
            t.rerun_mode = "report_determinism_stats"
        if t.train_samples is not None:
            if t.train_samples >= 1 and t.global_batch_size >= 1:
                batches = cfg.batch_schedule
                if batches.varies:
                    batches.validate()
                t.train_iters = max(1, batches.iterations_for(t.train_samples))
        elif t.train_iters is None:
            t.train_iters = 100
        if cfg.ddp.overlap_param_gather and cfg.cuda_graph.enabled:
            # A graph replay bypasses the forward pre-hooks that wait for each bucket's gather.
            warnings.warn(
                "--overlap-param-gather is off with CUDA graphs: parameters are gathered right after "
                "the optimizer step instead.",
                stacklevel=2,
            )
            cfg.ddp.overlap_param_gather = False
        d = cfg.data
        if d.tokenizer_type is None:
            # Megatron's pretrain_gpt.py: vocab and merge files mean GPT-2 BPE.
            d.tokenizer_type = "GPT2BPETokenizer" if d.vocab_file and d.merge_file else "NullTokenizer"
        c = cfg.checkpoint
        if c.auto_detect_ckpt_format and c.load:
            from megatron.training.dist_checkpointing import detect_format  # reads the --load folder

            c.ckpt_format = detect_format(c.load) or c.ckpt_format
        object.__setattr__(cfg, "_resolved", True)
        return cfg

    def freeze(self) -> "RunConfig":
        """Makes this config read-only (every concern in it); returns self."""
        return freeze(self)

    def validate(self) -> None:
        """Checks each concern, then the rules that span several of them. Reads only.

        Call on the config ``resolve()`` returned.
        """
        assert self.__dict__.get("_resolved"), "validate() checks a resolved config: call cfg = cfg.resolve(world_size)"
        self.mamba.validate(self.model, self.parallel)
        self.model.validate()
        par = self.parallel
        etp = par.expert_tensor_parallel_size or par.tensor_model_parallel_size
        self.moe.validate(self.model, par.expert_model_parallel_size, etp)
        validate_overlap_switches(
            self.ignored_flags, self.moe, self.model, par, self.precision.bf16 or self.precision.fp16
        )
        self.linear_attention.validate(self.model, par)
        self.parallel.validate()
        require(
            not self.moe.enabled or par.tensor_model_parallel_size == 1 or par.sequence_parallel,
            "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (as in Megatron): "
            "each tensor-parallel rank then routes its own sequence shard, which the expert gradients assume.",
        )
        self.cuda_graph.validate()
        pattern = self.mamba.parsed_pattern
        self.parallel.validate_model(self.model, stages_from_pattern=pattern is not None)
        require(
            not (self.cuda_graph.enabled and self.model.recompute_granularity),
            "--recompute-granularity with --cuda-graph-impl local is not supported yet: a recomputed layer would "
            "replay its graphs out of the captured order. Drop one of them.",
        )
        require(
            not (self.cuda_graph.enabled and self.model.fine_grained_activation_offloading),
            "--fine-grained-activation-offloading with --cuda-graph-impl local is not supported: the host copies "
            "would be captured into the graphs and replayed into the same buffers. Drop one of them.",
        )
        p, t, o = self.precision, self.training, self.optimizer
        require(not (p.bf16 and p.fp16), "--bf16 and --fp16 cannot be combined; pick one.")
        require(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}.")
        dp = self.parallel.data_parallel_size
        require(
            t.global_batch_size >= 1,
            f"--global-batch-size must be >= 1, got {t.global_batch_size}; drop it for --micro-batch-size x "
            "data-parallel size.",
        )
        require(
            t.global_batch_size % (t.micro_batch_size * dp) == 0,
            f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}).",
        )
        self.batch_schedule.validate()
        validate_fim_config(self.data)
        require(
            t.error_injection_rate >= 0,
            f"--error-injection-rate must be >= 0, got {t.error_injection_rate} (0 turns injection off).",
        )
        require(
            t.error_injection_rate == 0 or t.rerun_mode != "disabled",
            "--error-injection-rate injects results for the re-run checks, which --rerun-mode disabled turns off; "
            "pass --rerun-mode validate_results or drop --error-injection-rate.",
        )
        if t.train_samples is not None:
            require(t.train_samples >= 1, f"--train-samples must be >= 1, got {t.train_samples}.")
        require(t.train_iters >= 1, f"--train-iters must be >= 1, got {t.train_iters}.")
        require(
            not (t.train_samples is None and (o.lr_warmup_samples or o.lr_decay_samples is not None)),
            "--lr-warmup-samples / --lr-decay-samples count samples and go with --train-samples; "
            "with --train-iters use --lr-warmup-iters / --lr-decay-iters.",
        )
        require(
            not (t.train_samples is not None and (o.lr_warmup_iters or o.lr_decay_iters is not None)),
            "--lr-warmup-iters / --lr-decay-iters go with --train-iters; with --train-samples use "
            "--lr-warmup-samples / --lr-decay-samples.",
        )
        require(t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}.")
        if t.eval_global_batch_size is not None:
            require(
                t.eval_global_batch_size % (t.micro_batch_size * dp) == 0,
                f"--eval-global-batch-size ({t.eval_global_batch_size}) must be divisible by --micro-batch-size "
                f"({t.micro_batch_size}) x data-parallel size ({dp}).",
            )
        require(o.lr >= 0 and o.min_lr >= 0, "--lr and --min-lr must be non-negative.")
        require(o.min_lr <= o.lr, f"--min-lr ({o.min_lr}) must not exceed --lr ({o.lr}).")
        require(
            not (o.lr_warmup_fraction is not None and o.lr_warmup_iters),
            "--lr-warmup-fraction and --lr-warmup-iters cannot both be set; pick one.",
        )
        require(o.clip_grad >= 0, f"--clip-grad must be >= 0, got {o.clip_grad}.")
        for name in ("adam_beta1", "adam_beta2"):
            beta = getattr(o, name)
            require(0.0 <= beta < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {beta} (e.g. 0.9).")
        require(o.adam_eps > 0, f"--adam-eps must be positive, got {o.adam_eps} (e.g. 1e-8).")
        require(
            o.weight_decay >= 0 and math.isfinite(o.weight_decay),
            f"--weight-decay must be >= 0, got {o.weight_decay} (0 turns it off).",
        )
        require(o.sgd_momentum >= 0, f"--sgd-momentum must be >= 0, got {o.sgd_momentum}.")
        require(
            math.isfinite(o.lr) and math.isfinite(o.min_lr), f"--lr ({o.lr}) and --min-lr ({o.min_lr}) must be finite."
        )
        require(
            t.exit_interval is None or t.exit_interval >= 1,
            f"--exit-interval must be >= 1, got {t.exit_interval}; drop it to train all --train-iters.",
        )
        require(
            t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
            f"--exit-duration-in-mins must be positive, got {t.exit_duration_in_mins}.",
        )
        require(
            t.eval_interval >= 1,
            f"--eval-interval must be >= 1, got {t.eval_interval}; turn evaluation off with --eval-iters 0.",
        )
        require(t.eval_iters >= 0, f"--eval-iters must be >= 0, got {t.eval_iters} (0 turns evaluation off).")
        require(
            not self.ddp.overlap_param_gather or self.ddp.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer; add it or drop --overlap-param-gather.",
        )
        instances = self.parallel.num_distributed_optimizer_instances
        require(
            instances == 1 or self.ddp.use_distributed_optimizer,
            f"--num-distributed-optimizer-instances {instances} needs --use-distributed-optimizer (it shards the "
            "distributed optimizer within each instance); add it or drop --num-distributed-optimizer-instances.",
        )
        require(
            p.accumulate_allreduce_grads_in_fp32,
            "reduced-precision gradient buffers are not supported yet; main_grad is always fp32.",
        )
        if o.optimizer == "muon":
            validate_muon(o, p)
        require(
            o.decoupled_min_lr is None or o.decoupled_lr is not None,
            "--decoupled-min-lr needs --decoupled-lr.",
        )
        if o.decoupled_lr is not None:
            require(
                o.decoupled_lr >= 0 and math.isfinite(o.decoupled_lr),
                f"--decoupled-lr must be finite and >= 0, got {o.decoupled_lr}.",
            )
            low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
            require(
                0 <= low <= o.decoupled_lr,
                f"the embedding/output minimum lr ({low}: --decoupled-min-lr, default --min-lr) must be in "
                f"[0, --decoupled-lr ({o.decoupled_lr})]; pass --decoupled-min-lr.",
            )
        d = self.data
        require(
            d.mock_data or d.data_path,
            "no training data: pass --mock-data for synthetic documents, or --data-path PREFIX.",
        )
        split = self._split_weights()
        require(
            split[0] > 0,
            f"--split {d.split} gives the train split no data; give it a weight, e.g. --split 969,30,1.",
        )
        require(
            t.eval_iters == 0 or split[1] > 0,
            f"--eval-iters {t.eval_iters} needs validation data, but --split {d.split} gives the valid split none; "
            "give it a weight (e.g. --split 969,30,1) or pass --eval-iters 0.",
        )
        require(
            d.tokenizer_type in TOKENIZER_TYPES,
            f"--tokenizer-type {d.tokenizer_type} is not supported yet; use one of {', '.join(TOKENIZER_TYPES)} "
            "(HuggingFaceTokenizer reads a tokenizer.json).",
        )
        if d.tokenizer_type == "NullTokenizer":
            require(
                d.vocab_size is not None and d.vocab_size >= 2,
                "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 2).",
            )
        require(self.logging.log_interval >= 1, "--log-interval must be >= 1.")
        lg = self.logging
        if lg.wandb_project:
            require(
                lg.wandb_exp_name, f"--wandb-project {lg.wandb_project} needs --wandb-exp-name NAME (the run's name)."
            )
            require(
                lg.wandb_save_dir or self.checkpoint.save,
                "--wandb-project needs --wandb-save-dir DIR (or --save, whose wandb/ subfolder is the default).",
            )
        c = self.checkpoint
        require(
            c.ckpt_format in ("torch", "torch_dist"),
            f"--ckpt-format {c.ckpt_format} is not supported: use torch_dist (sharded, reshardable) or torch.",
        )
        require(
            not c.async_save or c.ckpt_format == "torch_dist",
            "--async-save needs --ckpt-format torch_dist (the torch format saves synchronously).",
        )
        require(
            c.save_interval is None or c.save_interval >= 1,
            f"--save-interval must be >= 1, got {c.save_interval}; drop it to save only at the end of training.",
        )
        if c.save_retain_interval is not None:
            require(
                c.save_interval is not None and c.save_retain_interval >= 1,
                f"--save-retain-interval {c.save_retain_interval} needs --save-interval N and must be >= 1.",
            )
            require(
                c.save_retain_interval % c.save_interval == 0,
                f"--save-retain-interval ({c.save_retain_interval}) must be a multiple of --save-interval "
                f"({c.save_interval}).",
            )

    def _split_weights(self) -> list[float]:
        return parse_split(self.data.split)  # the data code owns the format

    def _warn_ignored_flags(self) -> None:
        """Warns about flags that are accepted but change nothing in this combination."""
        m, g = self.model, self.cuda_graph
        if not m.group_query_attention and m.num_query_groups not in (None, m.num_attention_heads):
            warnings.warn(
                f"--num-query-groups {m.num_query_groups} is ignored without --group-query-attention "
                "(every head has its own keys and values); add --group-query-attention to use it.",
                stacklevel=3,
            )
        if m.recompute_granularity is None and (m.recompute_method is not None or m.recompute_num_layers is not None):
            warnings.warn(
                "--recompute-method / --recompute-num-layers have no effect without --recompute-granularity full "
                "(nothing is recomputed), as in Megatron.",
                stacklevel=3,
            )
        if g.cuda_graph_impl == "none" and g.cuda_graph_scope:
            scope = " ".join(g.cuda_graph_scope) if isinstance(g.cuda_graph_scope, list) else g.cuda_graph_scope
            warnings.warn(
                f"--cuda-graph-scope {scope} has no effect without --cuda-graph-impl local (the run is eager).",
                stacklevel=3,
            )

    @property
    def batch_schedule(self) -> BatchSchedule:
        """The global batch size per step (constant, ramp-up or step schedule)."""
        return BatchSchedule.from_config(self.training, self.parallel.data_parallel_size, self.model.seq_length)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step at --global-batch-size (the batch after any ramp-up; evaluation's)."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)
