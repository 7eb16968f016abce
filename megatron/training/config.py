"""Training-side configuration: batch, precision, DDP, logging, checkpoints (the data flags' is in
``data_config.py``, profiling's in ``profiling.py``, distillation's in ``distillation.py``).

One small dataclass per concern; ``megatron.training.arguments`` generates the flags.
The checks that read one concern only are its ``validate``; ``run_config.RunConfig``
bundles every concern and runs the rest.
"""

import dataclasses
import signal

import torch

from megatron.core.config_utils import Freezable, flag_field, require

# Signals a Python handler can catch (Megatron's --exit-signal takes any name; SIGKILL and SIGSTOP never arrive).
CATCHABLE_SIGNALS = tuple(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))


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

    decrease_batch_size_if_needed: bool = False
    """Round --global-batch-size down to a multiple of --micro-batch-size x data-parallel size instead of
    refusing it (a run resumed on fewer ranks), with Megatron's line saying so."""

    step_batch_size_schedule: list[str] | None = flag_field(None, nargs="+")
    """Step-wise global batch size: "THRESHOLD:BATCH ..." (e.g. "0:384 200B:768"; quoted as one word or given
    as several), thresholds in tokens (K/M/B/T suffixes) from which the batch applies; replaces
    --global-batch-size (an equal --global-batch-size is accepted)."""

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

    eval_global_batch_size: int | None = None
    """Global batch size of evaluation. Defaults to --global-batch-size."""

    eval_micro_batch_size: int | None = None
    """Micro batch size of evaluation. Defaults to --micro-batch-size."""

    skip_train: bool = False
    """Skip training: evaluate the validation and test splits at the loaded iteration and exit (implies
    --no-load-optim)."""

    seed: int = 1234
    """Random seed for initialisation, data and dropout."""

    data_parallel_random_init: bool = False
    """Give each data-parallel rank random streams of its own after the weights are drawn (seed + 10 x DP
    rank, Megatron's), so dropout differs across DP ranks; the weights are the same on every rank."""

    deterministic_mode: bool = False
    """Use deterministic kernels (torch.use_deterministic_algorithms) for bitwise-repeatable runs."""

    exit_interval: int | None = None
    """Exit after the iteration that is a multiple of this value."""

    exit_duration_in_mins: float | None = None
    """Save and exit once the run has trained this many minutes (checked after every iteration)."""

    exit_signal_handler: bool = False
    """On --exit-signal (SIGTERM), save a checkpoint at the end of the current iteration and exit with status 0."""

    exit_signal: str = "SIGTERM"
    """The signal --exit-signal-handler stops on, by name (SIGTERM, SIGINT, SIGUSR1, ...)."""

    exit_signal_handler_for_training: bool = False
    """On SIGINT or SIGTERM, end the run at once with status 0 and one line instead of a traceback (no
    save; the signal of --exit-signal-handler still saves first)."""

    eval_interval: int = 1000
    """Iterations between evaluations on the validation split."""

    eval_iters: int = 0
    """Global batches per evaluation (0 turns evaluation off)."""

    phase_transition_iterations: str | None = None
    """Comma-separated iterations where a data phase ends: the run saves and stops there, and each phase
    (relaunched, e.g. with another --data-path) builds its own training data from its first sample."""

    iterations_to_skip: list[int] = flag_field(default_factory=list, nargs="+")
    """Iterations (1-based) not trained: their batch is read and dropped, nothing else happens."""

    start_eval_at_iter: int | None = None
    """Evaluate during training only from this iteration on (the evaluations after training still run)."""

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

    def phase_transitions(self) -> list[int]:
        """--phase-transition-iterations as sorted iterations (ValueError naming the flag)."""
        if not self.phase_transition_iterations:
            return []
        try:
            found = sorted(int(x) for x in str(self.phase_transition_iterations).split(",") if x.strip())
        except ValueError:
            raise ValueError(
                f"--phase-transition-iterations {self.phase_transition_iterations!r}: expected iterations "
                "separated by commas, e.g. 1000,5000."
            ) from None
        require(all(i >= 1 for i in found), "--phase-transition-iterations must be positive iterations.")
        return found

    def phase_of(self, iteration: int) -> tuple[int, int]:
        """``(first, end)`` iterations of the data phase that trains iteration ``iteration + 1``."""
        bounds = [0, *self.phase_transitions(), self.train_iters]
        first = max(b for b in bounds if b <= iteration)
        return first, min(b for b in bounds if b > first) if first < self.train_iters else self.train_iters


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

    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and reduce gradients (the DDP main_grad buffers) in fp32. Always so with --bf16 unless
    --grad-reduce-in-bf16; without it --fp16 accumulates and reduces in fp16, as Megatron."""

    grad_reduce_in_bf16: bool = False
    """With --bf16: accumulate and reduce gradients in bf16 main_grad buffers (half the memory and
    communication); the optimizer still steps fp32 main params on fp32 copies of the gradients."""

    attention_softmax_in_fp32: bool = True
    """Softmax in fp32 (SDPA always accumulates in fp32; kept for Megatron command lines)."""

    disable_bf16_reduced_precision_matmul: bool = False
    """With --bf16: keep cuBLAS from reduced-precision reductions inside bf16 matmuls
    (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False)."""

    @property
    def params_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return torch.float32

    @property
    def grad_reduce_in_fp32(self) -> bool:
        """Whether the main_grad buffers are fp32 (Megatron's resolved accumulate_allreduce_grads_in_fp32)."""
        if self.bf16:
            return not self.grad_reduce_in_bf16
        return self.accumulate_allreduce_grads_in_fp32

    @property
    def main_grad_dtype(self) -> torch.dtype:
        """Dtype of the DDP main_grad buffers: fp32, or the parameters' dtype."""
        return torch.float32 if self.grad_reduce_in_fp32 else self.params_dtype


@dataclasses.dataclass
class DDPConfig(Freezable):
    """Data-parallel gradient reduction."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient all-reduce of each bucket with the rest of backward."""

    ddp_bucket_size: int | None = None
    """Elements per gradient bucket (default: max(40M, 1M * DP))."""

    ddp_num_buckets: int | None = None
    """Number of gradient buckets instead of a size: each holds up to (trainable parameters) // N
    elements, as Megatron; not with --ddp-bucket-size."""

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

    log_loss_scale_to_tensorboard: bool = flag_field(
        True, flag="--no-log-loss-scale-to-tensorboard", aliases=("--disable-log-loss-scale-to-tensorboard",)
    )
    """Write the loss scale to TensorBoard with the per-iteration scalars."""

    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard with the per-iteration scalars."""

    log_device_memory_used: bool = False
    """Add the device memory in use by every process (what nvidia-smi shows) to the memory line."""

    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard writes of the per-iteration scalars."""

    wandb_project: str = ""
    """Weights & Biases project to log the TensorBoard scalars to (needs the wandb package); empty: none."""

    wandb_exp_name: str | None = None
    """Weights & Biases run name (unset: wandb names the run; an empty name is refused, as Megatron)."""

    wandb_save_dir: str = ""
    """Folder for the local Weights & Biases files (default: <--save>/wandb)."""

    wandb_entity: str = ""
    """Weights & Biases entity (user or team) that owns the project; empty: wandb's default."""

    logging_level: int | None = None
    """Python logging level of the trainer's loggers (e.g. 10 debug, 20 info, 40 error)."""

    def validate(self, save: str | None) -> None:
        """The logging flags' own checks (``save``: --save, wandb's default folder); raises ``ValueError``."""
        require(self.log_interval >= 1, "--log-interval must be >= 1.")
        if self.wandb_project:
            require(
                self.wandb_exp_name != "",
                f"--wandb-project {self.wandb_project} with an empty --wandb-exp-name: give the run a name, or drop "
                "--wandb-exp-name for one wandb chooses.",
            )
            require(
                self.wandb_save_dir or save,
                "--wandb-project needs --wandb-save-dir DIR (or --save, whose wandb/ subfolder is the default).",
            )


@dataclasses.dataclass
class CheckpointConfig(Freezable):
    """Saving and loading checkpoints."""

    save: str | None = None
    """Folder to save checkpoints to."""

    load: str | None = None
    """Folder to load a checkpoint from."""

    save_interval: int | None = flag_field(None, aliases=("--persistent-save-interval",))
    """Iterations between (persistent) checkpoint saves."""

    save_params_interval: int | None = None
    """Every this many iterations, write every parameter by name after the optimizer step (a debug dump:
    <--save>/params/iter_XXXXXXX/mp_rank_*.pth, Megatron's layout)."""

    save_wgrads_interval: int | None = None
    """Every this many iterations, write every main gradient by name, reduced, before the optimizer step
    (<--save>/wgrads/iter_XXXXXXX/mp_rank_*.pth)."""

    save_retain_interval: int | None = None
    """Keep the checkpoints of iterations that are multiples of this value; a save deletes the previous
    checkpoint otherwise (the latest is always kept). A multiple of --save-interval."""

    no_load_optim: bool = False
    """Do not load optimizer state."""

    no_save_optim: bool = False
    """Save checkpoints without the optimizer state and the learning-rate schedule (loading one then needs
    --no-load-optim)."""

    no_save_rng: bool = False
    """Save checkpoints without the RNG state (loading one then needs --no-load-rng)."""

    no_load_rng: bool = False
    """Do not load RNG state."""

    load_main_params_from_ckpt: bool = False
    """With --no-load-optim: take the fp32 main params from the checkpoint's optimizer state (not the moments),
    instead of rebuilding them from the bf16/fp16 weights."""

    finetune: bool = False
    """Load model weights only and start from iteration 0."""

    use_checkpoint_args: bool = False
    """Take the model flags from the checkpoint to load (the sizes where the command line leaves them out,
    the model's form always), as Megatron's load_args_from_checkpoint."""

    use_mp_args_from_checkpoint_args: bool = False
    """With --use-checkpoint-args: take the tensor, pipeline, virtual-pipeline and expert parallel sizes too."""

    use_tokenizer_model_from_checkpoint_args: bool = flag_field(
        True,
        flag="--no-use-tokenizer-model-from-checkpoint-args",
        aliases=("--disable-use-tokenizer-model-from-checkpoint-args",),
    )
    """With --use-checkpoint-args: take --tokenizer-type and --tokenizer-model from the checkpoint."""

    ckpt_step: int | None = None
    """Load the checkpoint of this iteration (its iter_XXXXXXX folder) instead of the one the tracker names."""

    override_ckpt_iteration: int | None = None
    """Continue from this iteration instead of the loaded one: the data loader starts at iteration x
    --global-batch-size samples (the learning-rate schedule stays the checkpoint's)."""

    exit_on_missing_checkpoint: bool = False
    """With --load: stop with an error when it holds no checkpoint, instead of training from scratch."""

    pretrained_checkpoint: str | None = None
    """Checkpoint folder to start from when --load holds none (or is unset): its weights only, from iteration 0,
    as --finetune; once --save has written a checkpoint into --load, runs resume from that."""

    non_persistent_save_interval: int | None = None
    """Iterations between non-persistent saves: checkpoints of their own folder, of which only the latest
    is kept (with --non-persistent-ckpt-type global); a resume loads it when it is newer than --load's."""

    non_persistent_ckpt_type: str | None = flag_field(None, choices=("global", "local", "in_memory"))
    """Non-persistent checkpoints: global (--ckpt-format checkpoints in --non-persistent-global-ckpt-dir);
    local and in_memory (nvidia-resiliency-ext's per-node checkpoints) are not supported yet."""

    non_persistent_global_ckpt_dir: str | None = None
    """Folder of the global non-persistent checkpoints (default: the non_persistent folder in --save, and
    in --load when loading)."""

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

    def validate(self) -> None:
        """The checkpoint flags' own checks; raises ``ValueError``."""
        require(
            self.ckpt_format in ("torch", "torch_dist"),
            f"--ckpt-format {self.ckpt_format} is not supported: use torch_dist (sharded, reshardable) or torch.",
        )
        require(
            not self.async_save or self.ckpt_format == "torch_dist",
            "--async-save needs --ckpt-format torch_dist (the torch format saves synchronously).",
        )
        for flag, value in (
            ("--save-params-interval", self.save_params_interval),
            ("--save-wgrads-interval", self.save_wgrads_interval),
        ):
            require(value is None or value >= 1, f"{flag} must be >= 1, got {value}.")
            require(value is None or self.save, f"{flag} {value} needs --save (the dumps go into it).")
        require(
            not self.load_main_params_from_ckpt or self.no_load_optim,
            "--load-main-params-from-ckpt needs --no-load-optim (a loaded optimizer brings its fp32 params anyway).",
        )
        if self.non_persistent_ckpt_type in ("local", "in_memory"):
            raise ValueError(
                f"--non-persistent-ckpt-type {self.non_persistent_ckpt_type} (nvidia-resiliency-ext's local "
                "checkpoints) is not supported yet; use global (checkpoints in --non-persistent-global-ckpt-dir)."
            )
        if self.non_persistent_save_interval is not None:
            n = self.non_persistent_save_interval
            require(n >= 1, f"--non-persistent-save-interval must be >= 1, got {n}.")
            require(self.save, f"--non-persistent-save-interval {n} needs --save.")
            require(
                self.non_persistent_ckpt_type == "global",
                f"--non-persistent-save-interval {n} needs --non-persistent-ckpt-type global.",
            )
        require(
            not self.use_checkpoint_args or self.load or self.pretrained_checkpoint,
            "--use-checkpoint-args needs --load or --pretrained-checkpoint (the checkpoint to read the flags from).",
        )
        for flag, value in (
            ("--ckpt-step", self.ckpt_step),
            ("--override-ckpt-iteration", self.override_ckpt_iteration),
        ):
            require(value is None or value >= 0, f"{flag} must be >= 0, got {value}.")
            require(value is None or self.load, f"{flag} {value} needs --load (the checkpoint folder).")
        require(
            self.save_interval is None or self.save_interval >= 1,
            f"--save-interval must be >= 1, got {self.save_interval}; drop it to save only at the end of training.",
        )
        if self.save_retain_interval is not None:
            require(
                self.save_interval is not None and self.save_retain_interval >= 1,
                f"--save-retain-interval {self.save_retain_interval} needs --save-interval N and must be >= 1.",
            )
            require(
                self.save_retain_interval % self.save_interval == 0,
                f"--save-retain-interval ({self.save_retain_interval}) must be a multiple of --save-interval "
                f"({self.save_interval}).",
            )
