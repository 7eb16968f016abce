"""The rest of upstream Megatron's training flags, by family: what each does here.

``known_flags.py`` holds the flags of upstream's training configs and example scripts,
one entry each. This module answers every other flag of upstream's training parser
(``tools/upstream_flags.py`` lists them; ``tests/unit_tests/training/census`` checks that
each one parses), a family at a time, with the same three answers: accepted with no
effect (a speed, I/O, telemetry or debugging knob with identical results), not
supported (outside this project: inference, RL, other model families, FP8, MLA, MTP,
TP overlap, FSDP, context parallelism), or not supported yet. Megatron's own refusals
of its retired flags keep Megatron's words.
"""

# How each flag parses (upstream's argparse action): switches and lists; the others take one value.
_SWITCHES = set(
    """
        --adlr-autoresume --allow-ambiguous-pad-tokens --apply-residual-connection-post-layernorm
        --batch-invariant-mode --bert-no-binary-head --biencoder-shared-query-context-model --cache-mla-latents
        --calc-ft-timeouts --check-for-large-grads --ckpt-convert-update-legacy-dist-opt-format
        --ckpt-drop-redundant-extra-state --ckpt-fully-parallel-load-per-rank-objects
        --ckpt-pg-tensors-cache-create --cpu-offloading-retain-pinned-cpu-buffers --create-all-gather-group
        --data-parallel-random-init --dataloader-inter-document-masking --ddp-pad-buckets-for-high-nccl-busbw
        --decode-only-cuda-graphs --decrease-batch-size-if-needed --delay-offload-until-cuda-graph
        --dino-norm-last-layer --disable-align-grad-reduce --disable-ckpt-load-validate-sharding-integrity
        --disable-clone-scatter-output-in-embedding --disable-dsa-indexer-rotate-activation
        --disable-dsa-indexer-scoring-relu --disable-flight-recorder-dump-on-timeout
        --disable-flight-recorder-extra-dump-on-exec --disable-flight-recorder-include-only-active
        --disable-fp8-wgrad --disable-jit-fuser --disable-log-loss-scale-to-tensorboard --disable-manual-gc-eval
        --disable-msc --disable-pad-vocab-size --disable-save-tokenizer-assets --disable-straggler-on-startup
        --disable-strict-fsdp-dtensor-load --disable-symmetric-registration --disable-tp-comm-bulk-dgrad
        --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs
        --disable-tp-comm-split-ag --disable-tp-comm-split-rs --disable-use-tokenizer-model-from-checkpoint-args
        --dist-ckpt-save-pre-mcore-014 --distrib-optim-fully-reshardable-mem-efficient
        --distribute-saved-activations --dsa-indexer-k-norm-fp32 --dsa-indexer-rope-interleaved
        --dsa-indexer-use-sparse-loss --enable-ft-package --enable-full-sharding-in-hsdp
        --enable-mhc-connections --enable-msc --ep-overlap-early-attn-memory-release
        --exit-signal-handler-for-dataloader --exit-signal-handler-for-training --fake-process-group
        --flight-recorder-include-stack-trace --fp16-lm-cross-entropy --fp32-residual-connection
        --freeze-all-layers --fsdp-db-use-persist-buf-on-alloc-fail --full-validation --fused-residual-rmsnorm
        --gdp-cutedsl-kernel --grpo-filter-groups-with-same-reward --gtp-expert-remat-nccl-ub
        --gtp-remat-nccl-ub --gtp-remat-reduce-scatter-with-fp32-accumulation --high-priority-a2a-comm-stream
        --hybrid-context-parallel --inference-cuda-graph-all-prefills --inference-disable-ep-consensus
        --inference-disable-triton-nvls-kernels --inference-dynamic-batching
        --inference-dynamic-batching-prefix-caching --inference-dynamic-batching-track-generated-token-events
        --inference-dynamic-batching-track-paused-request-events --inference-fuse-tp-communication
        --inference-moe-disable-fused-quant-kernels --inference-text-gen-server-logging
        --inference-use-synchronous-zmq-collectives --inference-wandb-logging --init-method-xavier-uniform
        --inprocess-empty-cuda-cache --inprocess-restart --keep-fp8-transpose-cache --lazy-mpu-init
        --load-main-params-from-ckpt --log-device-memory-used --log-energy --log-max-attention-logit
        --log-straggler --log-world-size-to-tensorboard --logits-load-ignore-errors
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer
        --mla-down-proj-fusion --moe-apply-probs-on-input --moe-layer-recompute --moe-paged-stash
        --moe-router-padding-for-quantization --moe-routing-trace-capture-hidden-states
        --moe-routing-trace-capture-logits --moe-routing-trace-dump-weights --moe-single-grouped-bias
        --moe-single-grouped-weight --moe-use-grouped-tensor --moe-use-upcycling --mtp-detach-heads --mtp-hsm
        --mtp-standalone --mtp-use-repeated-layer --multiple-validation-sets --nccl-all-reduce-for-prefill
        --no-align-grad-reduce --no-align-param-gather --no-barrier-with-level-1-timing
        --no-ckpt-load-validate-sharding-integrity --no-clone-scatter-output-in-embedding
        --no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu --no-flight-recorder-dump-on-timeout
        --no-flight-recorder-extra-dump-on-exec --no-flight-recorder-include-only-active
        --no-gradient-reduce-div-fusion --no-inference-disable-ep-consensus
        --no-inference-dynamic-batching-prefix-caching --no-inference-text-gen-server-logging
        --no-inference-use-synchronous-zmq-collectives --no-inference-wandb-logging --no-initialization
        --no-log-loss-scale-to-tensorboard --no-manual-gc-eval --no-one-logger --no-overlap-p2p-communication
        --no-pad-vocab-size --no-pin-cpu-grads --no-pin-cpu-params --no-rl-inference-logprobs-is-correction
        --no-rl-offload-inference-model-weights-when-idle --no-rl-partial-rollouts --no-rl-persist-cuda-graphs
        --no-rl-skip-bos-token --no-rl-training-cuda-graphs --no-rl-use-sequence-packing
        --no-rl-verify-model-weights-swap --no-save-tokenizer-assets --no-strict-fsdp-dtensor-load
        --no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs
        --no-tp-comm-split-ag --no-tp-comm-split-rs --no-use-tokenizer-model-from-checkpoint-args
        --no-yarn-correction-range-round-to-int --one-logger-async --openai-gelu --optimizer-cpu-offload
        --optimizer-cuda-graph --otel-enabled --output-bert-embeddings --overlap-cpu-optimizer-d2h-h2d
        --overlap-dispatch-backward-with-experts-wgrad --qk-clip --qk-l2-norm --replication
        --retriever-score-scaling --rl-durable-rollout-bank
        --rl-inference-logprobs-is-correction --rl-offload-inference-model-weights-when-idle
        --rl-persist-cuda-graphs --rl-profile --rl-skip-bos-token --rl-training-cuda-graphs
        --rl-verify-model-weights-swap --run-workload-inspector-server --skip-train
        --tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast
        --torch-fsdp2-no-reshard-after-forward --tp-comm-overlap-rs-dgrad --trust-remote-code
        --use-checkpoint-args --use-cpu-initialization --use-dist-ckpt --use-gigatoken
        --use-grouped-gemm-for-dense-mlp --use-grouped-gemm-for-shared-expert --use-kitchen-attention
        --use-legacy-static-engine --use-mp-args-from-checkpoint-args --use-one-sent-docs
        --use-ring-exchange-p2p --use-rotary-position-embeddings --use-same-sampling-seed-across-dp-ranks
        --use-sharp --use-te-activation-func --use-torch-optimizer-for-cpu-offload --vision-pretraining
        --yarn-correction-range-round-to-int
    """.split()
)
_LISTS = set(
    """
        --ddp-param-name-patterns-for-fp32-local-accumulation --gtp-remat-opt-in-modules --iterations-to-skip
        --mrope-section --retriever-report-topk-accuracies --rl-inference-parsers --validation-set-names
    """.split()
)


