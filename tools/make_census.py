"""Builds the flag census from upstream Megatron-LM's functional-test training configs.

    python tools/make_census.py UPSTREAM_GIT_DIR [--out tests/unit_tests/training/census/census.yaml]

Reads ``tests/functional_tests/test_cases/{gpt,moe,hybrid}/*/model_config.yaml`` at the
upstream HEAD, keeps the training configs (no inference, RL or SFT runs) and writes each
one's ``MODEL_ARGS`` with only these changes, so it runs on a 2-core CPU in seconds:

- model and batch sizes scaled down (layers, hidden, heads, groups, FFN, sequence,
  micro/global batch, experts, vocabulary), iterations set to 10 (samples to 10 global
  batches), evaluation to 1 batch, data-loader workers to 0;
- real data replaced: ``--data-path`` by ``--mock-data``, vocab/merge/tokenizer files by
  the tiny test tokenizers in ``tests/assets/tokenizer`` (``tokenizer.model`` for the
  SentencePiece types; ``tokenizer_metadata.json``, the Hugging Face one's, for
  ``--tokenizer-metadata``), output folders by placeholders
  (``${SAVE}``, ``${TENSORBOARD}``, ``${DATA_CACHE}``) the test fills in; ``--load`` of a
  pretrained checkpoint (configs that do not also ``--save``) is dropped;
- a distillation teacher's checkpoint and YAML by ``${TEACHER}`` and ``${KD_CFG}``; the
  YAML's contents (upstream's ``DISTILL_CONFIG`` variable) are kept as ``kd_cfg``;
- the ``--wandb-*`` flags are dropped: W&B is an outside service (its package, an account),
  and upstream's configs take the run name and folder from the environment.

Every other flag stays as upstream wrote it. Each entry also records what the run is
expected to do, from the flags alone (``expect``): ``train``; ``not_yet`` (parallel
layouts, MoE, hybrid and other features with open issues: their "not supported yet"
errors); ``unsupported`` (FP8, MLA, MTP, CP > 1, TP overlap, FSDP, ...: out of scope).

Most upstream configs use a parallel layout, so few train here as written. For those
whose only obstacle is the layout, ``single_device`` lists the layout flags to drop
(sizes to 1): that variant keeps every model, logging, schedule and checkpoint flag
and is expected to train. ``single_device_sizes`` holds the sizes the layout had made
larger (heads and widths times TP), scaled as for one device, for that variant.
"""

import argparse
import os
import re
import subprocess
import sys

import yaml

# Runnable from a checkout without installing: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.pipeline_parallel.layout_string import parse_layout  # noqa: E402

FAMILIES = ("gpt", "moe", "hybrid")
_NOT_TRAINING = ("--prompts", "--prompt-file", "--perform-rl-step", "--inference-max-seq-length", "--sft")

