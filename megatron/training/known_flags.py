"""Megatron flags that are not fields of our config dataclasses, and what each one does here.

Every flag of upstream's GPT, MoE and hybrid training configs parses. A flag that is not
a config field is in ``KNOWN_MEGATRON_FLAGS`` with one of three answers:

- *accepted, no effect*: upstream's meaning is a speed or I/O knob, results identical
  (fusions we do not have, checkpoint I/O parallelism, worker processes ...). A run
  prints one line naming the ones it was given.
- *not supported*: what this project does not do: FP8, multi-latent attention (and DSA on it),
  multi-token prediction, context parallelism, TE userbuffers / TP communication
  overlap, Megatron-FSDP / torch FSDP2, inference, RL, SFT.
- *not supported yet*: MoE, hybrid (Mamba) and parallel-layout flags whose issues are
  open, and a few upstream features nobody has asked for here yet.

Rejections raise ``ValueError`` naming the flag and the fix after parsing, all of
them in one message, so a command line learns everything in one launch. Every other
flag of upstream's training parser is answered by family in ``flag_families.py``.
"""

from typing import NamedTuple

from megatron.training.flag_families import flag_families as _flag_families


class KnownFlag(NamedTuple):
    """A Megatron flag this trainer recognises but that is no config field.

    Attributes:
        nargs: 0 for a switch, None for one value, or an argparse nargs string.
        message: None: accepted and ignored. Otherwise the ``ValueError`` text (it
            names the flag and the fix; ``{value}`` is replaced by the given value).
        accepted_values: For value flags: values that are accepted as no-ops even
            though ``message`` rejects the others.
        note: Why an accepted flag is harmless (shown in --help and the user guide).
    """

    nargs: int | str | None
    message: str | None
    accepted_values: tuple[str, ...] = ()
    note: str = ""


SWITCH = 0
VALUE = None
LIST = "*"

_NO_FUSION = "fusion kernels from apex/TE are not used; plain PyTorch computes the same thing"
_CKPT_IO = "checkpoint I/O parallelism; torch_dist checkpoints here are written and read the same way"


def noop(nargs, note: str) -> KnownFlag:
    """Accepted, no effect (a speed or I/O knob with identical results)."""
    return KnownFlag(nargs, None, note=note)


def never(flag: str, nargs, what: str, fix: str = "drop the flag") -> KnownFlag:
    """Rejected for good: this project does not do ``what``."""
    return KnownFlag(nargs, f"{flag} is not supported: this trainer does not do {what}; {fix}.")


def not_yet(flag: str, nargs, what: str = "", fix: str = "drop the flag") -> KnownFlag:
    """Rejected until the feature lands."""
    label = f"{flag} ({what})" if what else flag
    return KnownFlag(nargs, f"{label} is not supported yet; {fix}.")


def _family(flags: dict[str, object], make) -> dict[str, KnownFlag]:
    return {flag: make(flag, nargs) for flag, nargs in flags.items()}


# Router replay: RL and inference frameworks record and replay routing decisions through Megatron's
# Python API (RouterReplay); a pretraining command line alone never sets an action.
_ROUTER_REPLAY = {
    "--moe-enable-routing-replay": SWITCH,
}

# Flags of Megatron's post-training scripts (ModelOpt export, the multimodal example's model
# provider), which upstream's configs pass through to those scripts; nothing a pretraining run reads.
_POST_TRAINING = {
    "--is-hybrid-model": SWITCH,
    "--model-provider": VALUE,
    "--export-model-type": VALUE,
    "--export-default-te-spec": SWITCH,
}