def _nargs(flag: str):
    from megatron.training.known_flags import LIST, SWITCH, VALUE

    return SWITCH if flag in _SWITCHES else LIST if flag in _LISTS else VALUE


# (note) per family of flags accepted with no effect.
_NOOPS = {
    "torch.distributed.launch passes it; ranks here read LOCAL_RANK from the environment": """
        --local-rank
    """,
    "weights are drawn on the parameters' device, from the same distribution (a CPU draw gives other samples of it)": """
        --use-cpu-initialization
    """,
    "skips the initial draw of weights a checkpoint then overwrites; here the draw is cheap and --load overwrites it the same way": """
        --no-initialization
    """,
    "Megatron never reads it: with --exit-signal-handler the data-loader workers ignore --exit-signal, there and here": """
        --exit-signal-handler-for-dataloader
    """,
    "Megatron parses it but its core models never read it (a legacy-model switch): the same model": """
        --openai-gelu --apply-residual-connection-post-layernorm
    """,
    "deprecated in Megatron, where it has no effect either: --ckpt-format picks the format": """
        --use-dist-ckpt --dist-ckpt-format
    """,
    "checkpoint I/O parallelism, priorities and caches; torch_dist checkpoints here are written and read the same way": """
        --dist-ckpt-workers --async-ckpt-cpu-priority --async-ckpt-io-priority
        --ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-per-rank-objects
        --ckpt-fully-parallel-load-process-group --ckpt-fully-parallel-save-process-group
        --ckpt-pg-tensors-cache-create --ckpt-pg-tensors-cache-path
        --distrib-optim-fully-reshardable-mem-efficient --no-ckpt-load-validate-sharding-integrity
        --disable-ckpt-load-validate-sharding-integrity
    """,
    "Transformer Engine's _extra_state: there is none here": """
        --ckpt-drop-redundant-extra-state
    """,
    "NVIDIA telemetry, cluster autoresume and fault-tolerance monitoring services; training is unchanged": """
        --no-one-logger --one-logger-async --one-logger-project --one-logger-run-name --app-tag-run-name
        --app-tag-run-version --adlr-autoresume --adlr-autoresume-interval --enable-ft-package
        --calc-ft-timeouts --ft-num-warmup-iters --otel-enabled --otel-service-name --otel-span-groups
        --run-workload-inspector-server --gpu-sniff-test-interval --log-energy --log-straggler
        --disable-straggler-on-startup --straggler-ctrlr-port --config-logger-dir
        --result-rejected-tracker-filename
    """,
    "NCCL flight-recorder dumps and communicator tuning; the same collectives": """
        --disable-flight-recorder-dump-on-timeout --no-flight-recorder-dump-on-timeout
        --disable-flight-recorder-extra-dump-on-exec --no-flight-recorder-extra-dump-on-exec
        --disable-flight-recorder-include-only-active --no-flight-recorder-include-only-active
        --flight-recorder-dump-path --flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size
        --nccl-communicator-config-path --use-sharp --sharp-enabled-group --disable-symmetric-registration
        --high-priority-a2a-comm-stream --distributed-timeout-seconds-after-init
    """,
    "how communication is launched and overlapped; the same gradients and parameters": """
        --create-all-gather-group --ddp-pad-buckets-for-high-nccl-busbw --no-align-param-gather
        --no-align-grad-reduce --disable-align-grad-reduce --no-gradient-reduce-div-fusion
        --no-overlap-p2p-communication --use-ring-exchange-p2p --train-sync-interval
        --no-barrier-with-level-1-timing
    """,
    "fusion kernels from apex/TE are not used; plain PyTorch computes the same thing": """
        --disable-jit-fuser --fused-residual-rmsnorm --use-te-activation-func
        --no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding
    """,
    "a memory layout of recomputed or pinned tensors; the same values": """
        --distribute-saved-activations --no-pin-cpu-grads --no-pin-cpu-params
    """,
    "dataset-building threads and object-storage caches; the same samples": """
        --num-dataset-builder-threads --object-storage-cache-path --disable-msc
    """,
    "Megatron derives it from --hidden-size and --mup-base-hidden-size and overwrites the given value": """
        --mup-width-mult
    """,
    "workarounds for the ONNX exporter; training is unchanged": """
        --onnx-safe
    """,
    "lets transformers run a Hub tokenizer's own code; this trainer reads a local tokenizer.json and runs none": """
        --trust-remote-code
    """,
    "checkpoints here keep no tokenizer files": """
        --no-save-tokenizer-assets --disable-save-tokenizer-assets
    """,
    "garbage collection around evaluation with --manual-gc; the same values": """
        --no-manual-gc-eval --disable-manual-gc-eval
    """,
    "TensorBoard's writer queue; the same scalars": """
        --tensorboard-queue-size
    """,
    "read by encoder-decoder models only; a GPT trains at --seq-length": """
        --decoder-seq-length
    """,
    "rewritten to --position-embedding-type rope before parsing, with Megatron's deprecation warning": """
        --use-rotary-position-embeddings
    """,
    "rewritten to --apply-wd-to-qk-layernorm before parsing (its only valid value), with Megatron's deprecation warning": """
        --no-weight-decay-cond-type
    """,
}