# Flags whose presence means the run is outside this project (expect: unsupported).
_OUT_OF_SCOPE_PREFIXES = (
    "--fp8-",
    "--fp4-",
    "--multi-latent-attention",
    "--mtp-",
    "--tp-comm-overlap",
    "--use-megatron-fsdp",
    "--use-torch-fsdp2",
    "--megatron-fsdp-",
    "--fsdp-",
    "--init-model-with-meta-device",
    "--flextron",
    "--cp-comm-type",
    "--hierarchical-context-parallel-sizes",
    "--is-hybrid-model",  # with the next three: post-training (export) scripts' flags
    "--export-model-type",
    "--export-default-te-spec",
    "--model-provider",
)
# Flags of features with open issues here (expect: not_yet).
_NOT_YET_FLAGS = (
    "--tensor-parallel-num-weight-shards",
    "--expert-tensor-parallel-num-weight-shards",
    "--moe-expert-rank-capacity-factor",
)
# --spec values that name the layers our scripts build (megatron/training/known_flags.py says
# the same; tests/unit_tests/training/census checks every entry against the parser).
_ACCEPTED_SPECS = ("megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec",)
# Flags that pipelined runs refuse for now (their own checks; fine at PP = 1).
_NOT_YET_WITH_PIPELINES = {
    "--enable-cuda-graph",
    "--external-cuda-graph",
}
# Parallel-layout flags; dropping them (sizes 1) gives the single-device variant.
PARALLEL_LAYOUT_FLAGS = (
    "--tensor-model-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--pipeline-model-parallel-size",
    "--sequence-parallel",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--overlap-param-gather-with-optimizer-step",
    "--use-tp-pp-dp-mapping",
    "--num-distributed-optimizer-instances",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--microbatch-group-size-per-virtual-pipeline-stage",
    "--overlap-p2p-communication-warmup-flush",
    "--pipeline-model-parallel-layout",
    "--defer-embedding-wgrad-compute",
    "--wgrad-deferral-limit",
    "--no-use-layer-wise-param-layout",
    "--overlap-moe-expert-parallel-comm",
    "--delay-wgrad-compute",
)
_SIZES = {
    "--num-layers": lambda v: min(int(v), 2),
    "--hidden-size": lambda v: 64,
    "--num-attention-heads": lambda v: 4,
    "--kv-channels": lambda v: 16,
    "--ffn-hidden-size": lambda v: 128,
    "--seq-length": lambda v: 64,
    "--max-position-embeddings": lambda v: 64,
    "--decoder-seq-length": lambda v: 64,
    "--micro-batch-size": lambda v: min(int(v), 2),
    "--moe-ffn-hidden-size": lambda v: 64,
    "--moe-shared-expert-intermediate-size": lambda v: 64,
    "--num-experts": lambda v: min(int(v), 4),
    "--moe-router-topk": lambda v: min(int(v), 2),
    "--mamba-num-heads": lambda v: 4,
    "--mamba-head-dim": lambda v: 16,
    "--vocab-size": lambda v: min(int(v), 512),
    "--eval-iters": lambda v: min(int(v), 1),
    "--num-workers": lambda v: 0,
}
_SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")  # read a .model file
_PLACEHOLDERS = {
    "--save": "${SAVE}",
    "--tensorboard-dir": "${TENSORBOARD}",
    "--data-cache-path": "${DATA_CACHE}",
    "--export-kd-teacher-load": "${TEACHER}",
    "--export-kd-cfg": "${KD_CFG}",
}


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def expectation(args: dict) -> str:
    """``train``, ``not_yet`` or ``unsupported`` from the flags of one config (pure)."""
    flags = set(args)
    if any(f.startswith(_OUT_OF_SCOPE_PREFIXES) for f in flags) or str(args.get("--context-parallel-size", 1)) != "1":
        return "unsupported"
    if args.get("--ckpt-format") == "fsdp_dtensor" or args.get("--transformer-impl") == "inference_optimized":
        return "unsupported"
    if flags & set(_NOT_YET_FLAGS):
        return "not_yet"
    if "--spec" in flags and str(args["--spec"]).strip("[]") not in _ACCEPTED_SPECS:
        return "not_yet"
    if str(args.get("--pipeline-model-parallel-size", 1)) != "1":
        if flags & _NOT_YET_WITH_PIPELINES:
            return "not_yet"  # deprecated graph switches with pipeline parallelism
    expert_tp = args.get("--expert-tensor-parallel-size", args.get("--tensor-model-parallel-size", 1))
    if "--num-experts" in flags and str(expert_tp) != "1" and "--disable-bias-linear" not in flags:
        return "not_yet"  # expert biases split over expert tensor parallelism
    if args.get("--tokenizer-type") not in (
        None,
        "GPT2BPETokenizer",
        "NullTokenizer",
        "HuggingFaceTokenizer",
        *_SP_TYPES,
    ):
        return "not_yet"
    return "train"


