"""Fill-in-the-middle (FIM) rewriting of GPT samples, with Megatron's GPT FIM dataset semantics.

A sample of ``seq_length + 1`` tokens is cut at every FIM end-of-document token; each
non-empty document (and the piece after the last one, even when empty) is rewritten on
its own, and the pieces are joined again with the end-of-document token. With
``--fim-split-sample`` a document that holds the split token is, with probability
``--fim-rate``, cut again at every split token and each non-empty fragment rewritten
with probability ``--fim-fragment-rate``.

Rewriting a piece, with probability ``rate``: decode it to text (the FIM special
tokens dropped), skip it when the text starts with ``--fim-no-prefix``, draw two cut
points uniformly in ``[0, len(text)]`` (sorted) giving prefix, middle and suffix,
tokenize each, and with probability ``--fim-spm-rate`` write SPM
``<pre> <suf> suffix <mid> prefix middle``, else PSM ``<pre> prefix <suf> suffix <mid> middle``.
The joined sample is truncated, or padded with the FIM pad token, back to its length.

Unusual here: the random draws come from ``numpy.random.RandomState`` seeded with
``(seed, dataset key, sample index)``, not from one stream per dataset object that
samples consume in the order they are read, so a sample is rewritten the same way
for any ``--num-workers`` and after a resume. The draws within a sample are
Megatron's, in Megatron's order.
"""

import zlib
from collections.abc import Callable

import numpy as np

from megatron.core.config_utils import require

_TOKEN_FLAGS = ("prefix", "middle", "suffix", "pad", "eod")


def validate_fim_config(data) -> None:
    """Checks the ``--fim-*`` flags of a ``DataConfig`` (pure; the tokens are checked at build)."""
    if not data.fim_data:
        return
    for flag, value in (("--fim-rate", data.fim_rate), ("--fim-spm-rate", data.fim_spm_rate)):
        require(value is not None and 0.0 <= value <= 1.0, f"{flag} must be a probability in [0, 1], got {value}.")
    if data.fim_split_sample is not None:
        rate = data.fim_fragment_rate
        require(
            rate is not None and 0.0 <= rate <= 1.0,
            f"--fim-split-sample needs --fim-fragment-rate, a probability in [0, 1] (got {rate}): the rate of FIM "
            "on each fragment.",
        )
    for name in _TOKEN_FLAGS:
        value = getattr(data, f"fim_{name}_token")
        require(bool(value), f"--fim-{name}-token must name a token of the tokenizer, got {value!r}.")


class FIMRewriter:
    """Rewrites samples (token arrays) in FIM format.

    Args:
        tokenizer: Has ``tokenize``, ``detokenize`` and ``token_to_id``.
        rate: ``--fim-rate``.
        spm_rate: ``--fim-spm-rate``.
        token_names: ``{"prefix", "middle", "suffix", "pad", "eod"}`` -> token text.
        split_sample: ``--fim-split-sample`` token text, or None.
        fragment_rate: ``--fim-fragment-rate``.
        no_prefix: ``--fim-no-prefix``, or None.
        seed: ``--seed``.

    Raises:
        ValueError: The tokenizer has no id for a FIM token (naming its flag).
    """

    def __init__(
        self,
        tokenizer,
        *,
        rate: float,
        spm_rate: float,
        token_names: dict[str, str],
        split_sample: str | None = None,
        fragment_rate: float | None = None,
        no_prefix: str | None = None,
        seed: int = 0,
    ):
        self.tokenizer = tokenizer
        self.rate = rate
        self.spm_rate = spm_rate
        self.fragment_rate = fragment_rate
        self.no_prefix = no_prefix
        self.seed = int(seed)
        ids = {name: _token_id(tokenizer, token_names[name], f"--fim-{name}-token") for name in _TOKEN_FLAGS}
        self.prefix_id, self.middle_id, self.suffix_id = ids["prefix"], ids["middle"], ids["suffix"]
        self.pad_id, self.eod_id = ids["pad"], ids["eod"]
        self.split_id = None if split_sample is None else _token_id(tokenizer, split_sample, "--fim-split-sample")
        self._special = np.array(sorted(set(ids.values())), dtype=np.int64)

    @classmethod
    def from_config(cls, data, tokenizer, seed: int) -> "FIMRewriter | None":
        """From a ``DataConfig`` (None without ``--fim-data``)."""
        if not data.fim_data:
            return None
        return cls(
            tokenizer,
            rate=data.fim_rate,
            spm_rate=data.fim_spm_rate,
            token_names={name: getattr(data, f"fim_{name}_token") for name in _TOKEN_FLAGS},
            split_sample=data.fim_split_sample,
            fragment_rate=data.fim_fragment_rate,
            no_prefix=data.fim_no_prefix,
            seed=seed,
        )

    def rng_for(self, dataset_key: str, index: int) -> np.random.RandomState:
        """The random stream of sample ``index`` of the dataset keyed ``dataset_key``."""
        return np.random.RandomState([self.seed & 0xFFFFFFFF, zlib.crc32(dataset_key.encode()), int(index)])

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """``sample`` rewritten, int64, of the same length."""
        length = len(sample)
        pieces: list[np.ndarray] = []
        start = 0
        for loc in np.flatnonzero(sample == self.eod_id):
            if loc > start:  # empty documents (and their end token) are dropped, as in Megatron
                pieces += [self._split_and_permute(sample[start:loc], rng), np.array([self.eod_id])]
            start = loc + 1
        pieces.append(self._split_and_permute(sample[start:], rng))
        out = np.concatenate(pieces).astype(np.int64)
        if len(out) >= length:
            return out[:length]
        return np.concatenate([out, np.full(length - len(out), self.pad_id, dtype=np.int64)])

    def _split_and_permute(self, piece: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        if self.split_id is None:
            return self._permute(piece, self.rate, rng)
        breaks = np.flatnonzero(piece == self.split_id)
        if len(breaks) == 0:
            return self._permute(piece, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return piece
        parts: list[np.ndarray] = []
        start = 0
        for loc in breaks:
            if loc > start:  # empty fragments (and their split token) are dropped, as in Megatron
                parts += [self._permute(piece[start:loc], self.fragment_rate, rng), np.array([self.split_id])]
            start = loc + 1
        parts.append(self._permute(piece[start:], self.fragment_rate, rng))
        return np.concatenate(parts)

    def _permute(self, piece: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        if not rng.binomial(1, rate):
            return piece
        text = self.tokenizer.detokenize(piece[~np.isin(piece, self._special)].tolist())
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return piece
        cuts = sorted(rng.randint(low=0, high=len(text) + 1, size=2).tolist())
        prefix, middle, suffix = (
            np.array(self.tokenizer.tokenize(t), dtype=np.int64)
            for t in (text[: cuts[0]], text[cuts[0] : cuts[1]], text[cuts[1] :])
        )
        if rng.binomial(1, self.spm_rate):
            parts = [[self.prefix_id, self.suffix_id], suffix, [self.middle_id], prefix, middle]
        else:
            parts = [[self.prefix_id], prefix, [self.suffix_id], suffix, [self.middle_id], middle]
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def _token_id(tokenizer, text: str, flag: str) -> int:
    lookup: Callable[[str], int | None] | None = getattr(tokenizer, "token_to_id", None)
    token_id = lookup(text) if lookup is not None else None
    if token_id is None:
        raise ValueError(
            f"--fim-data: the tokenizer ({type(tokenizer).__name__}) has no token {text!r} for {flag}; use a "
            f"tokenizer whose vocabulary holds the FIM tokens or name its tokens with {flag}."
        )
    return int(token_id)