# (what, fix) per family of flags outside this project.
_NEVER = {
    ("inference", "this is a training script"): """
        --no-inference-disable-ep-consensus --no-inference-dynamic-batching-prefix-caching --no-inference-text-gen-server-logging --no-inference-use-synchronous-zmq-collectives --no-inference-wandb-logging --bert-embedder-type --decode-only-cuda-graphs --inference-batch-times-seqlen-threshold
        --inference-coordinator-port --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens
        --inference-cuda-graph-scope --inference-disable-ep-consensus --inference-disable-triton-nvls-kernels
        --inference-dynamic-batching --inference-dynamic-batching-async-sched-mode
        --inference-dynamic-batching-block-size --inference-dynamic-batching-cuda-graph-mixed-prefill-count
        --inference-dynamic-batching-cuda-graph-sizing-distribution --inference-dynamic-batching-logprobs-mode
        --inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-paused-buffer-size-gb
        --inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-prefix-caching-coordinator-policy
        --inference-dynamic-batching-prefix-caching-eviction-policy
        --inference-dynamic-batching-prefix-caching-mamba-gb
        --inference-dynamic-batching-prefix-caching-routing-alpha --inference-dynamic-batching-sampling-backend
        --inference-dynamic-batching-track-generated-token-events
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-unified-memory-level --inference-fuse-tp-communication
        --inference-grouped-gemm-backend --inference-moe-disable-fused-quant-kernels
        --inference-moe-token-dispatcher-type --inference-shards --inference-text-gen-server-logging
        --inference-use-synchronous-zmq-collectives --inference-wandb-logging
        --mamba-inference-conv-states-dtype --mamba-inference-ssm-states-dtype --mlp-chunks-for-prefill
        --nccl-all-reduce-for-prefill --num-speculative-tokens --output-bert-embeddings
        --use-legacy-static-engine --use-same-sampling-seed-across-dp-ranks --symmetric-ar-type
        --batch-invariant-mode --batch-invariant-backend --lazy-mpu-init
    """,
    ("RL", "drop the flag"): """
        --grpo-filter-groups-with-same-reward --refit-method --no-rl-partial-rollouts --no-rl-use-sequence-packing --no-rl-inference-logprobs-is-correction --no-rl-offload-inference-model-weights-when-idle --no-rl-persist-cuda-graphs --no-rl-skip-bos-token --no-rl-training-cuda-graphs --no-rl-verify-model-weights-swap --rl-consumption-granularity
        --rl-default-temperature --rl-default-top-k --rl-default-top-p --rl-durable-rollout-bank
        --rl-importance-sampling-truncation-coef --rl-inference-expert-model-parallel-size
        --rl-inference-expert-tensor-model-parallel-size --rl-inference-logprobs-is-correction
        --rl-inference-model-unified-memory-level --rl-inference-parsers
        --rl-inference-pipeline-model-parallel-size --rl-inference-tensor-model-parallel-size
        --rl-kv-cache-management-mode --rl-max-inflight-requests --rl-offload-inference-model-weights-when-idle
        --rl-persist-cuda-graphs --rl-profile --rl-profile-dir --rl-prompts-per-eval --rl-rollout-bank-dir
        --rl-rollout-bank-max-bytes --rl-sequence-packing-max-sequences-per-bin --rl-skip-bos-token
        --rl-submission-granularity --rl-training-cuda-graphs --rl-verify-model-weights-swap
    """,
    ("SFT", "drop the flag"): """
        --chat-template
    """,
    ("multi-latent attention or DSA sparse attention (it builds on multi-latent attention)", "drop the flag"): """
        --cache-mla-latents --mla-down-proj-fusion --disable-dsa-indexer-rotate-activation
        --no-dsa-indexer-rotate-activation --disable-dsa-indexer-scoring-relu --no-dsa-indexer-scoring-relu
        --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-rope-interleaved
        --dsa-indexer-skip-topk-offset --dsa-indexer-topk-freq --dsa-indexer-use-sparse-loss
        --dsa-kernel-backend --yarn-beta-fast --yarn-beta-slow --yarn-correction-range-round-to-int
        --no-yarn-correction-range-round-to-int --yarn-original-max-position-embeddings
    """,
    ("multi-token prediction", "drop the flag"): """
        --mtp-detach-heads --mtp-hsm --mtp-hybrid-override-pattern --mtp-standalone --mtp-use-repeated-layer
    """,
    ("FP8 / FP4 training or quantization recipes", "use --bf16"): """
        --disable-fp8-wgrad --keep-fp8-transpose-cache --te-precision-config-file
        --moe-router-padding-for-quantization --use-kitchen-attention --kitchen-attention-backend
        --kitchen-config-file --kitchen-recipe-number
    """,
    ("TE userbuffers / TP communication overlap", "drop the flag"): """
        --disable-tp-comm-bulk-dgrad --no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad
        --no-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag --no-tp-comm-overlap-ag
        --disable-tp-comm-overlap-rs --no-tp-comm-overlap-rs --disable-tp-comm-split-ag --no-tp-comm-split-ag
        --disable-tp-comm-split-rs --no-tp-comm-split-rs --tp-comm-bootstrap-backend --tp-comm-overlap-rs-dgrad
    """,
    ("FSDP", "use --use-distributed-optimizer or plain DP"): """
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer
        --megatron-fsdp-version --fsdp-db-use-persist-buf-on-alloc-fail --torch-fsdp2-no-reshard-after-forward
        --suggested-communication-unit-size --enable-full-sharding-in-hsdp --no-strict-fsdp-dtensor-load
        --disable-strict-fsdp-dtensor-load
    """,
    ("context parallelism", "drop the flag"): """
        --hybrid-context-parallel --max-seqlen-per-dp-cp-rank
    """,
    ("vision models (ViT, DINO, Swin)", "this trainer trains GPT, MoE and hybrid models"): """
        --classes-fraction --data-per-class-fraction --dino-bottleneck-size --dino-freeze-last-layer
        --dino-head-hidden-size --dino-local-crops-number --dino-local-img-size --dino-norm-last-layer
        --dino-teacher-temp --dino-warmup-teacher-temp --dino-warmup-teacher-temp-epochs --head-lr-mult --img-h
        --img-w --iter-per-epoch --mask-factor --mask-type --num-channels --num-classes
        --patch-dim --swin-backbone-type --vision-backbone-type --vision-pretraining --vision-pretraining-type
        --mrope-section
    """,
    (
        "BERT, T5, retrieval (ICT, REALM) or encoder-decoder models",
        "this trainer trains GPT, MoE and hybrid models",
    ): """
        --bert-load --bert-no-binary-head --biencoder-projection-dim --biencoder-shared-query-context-model
        --block-data-path --embedding-path --evidence-data-path --ict-head-size --ict-load --indexer-batch-size
        --indexer-log-interval --query-in-block-prob --retriever-report-topk-accuracies
        --retriever-score-scaling --titles-data-path --use-one-sent-docs --mask-prob --short-seq-prob
        --sample-rate --encoder-seq-length --decoder-num-layers --relative-attention-max-distance
        --relative-attention-num-buckets
    """,
    ("a fake process group (profiling without communication)", "run with real ranks"): """
        --fake-process-group
    """,
}