def scale(args: dict) -> dict:
    """Upstream MODEL_ARGS -> the census entry's (see the module docstring)."""
    out = {}
    saves = "--save" in args
    # Sizes that the parallel layout must divide: heads, groups and widths by TP, experts by EP.
    tp = int(args.get("--tensor-model-parallel-size", 1))
    ep = int(args.get("--expert-model-parallel-size", 1))
    by_layout = {
        "--num-attention-heads": 4 * tp,
        "--hidden-size": 64 * tp,
        "--ffn-hidden-size": 128 * tp,
        "--moe-ffn-hidden-size": 64 * tp,
        "--moe-shared-expert-intermediate-size": 64 * tp,
    }
    for flag, value in args.items():
        if flag in ("--data-path", "--split", "--per-split-data-args-path") or flag.startswith("--wandb-"):
            continue
        if flag == "--load":
            if saves:
                out[flag] = "${SAVE}"
            continue
        if flag in _PLACEHOLDERS:
            out[flag] = _PLACEHOLDERS[flag]
        elif flag == "--vocab-file":
            out[flag] = "${ASSETS}/vocab.json"
        elif flag == "--merge-file":
            out[flag] = "${ASSETS}/merges.txt"
        elif flag == "--tokenizer-model":
            sentencepiece = args.get("--tokenizer-type") in _SP_TYPES
            out[flag] = "${ASSETS}/tokenizer.model" if sentencepiece else "${ASSETS}/tokenizer.json"
        elif flag == "--tokenizer-metadata":
            out[flag] = "${ASSETS}/tokenizer_metadata.json"  # the Hugging Face asset's (library huggingface)
        elif flag in by_layout:
            out[flag] = by_layout[flag]
        elif flag == "--num-experts":
            out[flag] = min(int(value), max(4, ep))
        elif flag in _SIZES:
            out[flag] = _SIZES[flag](value)
        elif flag == "--num-query-groups":
            out[flag] = 1 if int(value) == 1 else 2 * tp
        elif isinstance(value, str) and "${" in value:
            continue  # an environment-specific value (e.g. --seed ${REPEAT}): the default is used
        else:
            out[flag] = value
    for flag in ("--hybrid-layer-pattern", "--hybrid-override-pattern"):
        if flag in out:  # each stage keeps one layer of each kind, in order of first appearance
            out[flag] = "|".join("".join(dict.fromkeys(stage)) for stage in str(out[flag]).split("|"))
            if "--num-layers" in out:
                out["--num-layers"] = len(out[flag].replace("|", ""))
    hybrid = "--hybrid-layer-pattern" in args or "--hybrid-override-pattern" in args or "--spec" in args
    if hybrid and "--mamba-head-dim" not in args and "--mamba-num-heads" not in args:
        out["--mamba-head-dim"] = _SIZES["--mamba-head-dim"](None)  # Mamba heads a multiple of the 8 groups
    _fit_pipeline_layers(args, out)
    micro = out.get("--micro-batch-size", 2)
    replicas = ep  # data-parallel replicas on the smallest world of the layout (TP x PP x EP)
    if "--global-batch-size" in args:
        out["--global-batch-size"] = 2 * micro * replicas
    if "--eval-global-batch-size" in args:
        out["--eval-global-batch-size"] = 2 * micro * replicas
    if "--train-samples" in args:
        out["--train-samples"] = 10 * out.get("--global-batch-size", micro)
    else:
        out["--train-iters"] = 10
    if "--step-batch-size-schedule" in args:
        _scale_step_schedule(args, out, 2 * micro * replicas)
    if "--fim-data" in args and out.get("--vocab-file") == "${ASSETS}/vocab.json":
        out["--vocab-file"] = "${ASSETS}/vocab_fim.json"  # the test vocabulary with the FIM tokens added
    out["--mock-data"] = True
    out["--num-workers"] = 0
    if out.get("--tokenizer-type") is None and "--vocab-file" not in out and "--vocab-size" not in out:
        out["--vocab-file"], out["--merge-file"] = "${ASSETS}/vocab.json", "${ASSETS}/merges.txt"
    return out


def _scale_step_schedule(args: dict, out: dict, base: int) -> None:
    """A step batch-size schedule keeps its ratios on the CPU scale: batch i is ``base`` times
    upstream's batch i over its first; each step lasts two iterations (thresholds in tokens, as
    upstream passes them), then the last batch trains six, given as --train-samples."""
    entries = sorted(
        (_count(t), _count(b)) for t, b in (e.split(":", 1) for e in str(args["--step-batch-size-schedule"]).split())
    )
    first = entries[0][1]
    seq = int(out.get("--seq-length", 64))
    samples, parts = 0, []
    for i, (_, batch) in enumerate(entries):
        size = base * max(1, round(batch / first))
        parts.append(f"{samples * seq}:{size}")
        samples += (2 if i < len(entries) - 1 else 6) * size
    out["--step-batch-size-schedule"] = " ".join(parts)
    out["--train-samples"] = samples


def _count(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper(), 1)
    return float(text[:-1] if scale != 1 else text) * scale