_FP8 = {
    "--fp8-format": VALUE,
    "--fp8-recipe": VALUE,
    "--fp8-param-gather": SWITCH,
    "--first-last-layers-bf16": SWITCH,
    "--fp8-margin": VALUE,
    "--fp8-interval": VALUE,
    "--fp8-amax-history-len": VALUE,
    "--fp8-amax-compute-algo": VALUE,
    "--no-fp8-wgrad": SWITCH,
    "--fp8-output-proj": SWITCH,
    "--fp8-dot-product-attention": SWITCH,
    "--fp8-multi-head-attention": SWITCH,
    "--fp8-quantizer-factory": VALUE,
    "--tp-only-amax-red": SWITCH,
    "--num-layers-at-start-in-bf16": VALUE,
    "--num-layers-at-end-in-bf16": VALUE,
    "--moe-router-padding-for-fp8": SWITCH,
    "--reuse-grad-buf-for-mxfp8-param-ag": SWITCH,
    "--fp4-format": VALUE,
    "--fp4-recipe": VALUE,
    "--fp4-param-gather": SWITCH,
    "--fp4-quantizer-factory": VALUE,
}
_MLA = {
    "--multi-latent-attention": SWITCH,
    "--q-lora-rank": VALUE,
    "--kv-lora-rank": VALUE,
    "--qk-head-dim": VALUE,
    "--qk-pos-emb-head-dim": VALUE,
    "--v-head-dim": VALUE,
    "--mscale": VALUE,
    "--mscale-all-dim": VALUE,
}
_MTP = {"--mtp-num-layers": VALUE, "--mtp-loss-scaling-factor": VALUE}
_CP = {"--cp-comm-type": LIST, "--hierarchical-context-parallel-sizes": LIST}
_TP_OVERLAP = {"--tp-comm-overlap": SWITCH, "--tp-comm-overlap-cfg": VALUE}
_FSDP = {
    "--use-megatron-fsdp": SWITCH,
    "--use-torch-fsdp2": SWITCH,
    "--megatron-fsdp-main-params-dtype": VALUE,
    "--megatron-fsdp-main-grads-dtype": VALUE,
    "--megatron-fsdp-grad-comm-dtype": VALUE,
    "--init-model-with-meta-device": SWITCH,
    "--fsdp-double-buffer": SWITCH,
    "--fsdp-manual-registration": SWITCH,
}
_INFERENCE = {
    "--moe-pad-experts-for-cuda-graph-inference": SWITCH,
    "--inference-max-seq-length": VALUE,
    "--inference-max-requests": VALUE,
    "--inference-rng-tracker": SWITCH,
    "--inference-ckpt-non-strict": SWITCH,
    "--inference-dynamic-batching-buffer-size-gb": VALUE,
    "--inference-dynamic-batching-max-requests": VALUE,
    "--inference-dynamic-batching-max-tokens": VALUE,
    "--inference-dynamic-batching-num-cuda-graphs": VALUE,
    "--inference-logging-step-interval": VALUE,
    "--inference-repeat-n": VALUE,
    "--prompts": LIST,
    "--prompt-file": VALUE,
    "--num-tokens-to-generate": VALUE,
    "--temperature": VALUE,
    "--top_k": VALUE,
    "--top_p": VALUE,
    "--return-log-probs": SWITCH,
    "--output-path": VALUE,
    "--incoming-requests-per-sec": VALUE,
    "--incoming-requests-per-step": VALUE,
    "--enable-chunked-prefill": SWITCH,
    "--flash-decode": SWITCH,
    "--max-tokens-to-oom": VALUE,
    "--use-flashinfer-fused-rope": SWITCH,
}
_RL = {
    "--perform-rl-step": SWITCH,
    "--grpo-group-size": VALUE,
    "--grpo-prompts-per-step": VALUE,
    "--grpo-iterations": VALUE,
    "--grpo-clamp-eps-lower": VALUE,
    "--grpo-clamp-eps-upper": VALUE,
    "--grpo-kl-beta": VALUE,
    "--grpo-entropy-term-weight": VALUE,
    "--langrl-env-config": VALUE,
    "--rl-use-sequence-packing": SWITCH,
    "--rl-sequence-packing-algo": VALUE,
    "--rl-offload-optimizer-during-inference": SWITCH,
    "--rl-partial-rollouts": SWITCH,
    "--rl-generation-lag": VALUE,
}
_FLEXTRON = (
    "--flextron --enable-router --binary-mask --soft-mask --slice --hard-sample-th --router-beta "
    "--original-model-sample-prob --tau-init --tau-decay --loss-alpha --lr-mult-router --router-gbs "
    "--router-inter-dim --budget-list --budget-probs --budget-type --emb-int-list --mlp-int-list "
    "--mamba-int-list --moe-expert-int-list --linear-scaler-start --linear-scaler-end --router-std"
).split()
_FLEXTRON_SWITCHES = {"--flextron", "--enable-router", "--binary-mask", "--soft-mask", "--slice"}
_FLEXTRON_LISTS = {
    "--budget-list",
    "--budget-probs",
    "--emb-int-list",
    "--mlp-int-list",
    "--mamba-int-list",
    "--moe-expert-int-list",
}
_DSA = {
    "--dsa-indexer-n-heads": VALUE,
    "--dsa-indexer-head-dim": VALUE,
    "--dsa-indexer-topk": VALUE,
    "--dsa-indexer-loss-coeff": VALUE,
}