# Megatron's own refusal of its retired flags.
_RETIRED = {
    "--batch-size": "--batch-size argument is no longer valid, use --micro-batch-size instead.",
    "--warmup": "--warmup argument is no longer valid, use --lr-warmup-fraction instead.",
    "--model-parallel-size": "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead.",
}

# (what, fix) per family of flags not supported yet.
_NOT_YET = {
    ("offline distillation from cached logits", "distil online with --export-kd-teacher-load"): """
        --logits-load-decode-threads --logits-load-dir --logits-load-ignore-errors --logits-load-kd-loss-alpha
        --logits-load-msc-prefetch-depth --logits-load-prefetch-factor --logits-save-dir --logits-save-dtype
        --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --freeze-all-layers
    """,
    ("CPU offloading of the optimizer or activations", "drop the flag"): """
        --optimizer-cpu-offload --optimizer-offload-fraction --overlap-cpu-optimizer-d2h-h2d
        --use-torch-optimizer-for-cpu-offload --activation-offload-fraction --cpu-offloading-num-layers
        --cpu-offloading-retain-pinned-cpu-buffers --fine-grained-offloading-max-inflight-offloads
        --delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks
    """,
    ("a CUDA graph of the optimizer step", "drop the flag"): """
        --optimizer-cuda-graph
    """,
    ("MoE upcycling from a dense checkpoint", "drop the flag"): """
        --moe-use-upcycling --moe-upcycling-granularity
    """,
    ("heterogeneous (per-layer) model configs", "drop the flag"): """
        --heterogeneous-layers-config-encoded-json --heterogeneous-layers-config-path
    """,
    ("a YAML file of arguments", "pass the flags on the command line"): """
        --yaml-cfg
    """,
    ("the data loader's masking between documents of a packed batch", "drop the flag"): """
        --dataloader-inter-document-masking
    """,
    ("other activations and position encodings", "drop the flag"): """
        --fp32-residual-connection --init-method-xavier-uniform --qk-clip --qk-clip-alpha --qk-clip-threshold
        --enable-mhc-connections --mhc-init-gating-factor --mhc-num-residual-streams
        --mhc-recompute-layer-num --mhc-sinkhorn-iterations --mlp-chunks-for-training
        --fp16-lm-cross-entropy --output-logit-dtype --log-max-attention-logit
    """,
    ("these MoE options", "drop the flag"): """
        --moe-latent-size
        --moe-mlp-glu-interleave-size --moe-shared-expert-glu-interleave-size --moe-paged-stash
        --moe-paged-stash-buffer-size-factor-cpu --moe-paged-stash-buffer-size-factor-cuda
        --moe-paged-stash-page-size --moe-router-force-biased --moe-router-quantile-balancing-ema
        --moe-routing-trace-capture-hidden-states --moe-routing-trace-capture-logits
        --moe-routing-trace-dump-weights --moe-routing-trace-max-training-iters --moe-routing-trace-path
    """,
    ("generalized tensor parallelism (weight re-materialization)", "drop the flag"): """
        --gtp-expert-remat-nccl-ub --gtp-remat-nccl-ub --gtp-remat-opt-in-modules
        --gtp-remat-reduce-scatter-with-fp32-accumulation --gdp-cutedsl-kernel
        --gdp-num-chunk-states-to-recompute --gdp-num-householder
    """,
    ("these checkpoint options", "drop the flag"): """
        --ckpt-convert-format
        --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format --dist-ckpt-save-pre-mcore-014
        --non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir --replication
        --replication-factor --replication-jump
    """,
    ("these training-loop options", "drop the flag"): """
        --check-for-large-grads --full-validation --multiple-validation-sets --validation-set-names
        --ddp-param-name-patterns-for-fp32-local-accumulation
        --dump-param-to-param-group-map
    """,
    ("debug dumps of activations, data gradients and routing", "drop the flag"): """
        --save-activations-interval --save-dgrads-interval --save-tokens-per-expert-interval
    """,
    (
        "fault injection and in-process restart (nvidia-resiliency-ext)",
        "restart the job from its checkpoint instead",
    ): """
        --fault-injector-delay-start-iteration --fault-injector-fault-delay --fault-injector-fault-probabilities
        --fault-injector-fault-types --fault-injector-mtti-seconds --fault-injector-num-ranks
        --fault-injector-offset-seconds --fault-injector-ranks --fault-injector-seed
        --inprocess-active-world-size --inprocess-barrier-timeout --inprocess-completion-timeout
        --inprocess-empty-cuda-cache --inprocess-granularity --inprocess-hard-timeout
        --inprocess-heartbeat-interval --inprocess-heartbeat-timeout --inprocess-last-call-wait
        --inprocess-max-iterations --inprocess-monitor-process-interval --inprocess-monitor-thread-interval
        --inprocess-progress-watchdog-interval --inprocess-restart --inprocess-soft-timeout
        --inprocess-termination-grace-time
    """,
    ("these tokenizer options", "drop the flag"): """
        --tiktoken-num-special-tokens --use-gigatoken --tokenizer-hf-no-use-fast
    """,
    ("object storage (Multi-Storage Client)", "read the data from local paths"): """
        --enable-msc
    """,
}


def flag_families() -> dict:
    """Every flag of the families above -> its ``KnownFlag`` (``known_flags`` merges them into its table)."""
    from megatron.training.known_flags import KnownFlag, never, noop, not_yet  # it imports this module

    out = {}
    for note, flags in _NOOPS.items():
        out.update({f: noop(_nargs(f), note) for f in flags.split()})
    for (what, fix), flags in _NEVER.items():
        out.update({f: never(f, _nargs(f), what, fix) for f in flags.split()})
    for (what, fix), flags in _NOT_YET.items():
        out.update({f: not_yet(f, _nargs(f), what, fix) for f in flags.split()})
    out.update({f: KnownFlag(_nargs(f), message) for f, message in _RETIRED.items()})
    return out