def _fit_pipeline_layers(args: dict, out: dict) -> None:
    """A pipelined config keeps its layout with few layers: one (or one per virtual stage) per
    pipeline rank, the uneven first/last stages scaled to that too, less the embedding and
    loss where they count as layers; a layout string keeps one layer per stage that has any."""
    pp = int(args.get("--pipeline-model-parallel-size", 1))
    if pp == 1 or "--num-layers" not in out:
        return
    layout = args.get("--pipeline-model-parallel-layout")
    if layout is not None:  # each stage's run of layers becomes one layer; stages without stay so
        out["--pipeline-model-parallel-layout"] = re.sub(r"t(\*\d+)?(,?t(\*\d+)?)*", "t", str(layout))
        out["--num-layers"] = "".join(parse_layout(out["--pipeline-model-parallel-layout"])).count("t")
        return
    vpp = 1
    if "--num-virtual-stages-per-pipeline-rank" in args:
        vpp = int(args["--num-virtual-stages-per-pipeline-rank"])
    elif "--num-layers-per-virtual-pipeline-stage" in args:
        out["--num-layers-per-virtual-pipeline-stage"] = 1  # one chunk per rank: the smallest that splits
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        if flag in args:
            out[flag] = vpp
    # The embedding and the loss may count as layers of the split (upstream's rule):
    # the decoder then has that many layers fewer.
    accounted = sum(f"--account-for-{part}-in-pipeline-split" in args for part in ("embedding", "loss"))
    out["--num-layers"] = pp * vpp - accounted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream_git_dir")
    parser.add_argument("--out", default="tests/unit_tests/training/census/census.yaml")
    a = parser.parse_args()
    commit = _git(a.upstream_git_dir, "rev-parse", "HEAD").strip()
    paths = _git(a.upstream_git_dir, "ls-tree", "-r", "--name-only", "HEAD", "tests/functional_tests/test_cases")
    entries = {}
    for path in sorted(paths.split()):
        parts = path.split("/")
        if len(parts) != 6 or parts[3] not in FAMILIES or parts[5] != "model_config.yaml":
            continue
        config = yaml.safe_load(_git(a.upstream_git_dir, "show", f"HEAD:{path}"))
        args = (config or {}).get("MODEL_ARGS") or {}
        if any(f in args for f in _NOT_TRAINING) or not ("--train-iters" in args or "--train-samples" in args):
            continue
        entry = {"expect": expectation(args)}
        layout = [f for f in args if f in PARALLEL_LAYOUT_FLAGS]
        pattern = str(args.get("--hybrid-layer-pattern", args.get("--hybrid-override-pattern", "")))
        # A pattern with "|" stage separators fixes the pipeline layout: no single-device variant.
        if entry["expect"] in ("not_yet", "train") and layout and "|" not in pattern:
            single = {f: v for f, v in args.items() if f not in PARALLEL_LAYOUT_FLAGS}
            if expectation(single) == "train":
                entry["single_device"] = layout
        entry["MODEL_ARGS"] = scale(args)
        if "--export-kd-cfg" in args:  # upstream writes the distillation YAML from an environment variable
            entry["kd_cfg"] = yaml.safe_load(str((config.get("ENV_VARS") or {}).get("DISTILL_CONFIG") or "{}"))
        if "single_device" in entry:
            # The sizes the layout made larger (heads, widths x TP), scaled as for one device.
            one = scale(single)
            resized = {f: v for f, v in one.items() if f in entry["MODEL_ARGS"] and entry["MODEL_ARGS"][f] != v}
            if resized:
                entry["single_device_sizes"] = resized
        entries[f"{parts[3]}/{parts[4]}"] = entry
    header = (
        f"# Generated by tools/make_census.py from NVIDIA/Megatron-LM {commit}\n"
        "# (tests/functional_tests/test_cases/<family>/<name>/model_config.yaml); do not edit by hand.\n"
    )
    with open(a.out, "w") as f:
        f.write(header)
        yaml.safe_dump(entries, f, sort_keys=False, width=120)
    counts = {}
    for e in entries.values():
        counts[e["expect"]] = counts.get(e["expect"], 0) + 1
    counts["single_device"] = sum("single_device" in e for e in entries.values())
    print(f"{len(entries)} configs -> {a.out}: {counts}")


if __name__ == "__main__":
    main()
