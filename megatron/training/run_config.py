"""``RunConfig``: every concern's config of one run, and the checks that span them.

The training-side concerns are in ``config.py``; the model, parallel, MoE, Mamba and
cuda-graph configs live with the core code they configure, ``OptimizerConfig`` with the
optimizer, ``DistillationConfig`` with distillation.

A run's config goes through four steps, once each: ``parse_args`` fills the
dataclasses; ``RunConfig.resolve(world_size)`` returns a copy with every derived value
computed (defaults that depend on other flags, the data-parallel sizes, the dtype, the
iteration count); ``validate()`` only reads and raises ``ValueError`` naming the flag;
the trainer sets the padded vocabulary size from the tokenizer and calls ``freeze()``,
after which assigning a field raises.
"""

import copy
import dataclasses
import warnings

from megatron.core.config_utils import Freezable, freeze, require
from megatron.core.datasets.builder import parse_split
from megatron.core.datasets.fim import validate_fim_config
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.parallel_config import ParallelConfig
from megatron.core.ssm.gated_delta_net.config import LinearAttentionConfig
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.tokenizers.tokenizer import SENTENCEPIECE_TYPES, TOKENIZER_TYPES
from megatron.core.transformer.cuda_graphs.config import DEPRECATED_SCOPES, CudaGraphConfig
from megatron.core.transformer.moe.moe_config import MoEConfig, validate_overlap_switches
from megatron.core.transformer.recompute import check_recompute_with_graphs
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import full_iteration
from megatron.training.batch_schedule import BatchSchedule, parse_step_schedule
from megatron.training.config import (
    CATCHABLE_SIGNALS,
    CheckpointConfig,
    DDPConfig,
    LoggingConfig,
    PrecisionConfig,
    TrainingConfig,
)
from megatron.training.data_config import DataConfig, validate_document_mask
from megatron.training.distillation import DistillationConfig
from megatron.training.profiling import ProfilingConfig


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
    distill: DistillationConfig = dataclasses.field(default_factory=DistillationConfig)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    cuda_graph: CudaGraphConfig = dataclasses.field(default_factory=CudaGraphConfig)
    mamba: MambaConfig = dataclasses.field(default_factory=MambaConfig)
    linear_attention: LinearAttentionConfig = dataclasses.field(default_factory=LinearAttentionConfig)
    ignored_flags: list[str] = dataclasses.field(default_factory=list)
    """Given Megatron flags that are accepted with no effect (speed and I/O knobs), for the start-up line."""
    given_fields: list[str] = dataclasses.field(default_factory=list)
    """The fields the command line set, as "group.field" (--use-checkpoint-args keeps their values)."""

    def resolve(self, world_size: int = 1) -> "RunConfig":
        """A copy of this config with every derived value computed, for a run of ``world_size`` processes.

        The only place derived values are set (but the padded vocabulary size, which
        needs the tokenizer); with ``--auto-detect-ckpt-format`` the format is the one of
        the ``--load`` checkpoint, and with ``--pretrained-checkpoint`` and no checkpoint in
        ``--load`` that folder is loaded instead, weights only (both read the filesystem).
        Values the flags leave undefined (a batch size of 0, say) stay as given for
        ``validate()`` to name; a hybrid pattern (or window pattern) that cannot be parsed,
        or a missing pretrained checkpoint, raises ``ValueError`` here.
        """
        cfg = copy.deepcopy(self)
        cfg._warn_ignored_flags()  # on the flags as given, before defaults fill them in
        cfg.data.read_path_files()  # --data-args-path, --per-split-data-args-path
        c = cfg.checkpoint
        if c.use_checkpoint_args and (c.load or c.pretrained_checkpoint):  # before anything derives from them
            from megatron.training import checkpoint_args  # reads the checkpoint folder
            from megatron.training.logging_utils import print_rank_0

            for line in checkpoint_args.apply(cfg):
                print_rank_0(line)
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
                t.rampup_batch_size is None,
                "--step-batch-size-schedule and --rampup-batch-size cannot both be set; pick one.",
            )
            steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
            require(  # Megatron refuses any --global-batch-size here; one that says the same is harmless
                t.global_batch_size in (None, steps[-1][1]),
                f"--global-batch-size {t.global_batch_size} differs from the last batch size of "
                f"--step-batch-size-schedule ({steps[-1][1]}); the schedule gives every batch size, drop "
                "--global-batch-size.",
            )
            t.global_batch_size = steps[-1][1]  # the batch the schedule ends with (eval, lr in iterations)
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * cfg.parallel.data_parallel_size
        if t.decrease_batch_size_if_needed:
            cfg._decrease_batch_size()
        if t.eval_global_batch_size is None:
            t.eval_global_batch_size = t.global_batch_size
        if t.eval_micro_batch_size is None:
            t.eval_micro_batch_size = t.micro_batch_size
        if t.skip_train and not cfg.checkpoint.no_load_optim:  # Megatron's rule and warning
            warnings.warn("enabling --no-load-optim when skipping training.", stacklevel=2)
            cfg.checkpoint.no_load_optim = True
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
        # Overlap hooks that a graph replay would bypass: turned off, with a warning each.
        switched_off = (
            # The forward pre-hooks that wait for each bucket's gather.
            ("overlap_param_gather", cfg.cuda_graph.captures, "--overlap-param-gather is off with CUDA graphs: "
             "parameters are gathered right after the optimizer step instead."),
            # The backward hooks that launch each bucket's reduction.
            ("overlap_grad_reduce", cfg.cuda_graph.full_iteration, "--overlap-grad-reduce is off with "
             "--cuda-graph-impl full_iteration: gradients are reduced right after the graph instead."),
        )  # fmt: skip
        for field, graphed, message in switched_off:
            if graphed and getattr(cfg.ddp, field):
                warnings.warn(message, stacklevel=2)
                setattr(cfg.ddp, field, False)
        d = cfg.data
        if d.tokenizer_type is None:
            # Megatron's pretrain_gpt.py: vocab and merge files mean GPT-2 BPE.
            d.tokenizer_type = "GPT2BPETokenizer" if d.vocab_file and d.merge_file else "NullTokenizer"
        c = cfg.checkpoint
        if c.pretrained_checkpoint:
            from megatron.training.checkpointing import has_checkpoint  # reads the --load folder

            if not (c.load and has_checkpoint(c.load)):  # Megatron's rule: fine-tune from the pretrained one
                require(
                    has_checkpoint(c.pretrained_checkpoint),
                    f"no checkpoint in --load {c.load} nor in --pretrained-checkpoint {c.pretrained_checkpoint}; "
                    "point --pretrained-checkpoint at a folder written by --save.",
                )
                c.load, c.finetune = c.pretrained_checkpoint, True
        if c.auto_detect_ckpt_format and c.load:
            from megatron.training.dist_checkpointing import detect_format  # reads the --load folder

            c.ckpt_format = detect_format(c.load, c.ckpt_step) or c.ckpt_format
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
        require(
            self.parallel.pipeline_model_parallel_layout is None or self.mamba.hybrid_layer_pattern is None,
            "--pipeline-model-parallel-layout cannot be combined with --hybrid-layer-pattern (as in Megatron): "
            "the pattern's '|' segments place a hybrid model's layers; drop the layout.",
        )
        self.mamba.validate(self.model, self.parallel)
        self.model.validate()
        par = self.parallel
        etp = par.expert_tensor_parallel_size or par.tensor_model_parallel_size
        self.moe.validate(self.model, par.expert_model_parallel_size, etp)
        validate_overlap_switches(
            self.ignored_flags, self.moe, self.model, par, self.precision.bf16 or self.precision.fp16
        )
        self.linear_attention.validate(self.model, par, hybrid_pattern=self.mamba.hybrid_layer_pattern)
        self.parallel.validate()
        require(
            not self.moe.enabled or par.tensor_model_parallel_size == 1 or par.sequence_parallel,
            "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (as in Megatron): "
            "each tensor-parallel rank then routes its own sequence shard, which the expert gradients assume.",
        )
        self.cuda_graph.validate()
        pattern = self.mamba.parsed_pattern
        self.parallel.validate_model(self.model, pattern=pattern)
        if self.cuda_graph.enabled:
            check_recompute_with_graphs(self.model, self.cuda_graph.cuda_graph_scope)
        if self.cuda_graph.full_iteration:
            full_iteration.check_config(self)
        require(
            not (self.cuda_graph.captures and self.model.fine_grained_activation_offloading),
            f"--fine-grained-activation-offloading with --cuda-graph-impl {self.cuda_graph.cuda_graph_impl} is not "
            "supported: the host copies would be captured into the graphs and replayed into the same buffers. Drop "
            "one of them.",
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
        validate_document_mask(self)
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
        require(
            t.exit_signal in CATCHABLE_SIGNALS,
            f"--exit-signal {t.exit_signal} is not a signal a process can catch; give a name such as SIGTERM, "
            "SIGINT or SIGUSR1.",
        )
        if t.phase_transition_iterations:
            t.phase_transitions()  # the text parses
            require(
                t.rampup_batch_size is None and t.step_batch_size_schedule is None,
                "--phase-transition-iterations needs a fixed global batch size (no --rampup-batch-size or "
                "--step-batch-size-schedule), as in Megatron.",
            )
        require(t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}.")
        require(t.eval_micro_batch_size >= 1, f"--eval-micro-batch-size must be >= 1, got {t.eval_micro_batch_size}.")
        require(
            t.eval_global_batch_size >= 1 and t.eval_global_batch_size % (t.eval_micro_batch_size * dp) == 0,
            f"--eval-global-batch-size ({t.eval_global_batch_size}) must be a positive multiple of "
            f"--eval-micro-batch-size ({t.eval_micro_batch_size}, default --micro-batch-size) x data-parallel "
            f"size ({dp}).",
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
        ck = self.checkpoint
        require(
            ck.save_params_interval is None or not self.ddp.overlap_param_gather,
            "--save-params-interval cannot be combined with --overlap-param-gather (as in Megatron).",
        )
        require(
            ck.save_wgrads_interval is None or not self.ddp.use_distributed_optimizer,
            "--save-wgrads-interval with --use-distributed-optimizer is not supported yet (each rank holds its "
            "shard of the reduced gradients); drop one of them.",
        )
        instances = self.parallel.num_distributed_optimizer_instances
        require(
            instances == 1 or self.ddp.use_distributed_optimizer,
            f"--num-distributed-optimizer-instances {instances} needs --use-distributed-optimizer (it shards the "
            "distributed optimizer within each instance); add it or drop --num-distributed-optimizer-instances.",
        )
        o.validate(p)
        d = self.data
        require(
            d.mid_level_dataset_surplus >= 0,
            f"--mid-level-dataset-surplus must be >= 0, got {d.mid_level_dataset_surplus}.",
        )
        require(
            d.mock_data or d.data_path or d.per_split,
            "no training data: pass --mock-data for synthetic documents, or --data-path PREFIX.",
        )
        if d.per_split and not d.mock_data:
            require(d.train_data_path, "the per-split paths give no train data: add --train-data-path PREFIX.")
            require(
                t.eval_iters == 0 or d.valid_data_path,
                f"--eval-iters {t.eval_iters} needs validation data: add --valid-data-path PREFIX or pass "
                "--eval-iters 0.",
            )
        else:
            split = self._split_weights()
            require(
                split[0] > 0,
                f"--split {d.split} gives the train split no data; give it a weight, e.g. --split 969,30,1.",
            )
            require(
                t.eval_iters == 0 or split[1] > 0,
                f"--eval-iters {t.eval_iters} needs validation data, but --split {d.split} gives the valid split "
                "none; give it a weight (e.g. --split 969,30,1) or pass --eval-iters 0.",
            )
        require(
            d.tokenizer_type in TOKENIZER_TYPES,
            f"--tokenizer-type {d.tokenizer_type} is not supported yet; use one of {', '.join(TOKENIZER_TYPES)} "
            "(HuggingFaceTokenizer reads a tokenizer.json, the SentencePiece types a .model file).",
        )
        if d.tokenizer_type in SENTENCEPIECE_TYPES:
            require(
                d.tokenizer_model,
                f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model PATH (a SentencePiece .model file).",
            )
        if d.tokenizer_type == "NullTokenizer":
            require(
                d.vocab_size is not None and d.vocab_size >= 2,
                "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 2). Without --tokenizer-type, give "
                "--vocab-file and --merge-file for GPT-2 BPE (pretrain_gpt.py's default in Megatron) or --vocab-size N.",
            )
        if d.tokenizer_special_tokens:
            require(
                d.tokenizer_type in SENTENCEPIECE_TYPES,
                f"--tokenizer-special-tokens with --tokenizer-type {d.tokenizer_type} is not supported yet "
                f"(only with {', '.join(SENTENCEPIECE_TYPES)}); drop the flag.",
            )
            require(
                d.tokenizer_sentencepiece_legacy,
                "--tokenizer-special-tokens needs --tokenizer-sentencepiece-legacy (Megatron's rule); "
                "add the switch or drop the tokens.",
            )
        if "--ddp-reduce-scatter-with-fp32-accumulation" in self.ignored_flags and (
            self.precision.main_grad_dtype.itemsize < 4  # bf16 or fp16 buffers
        ):
            kind, fp32 = (
                ("bf16", "drop --grad-reduce-in-bf16")
                if self.precision.bf16
                else ("fp16", "add --accumulate-allreduce-grads-in-fp32")
            )
            raise ValueError(
                f"--ddp-reduce-scatter-with-fp32-accumulation is not supported yet with {kind} gradient buffers "
                f"(the reduction here sums in {kind}); drop the flag, or {fp32} for fp32 gradients, which make it "
                "unnecessary."
            )
        self.logging.validate(self.checkpoint.save)
        self.checkpoint.validate()
        self.profiling.validate()
        self.distill.validate()
        if self.distill.enabled:
            require(
                par.pipeline_model_parallel_size == 1,
                "--export-kd-teacher-load with --pipeline-model-parallel-size > 1 is not supported yet (the teacher "
                "runs beside the student on one stage); distill at PP 1.",
            )
            require(
                not self.cuda_graph.enabled and self.cuda_graph.cuda_graph_impl != "full_iteration",
                "--export-kd-teacher-load with --cuda-graph-impl is not supported yet (the distillation loss reads "
                "layer outputs through hooks, which a graph replay does not run); drop --cuda-graph-impl.",
            )

    def _decrease_batch_size(self) -> None:
        """--decrease-batch-size-if-needed: the global batch rounded down to whole micro-batches per DP rank."""
        t = self.training
        require(
            t.step_batch_size_schedule is None,
            "Cannot specify both --step-batch-size-schedule and --decrease-batch-size-if-needed",  # Megatron's
        )
        require(
            t.rampup_batch_size is None,
            "--decrease-batch-size-if-needed with --rampup-batch-size is not supported yet; drop one of them.",
        )
        step = t.micro_batch_size * self.parallel.data_parallel_size
        if step < 1 or t.global_batch_size % step == 0:
            return
        rounded = t.global_batch_size // step * step
        require(
            rounded > 0,
            f"--decrease-batch-size-if-needed: --global-batch-size {t.global_batch_size} is smaller than one "
            f"micro-batch per data-parallel rank ({step}).",
        )
        warnings.warn(f"decreasing batch size from {t.global_batch_size} to {rounded}", stacklevel=3)
        t.global_batch_size = rounded

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
        if m.window_attn_skip_freq is not None and m.window_size is None:
            warnings.warn(
                "--window-attn-skip-freq has no effect without --window-size (every layer attends fully), as in "
                "Megatron.",
                stacklevel=3,
            )
        gated = m.gated_linear_unit or m.quick_geglu
        if not gated and (m.glu_linear_offset != 0.0 or m.activation_func_clamp_value is not None):
            warnings.warn(
                "--glu-linear-offset / --activation-func-clamp-value apply to gated activations (--swiglu, "
                "--quick-geglu) only; the MLP here is not gated, so they change nothing (as in Megatron).",
                stacklevel=3,
            )
        if self.precision.grad_reduce_in_bf16 and not self.precision.bf16:
            warnings.warn(
                "--grad-reduce-in-bf16 has no effect without --bf16 (gradients accumulate and reduce in the "
                "parameters' dtype, or fp32 with --accumulate-allreduce-grads-in-fp32), as in Megatron.",
                stacklevel=3,
            )
        if (
            self.precision.grad_reduce_in_bf16
            and self.precision.bf16
            and self.precision.accumulate_allreduce_grads_in_fp32
        ):
            warnings.warn(
                "--accumulate-allreduce-grads-in-fp32 is overridden by --grad-reduce-in-bf16: gradients accumulate "
                "and reduce in bf16, as in Megatron; drop one of them.",
                stacklevel=3,
            )
        given = g.cuda_graph_scope.split() if isinstance(g.cuda_graph_scope, str) else list(g.cuda_graph_scope)
        if g.cuda_graph_impl == "none" and given and not set(given) & set(DEPRECATED_SCOPES):  # those resolve() moves
            scope = " ".join(given)
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
        """Micro-batches per step at --global-batch-size (the batch after any ramp-up)."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    @property
    def eval_num_microbatches(self) -> int:
        """Micro-batches per evaluation batch (--eval-global-batch-size in --eval-micro-batch-size pieces)."""
        t = self.training
        return t.eval_global_batch_size // (t.eval_micro_batch_size * self.parallel.data_parallel_size)
