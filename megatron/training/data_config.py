"""``DataConfig``: the data and tokenizer flags (``--data-path``, ``--split``, ``--mock-data``, the per-split
paths, the tokenizer, FIM), read by ``data.py``, the dataset builder and the tokenizers."""

import dataclasses
import json
import os

from megatron.core.config_utils import Freezable, flag_field, require


@dataclasses.dataclass
class DataConfig(Freezable):
    """Data and tokenizer."""

    mock_data: bool = False
    """Train on Megatron-style synthetic documents (no files needed)."""

    data_path: list[str] = flag_field(default_factory=list, nargs="*")
    """Dataset prefix, or a weighted blend: 0.3 prefixA 0.7 prefixB."""

    data_args_path: str | None = None
    """File whose words are the --data-path value (a blend too long for a command line)."""

    train_data_path: list[str] = flag_field(default_factory=list, nargs="*")
    """The train split's own prefix or weighted blend (all of their documents), instead of --data-path and
    --split."""

    valid_data_path: list[str] = flag_field(default_factory=list, nargs="*")
    """The validation split's own prefix or weighted blend (with --train-data-path)."""

    test_data_path: list[str] = flag_field(default_factory=list, nargs="*")
    """The test split's own prefix or weighted blend (with --train-data-path)."""

    per_split_data_args_path: str | None = None
    """JSON file {"train": ..., "valid": ..., "test": ...} giving the three per-split blends (a string of words or
    a list each), instead of --train-data-path, --valid-data-path and --test-data-path."""

    dataloader_type: str = flag_field("single", choices=("single", "cyclic"))
    """Sample order: single (one pass in index order; the datasets shuffle themselves) or cyclic (epochs, each
    in a new random order)."""

    data_sharding: bool = flag_field(True, flag="--no-data-sharding")
    """With --dataloader-type cyclic: each data-parallel rank shuffles its own bucket of the dataset
    (--no-data-sharding: one shuffle of the whole dataset, dealt out to the ranks)."""

    reset_position_ids: bool = False
    """Restart the position ids at 0 after each end-of-document token (they feed learned absolute position
    embeddings; rotary embeddings count positions within the sequence)."""

    reset_attention_mask: bool = False
    """Attention stays within documents: no token attends across an end-of-document token (Megatron's
    document mask, built by the data loader; attention then runs with an explicit mask, not the causal
    flash kernel)."""

    create_attention_mask_in_dataloader: bool = flag_field(True, flag="--no-create-attention-mask-in-dataloader")
    """The data loader builds the attention mask (Megatron's default). Only --reset-attention-mask needs one here;
    with --no-create-attention-mask-in-dataloader Megatron ignores --reset-attention-mask, so the pair is refused."""

    eod_mask_loss: bool = False
    """Mask the loss at end-of-document tokens (the next-token target after one is not counted)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra share of samples each dataset of a blend builds beyond its weight's (a blend that reads past
    one names this flag)."""

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
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            # Megatron's other tokenizers: they parse and are refused in validate().
            "BertWordPieceLowerCase",
            "BertWordPieceCase",
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
    """Hugging Face tokenizer.json, or the SentencePiece .model file of the SentencePiece types."""

    tokenizer_metadata: str | None = None
    """Tokenizer metadata JSON (upstream's MegatronTokenizer.write_metadata; here
    megatron.core.tokenizers.write_metadata): its library must be the one --tokenizer-type reads."""

    tokenizer_sentencepiece_legacy: bool = False
    """SentencePiece types: allow --tokenizer-special-tokens (added after the model's pieces when new,
    matched in the text before encoding)."""

    tokenizer_special_tokens: list[str] = flag_field(default_factory=list, nargs="+")
    """SentencePiece types with --tokenizer-sentencepiece-legacy: special tokens, in id order."""

    tokenizer_sentencepiece_ignore_extra_whitespaces: bool = flag_field(
        True, aliases=("--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",)
    )
    """Let a SentencePiece model that collapses runs of spaces collapse them (turned off, a marker keeps
    them visible: Megatron's rule)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary so its size is divisible by this value (times TP)."""

    padded_vocab_size: int | None = None
    """The model's vocabulary size (embedding and output rows), instead of the padded tokenizer vocabulary."""

    pad_vocab_size: bool = flag_field(True, flag="--no-pad-vocab-size", aliases=("--disable-pad-vocab-size",))
    """Pad the tokenizer's vocabulary (--make-vocab-size-divisible-by x TP) when --padded-vocab-size is not
    given; without padding the model has the tokenizer's vocabulary size."""

    tokenizer_hf_no_include_special_tokens: bool = False
    """HuggingFaceTokenizer: encode without the special tokens its template adds (a BOS, say) and decode
    without special tokens."""

    allow_ambiguous_pad_tokens: bool = False
    """Mask the tokenizer's pad id out of the loss even when it is also its end of document or sentence (by
    default such a pad id masks nothing, as Megatron)."""

    null_tokenizer_eod_id: int | None = None
    """End-of-document id of NullTokenizer (default: --vocab-size - 1)."""

    null_tokenizer_pad_id: int = -1
    """Pad id of NullTokenizer, left out of the loss (-1: none)."""

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

    @property
    def per_split(self) -> bool:
        """Each split has blends of its own (--train-data-path ...), not a share of --data-path."""
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)

    def read_path_files(self) -> None:
        """Fills --data-path from --data-args-path and the per-split paths from --per-split-data-args-path
        (``RunConfig.resolve`` calls it: it reads files); raises ``ValueError`` naming the flags."""
        if self.data_args_path is not None:
            require(not self.data_path, "--data-args-path and --data-path cannot both be set; give one.")
            require(os.path.isfile(self.data_args_path), f"--data-args-path {self.data_args_path} does not exist.")
            with open(self.data_args_path) as f:
                self.data_path = f.read().split()
        if self.per_split_data_args_path is not None:
            path = self.per_split_data_args_path
            require(
                not self.per_split,
                "--per-split-data-args-path and --train/--valid/--test-data-path cannot both be set; give one.",
            )
            require(os.path.isfile(path), f"--per-split-data-args-path {path} does not exist.")
            try:
                with open(path) as f:
                    blends = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"--per-split-data-args-path {path} is not valid JSON: {e}") from e
            require(
                isinstance(blends, dict) and set(blends) <= {"train", "valid", "test"},
                f"--per-split-data-args-path {path} must be a JSON object with keys train, valid and test.",
            )
            for split in ("train", "valid", "test"):
                value = blends.get(split) or []
                setattr(
                    self, f"{split}_data_path", value.split() if isinstance(value, str) else [str(v) for v in value]
                )
        require(
            not (self.data_path and self.per_split),
            "--data-path (with --split) and the per-split paths (--train-data-path, --valid-data-path, "
            "--test-data-path) cannot both be set; give one.",
        )


def validate_document_mask(cfg) -> None:
    """--reset-attention-mask's rules (``cfg``: the run config): the mask comes from the data loader and
    reaches the softmax attention of GPT layers on every pipeline stage."""
    if not cfg.data.reset_attention_mask:
        return
    require(
        cfg.data.create_attention_mask_in_dataloader,
        "--reset-attention-mask with --no-create-attention-mask-in-dataloader: the document mask is built by the "
        "data loader, and Megatron then leaves --reset-attention-mask without effect. Drop one of them.",
    )
    gdn = getattr(cfg.linear_attention, "enabled", False) or "G" in (cfg.mamba.hybrid_layer_pattern or "")
    require(
        not gdn,
        "--reset-attention-mask with gated delta net layers (--linear-attention-freq, the hybrid symbol G) is not "
        "supported yet; drop one of them.",
    )