KNOWN_MEGATRON_FLAGS: dict[str, KnownFlag] = {
    # ---- accepted: speed or I/O knobs; results are identical.
    "--use-flash-attn": noop(SWITCH, "attention uses scaled_dot_product_attention, which picks flash kernels itself"),
    "--use-mcore-models": noop(SWITCH, "models here are always the core models"),
    "--no-masked-softmax-fusion": noop(SWITCH, _NO_FUSION),
    "--no-bias-gelu-fusion": noop(SWITCH, _NO_FUSION),
    "--no-bias-swiglu-fusion": noop(SWITCH, _NO_FUSION),
    "--no-bias-dropout-fusion": noop(SWITCH, _NO_FUSION),
    "--no-rope-fusion": noop(SWITCH, _NO_FUSION),
    "--no-persist-layer-norm": noop(SWITCH, _NO_FUSION),
    "--use-fused-weighted-squared-relu": noop(SWITCH, _NO_FUSION),
    "--use-transformer-engine-op-fuser": noop(SWITCH, _NO_FUSION),
    "--te-rng-tracker": noop(SWITCH, "dropout draws from torch's generators; there is no TE RNG tracker"),
    "--cross-entropy-fusion-impl": noop(VALUE, "which fused cross-entropy kernel; --cross-entropy-loss-fusion picks"),
    "--use-persistent-ckpt-worker": noop(SWITCH, "--async-save here writes from one background thread"),
    "--async-strategy": noop(VALUE, "--async-save here writes from one background thread"),
    "--async-ckpt-use-cpu-shm": noop(SWITCH, "--async-save copies tensors to CPU memory before writing"),
    "--ckpt-fully-parallel-save": noop(SWITCH, _CKPT_IO),
    "--no-ckpt-fully-parallel-save": noop(SWITCH, _CKPT_IO),
    "--ckpt-fully-parallel-load": noop(SWITCH, _CKPT_IO),
    "--ckpt-assume-constant-structure": noop(SWITCH, "caches the save plan; the same files are written"),
    "--dist-ckpt-optim-fully-reshardable": noop(
        SWITCH, "torch_dist optimizer state here is always keyed by global parameter names"
    ),
    "--verify-integrity": noop(SWITCH, "checks checkpoint files; the loaded values are the same"),
    "--vocab-extra-ids": noop(
        VALUE, "Megatron's tokenizers no longer read it (it gave the removed legacy T5/BERT tokenizers sentinel ids)"
    ),
    "--no-mmap-bin-files": noop(SWITCH, "reads .bin files with or without mmap give the same bytes"),
    "--disable-gloo-process-groups": noop(SWITCH, "no gloo side groups are made with NCCL here"),
    "--check-weight-hash-across-dp-replicas-interval": noop(VALUE, "a consistency check of replicas; no value changes"),
    "--empty-unused-memory-level": noop(VALUE, "torch.cuda.empty_cache calls; no value changes"),
    "--rotary-scaling-factor": noop(
        VALUE, "Megatron reads it only in multi-latent attention's YaRN rotary embedding, which is refused here"
    ),
    "--distributed-timeout-minutes-for-ckpt": noop(VALUE, "a timeout; no value changes"),
    "--log-progress": noop(SWITCH, "writes a progress.txt; training is unchanged"),
    "--no-record-throughput": noop(SWITCH, "progress logging only"),
    "--straggler-minmax-count": noop(VALUE, "straggler reporting only"),
    "--test-mode": noop(SWITCH, "runs a consistency check of the q/k layernorm weights across ranks; no value changes"),
    "--overlap-param-gather-with-optimizer-step": noop(
        SWITCH, "overlaps the first chunk's parameter all-gather with the optimizer step; the same parameters"
    ),
    "--overlap-p2p-communication-warmup-flush": noop(
        SWITCH, "overlaps pipeline sends/receives in warm-up and flush; the same activations and gradients"
    ),
    "--defer-embedding-wgrad-compute": noop(
        SWITCH, "defers the output layer's weight-gradient GEMMs to the pipeline flush; the same gradient sum"
    ),
    "--wgrad-deferral-limit": noop(VALUE, "how many micro-batches --defer-embedding-wgrad-compute defers"),
    "--no-use-layer-wise-param-layout": noop(
        SWITCH, "a buffer layout of the layer-wise (Muon) distributed optimizer, which this trainer does not use"
    ),
    "--moe-permute-fusion": noop(SWITCH, "TE's fused token permutation; the dispatcher permutes the same rows"),
    "--moe-router-fusion": noop(SWITCH, "TE's fused top-k routing and aux loss; the router computes the same values"),
    "--moe-shared-expert-overlap": noop(
        SWITCH, "overlaps the shared experts with the token dispatch; the same outputs (Megatron's rules checked)"
    ),
    "--overlap-moe-expert-parallel-comm": noop(
        SWITCH, "overlaps the expert-parallel all-to-all with another micro-batch's compute (Megatron's rules checked)"
    ),
    "--delay-wgrad-compute": noop(
        SWITCH,
        "delays expert weight gradients to overlap the all-to-all; the same gradients (Megatron's rules checked)",
    ),
    "--overlap-dispatch-backward-with-experts-wgrad": noop(
        SWITCH, "overlaps the experts' weight gradients with the dispatch backward; the same gradients (rules checked)"
    ),
    "--ep-overlap-early-attn-memory-release": noop(
        SWITCH,
        "reorders the attention backward under --overlap-moe-expert-parallel-comm; the same values (rules checked)",
    ),
    "--moe-use-grouped-tensor": noop(
        SWITCH, "TE's GroupedTensor kernels for the grouped expert GEMMs; the same products (needs --moe-grouped-gemm)"
    ),
    "--moe-single-grouped-weight": noop(
        SWITCH, "TE stores the experts' weights as one tensor, as they are here anyway (needs --moe-grouped-gemm)"
    ),
    "--moe-single-grouped-bias": noop(
        SWITCH, "TE stores the experts' biases as one tensor, as they are here anyway (needs --moe-grouped-gemm)"
    ),
    "--use-grouped-gemm-for-dense-mlp": noop(SWITCH, "a TE fusion path (a grouped GEMM of one group); the same MLP"),
    "--use-grouped-gemm-for-shared-expert": noop(
        SWITCH, "a TE fusion path (a grouped GEMM of one group) for the shared experts; the same products"
    ),
    "--tiktoken-pattern": noop(
        VALUE, "read only by --tokenizer-type TikTokenizer, which this trainer refuses; other tokenizers ignore it"
    ),
    "--use-nccl-ub": noop(SWITCH, "registers the data-parallel buffers with NCCL (user buffers); the same reductions"),
    "--data-parallel-sharding-strategy": noop(
        VALUE, "Megatron reads it only with --use-megatron-fsdp (refused here); DDP and the distributed optimizer not"
    ),
    "--outer-dp-sharding-strategy": noop(
        VALUE, "Megatron reads it only with --use-megatron-fsdp (refused here); DDP and the distributed optimizer not"
    ),
    "--enable-experimental": noop(SWITCH, "permits Megatron's experimental code paths; nothing here waits for it"),
    "--dataloader-fast-cache-load": noop(
        SWITCH, "skips the rank-0 barrier while the index cache is built; the same cached indices are read"
    ),
    "--dataloader-defer-npy-index-mmap": noop(SWITCH, "maps the cached .npy indices on first access; the same indices"),
    "--per-dataset-sequences-path": noop(
        VALUE, "reads each dataset's sequence and document counts from a JSON file instead of its .idx; the same counts"
    ),
    "--high-priority-stream-groups": noop(LIST, "communication stream priorities; the same collectives"),
    "--enable-gpt-oss": noop(
        SWITCH,
        "Megatron reads it only in ModelOpt's model builder (a ModelOpt checkpoint loaded); a pretraining run builds "
        "the same model without it",
    ),
    "--export-te-mcore-model": noop(
        SWITCH,
        "ModelOpt's model builder names Transformer Engine's fused layer norms as separate modules; layers here are "
        "always this trainer's own, and a distillation config names them as Megatron's local layers do",
    ),
    "--export-force-local-attention": noop(
        SWITCH,
        "Megatron reads it only in ModelOpt's model builder (a ModelOpt checkpoint loaded); attention here is "
        "always this trainer's own",
    ),
    "--moe-permute-fusion-into-hybridep": noop(SWITCH, "fuses HybridEP's permutation; flex runs alltoall here"),
    "--moe-hybridep-pad-uneven-dispatch-inputs": noop(
        SWITCH, "pads HybridEP's inputs to equal token counts (trimmed after combine); flex runs alltoall here"
    ),
    "--moe-hybridep-num-blocks-permute": noop(VALUE, "thread blocks of HybridEP's permute; flex runs alltoall here"),
    "--moe-hybridep-num-blocks-unpermute": noop(
        VALUE, "thread blocks of HybridEP's unpermute; flex runs alltoall here"
    ),
    "--moe-hybridep-num-sms-preprocessing": noop(VALUE, "SMs of HybridEP's metadata scan; flex runs alltoall here"),
    "--moe-dispatch-fwd-dtype": KnownFlag(
        VALUE,
        "--moe-dispatch-fwd-dtype {value} is not supported: the only wire dtype here is bf16 (mxfp8, an "
        "MXFP8-quantized all-to-all payload, is FP8 training, which this trainer does not do); drop the flag.",
        accepted_values=("bf16",),
        note="bf16, Megatron's default, sends the tokens unquantized, as here",
    ),
    "--moe-combine-bwd-dtype": KnownFlag(
        VALUE,
        "--moe-combine-bwd-dtype {value} is not supported: the only wire dtype here is bf16 (mxfp8, an "
        "MXFP8-quantized all-to-all gradient, is FP8 training, which this trainer does not do); drop the flag.",
        accepted_values=("bf16",),
        note="bf16, Megatron's default, sends the gradients unquantized, as here",
    ),
    "--pipeline-model-parallel-comm-backend": KnownFlag(
        VALUE,
        "--pipeline-model-parallel-comm-backend {value} is not supported: pipeline sends and receives here go "
        "through the run's process groups (NCCL on GPUs); drop the flag.",
        accepted_values=("nccl",),
        note="nccl is the backend pipeline exchanges use here on GPUs",
    ),
    "--flash-attention-version": noop(
        VALUE, "pins FlashAttention 2, 3 or 4 in TE; attention here is SDPA's, which picks its own kernel"
    ),
    "--rope-type": KnownFlag(
        VALUE,
        "--rope-type {value} is not supported: Megatron's standard attention takes only --rope-type rope (yarn goes "
        "with multi-latent attention, which this trainer does not do); drop the flag.",
        accepted_values=("rope",),
        note="rope is what --position-embedding-type rope applies",
    ),
    "--ddp-reduce-scatter-with-fp32-accumulation": noop(
        SWITCH,
        "with fp32 gradient buffers (bf16 runs' default) the reduction already sums in fp32, and Megatron then "
        "turns the flag off; with bf16 or fp16 buffers it is refused (RunConfig.validate)",
    ),
    # ---- not supported yet: features with open issues, or no ask yet.
    "--use-precision-aware-optimizer": not_yet(
        "--use-precision-aware-optimizer",
        SWITCH,
        "Adam with low-precision main params, gradients or moments",
        "drop it: main params, main gradients and Adam's moments stay fp32 (--grad-reduce-in-bf16 gives bf16 "
        "gradient buffers)",
    ),
    **{
        flag: KnownFlag(
            VALUE,
            f"{flag} {{value}} needs --use-precision-aware-optimizer, which is not supported yet; drop the flag "
            "(fp32, as without it).",
            accepted_values=("fp32",),
            note="fp32, what the optimizer here keeps",
        )
        for flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")
    },
    "--tensor-parallel-num-weight-shards": not_yet(
        "--tensor-parallel-num-weight-shards", VALUE, "generalized tensor parallelism: weight shards beyond TP"
    ),
    "--expert-tensor-parallel-num-weight-shards": not_yet(
        "--expert-tensor-parallel-num-weight-shards", VALUE, "generalized tensor parallelism: weight shards beyond TP"
    ),
    "--moe-expert-rank-capacity-factor": not_yet(
        "--moe-expert-rank-capacity-factor",
        VALUE,
        "a per-rank token budget of the hybridep / ncclep flex kernels, which drop or replay the tokens over it",
        "drop it: dropless routing sends every token (--moe-expert-capacity-factor caps tokens per expert)",
    ),
    "--spec": KnownFlag(
        LIST,
        "--spec (custom layer specs) is not supported yet; drop it: layers are chosen from the model flags.",
        accepted_values=("megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec",),
        note="the hybrid stack spec of Megatron's hybrid command lines is the one pretrain_hybrid.py builds",
    ),
    # ---- not supported: outside this project.
    **_family(
        _ROUTER_REPLAY,
        lambda f, n: never(f, n, "RL or inference, whose frameworks drive MoE router replay through Megatron's API"),
    ),
    **_family(_FP8, lambda f, n: never(f, n, "FP8 training", "use --bf16")),
    **_family(_MLA, lambda f, n: never(f, n, "multi-latent attention")),
    **_family(_DSA, lambda f, n: never(f, n, "DSA sparse attention (it builds on multi-latent attention)")),
    **_family(_MTP, lambda f, n: never(f, n, "multi-token prediction")),
    **_family(_CP, lambda f, n: never(f, n, "context parallelism")),
    **_family(_TP_OVERLAP, lambda f, n: never(f, n, "TE userbuffers / TP communication overlap")),
    **_family(_FSDP, lambda f, n: never(f, n, "FSDP", "use --use-distributed-optimizer or plain DP")),
    **_family(_INFERENCE, lambda f, n: never(f, n, "inference", "this is a training script")),
    **_family(
        _POST_TRAINING,
        lambda f, n: never(
            f, n, "post-training model export", "this is a pretraining script (hybrid models: --hybrid-layer-pattern)"
        ),
    ),
    **_family(_RL, lambda f, n: never(f, n, "RL")),
    "--sft": never("--sft", SWITCH, "SFT"),
    "--sft-tokenizer-prompt-format": never("--sft-tokenizer-prompt-format", VALUE, "SFT"),
    **{
        f: never(f, SWITCH if f in _FLEXTRON_SWITCHES else LIST if f in _FLEXTRON_LISTS else VALUE, "Flextron")
        for f in _FLEXTRON
    },
    "--split-sentences": KnownFlag(
        SWITCH, "--split-sentences belongs to tools/preprocess_data.py, not to training; drop the flag."
    ),
    "--checkpoint-activations": KnownFlag(
        SWITCH,
        "--checkpoint-activations is no longer valid (Megatron stops on it too); use --recompute-activations, or "
        "--recompute-granularity full with --recompute-method.",
    ),
    "--enable-cuda-graph": KnownFlag(
        SWITCH, "--enable-cuda-graph is deprecated in Megatron; use --cuda-graph-impl local."
    ),
    "--external-cuda-graph": KnownFlag(
        SWITCH, "--external-cuda-graph is deprecated in Megatron; use --cuda-graph-impl local."
    ),
}


# Every other flag of upstream's training parser, by family (flag_families.py).
KNOWN_MEGATRON_FLAGS.update(_flag_families())
