"""Rotary position embeddings (RoPE), non-interleaved "rotate half" convention.

``RotaryEmbedding(seq_len, device)`` returns the angle table ``freqs [s, 1, 1, rot_dim]``
in fp32 (each frequency appears twice: first half and second half of the rotated
channels, as in Megatron). Unusual here: the table is cached per (seq_len, device) and
the SAME tensor object is returned on every call, because CUDA graphs key their
inputs on addresses and a fresh table per step would defeat replay.
``apply_rotary_pos_emb`` rotates the first ``rot_dim`` channels of ``t`` and passes the
rest through (``--rotary-percent`` < 1). Llama 3.x's frequency scaling
(``--use-rope-scaling``) and position interpolation (``--rotary-seq-len-interpolation-factor``)
change the table only. The cos/sin tables it needs are computed once with the angle table
and attached to it, for the common activation dtypes.
"""

import torch

from megatron.core.tensor_parallel.layers import resolve_device

# Activation dtypes whose cos/sin tables are precomputed with each cached angle table.
_TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RotaryEmbedding(torch.nn.Module):
    """Angle tables for rotary embeddings.

    Args:
        kv_channels: Channels per attention head.
        rotary_percent: Fraction of the channels to rotate.
        rotary_base: Base of the geometric frequency progression.
        seq_len_interpolation_factor: Positions are divided by it (linear position interpolation).
        rope_scaling: Llama 3.x's scaling of the low frequencies (``llama3_scaled_inv_freq``).
        rope_scaling_factor: Its factor (Llama 3.1: 8).
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        *,
        seq_len_interpolation_factor: float | None = None,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
    ):
        super().__init__()
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.rope_scaling_factor = rope_scaling_factor if rope_scaling else None
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim <= 0 or rot_dim % 2 != 0:
            raise ValueError(
                f"--rotary-percent {rotary_percent} with --kv-channels {kv_channels} rotates {rot_dim} channels; "
                "that must be a positive even number. Pick a percentage that gives one."
            )
        self.rot_dim = rot_dim
        self.rotary_base = rotary_base
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def forward(self, seq_len: int, device=None) -> torch.Tensor:
        """Returns the cached ``freqs [seq_len, 1, 1, rot_dim]`` (fp32) on ``device``."""
        device = resolve_device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (int(seq_len), str(device))
        freqs = self._cache.get(key)
        if freqs is None:
            # Computed once, on the target device, outside autograd. The first call must be
            # eager (not inside a CUDA-graph capture) so the table lives outside any graph pool.
            # inference_mode(False): a table first built under inference mode stays usable in training.
            with torch.no_grad(), torch.inference_mode(False):
                exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=device) / self.rot_dim
                inv_freq = 1.0 / (self.rotary_base**exponents)  # [rot_dim / 2]
                if self.rope_scaling_factor is not None:
                    inv_freq = llama3_scaled_inv_freq(inv_freq, self.rope_scaling_factor)
                positions = torch.arange(seq_len, dtype=torch.float32, device=device)
                if self.seq_len_interpolation_factor is not None:
                    positions = positions / self.seq_len_interpolation_factor
                angles = torch.outer(positions, inv_freq)  # [s, rot_dim / 2]
                freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [s, 1, 1, rot_dim]
                # Per-dtype cos/sin tables ride on the cached tensor so layers need not recompute them.
                freqs._rope_tables = {dtype: _rope_tables(freqs, dtype) for dtype in _TABLE_DTYPES}
            self._cache[key] = freqs
        return freqs


def rotary_embedding(config) -> RotaryEmbedding:
    """The ``RotaryEmbedding`` of a model config (``--rotary-*``, ``--use-rope-scaling`` flags)."""
    return RotaryEmbedding(
        config.kv_channels,
        config.rotary_percent,
        config.rotary_base,
        seq_len_interpolation_factor=getattr(config, "rotary_seq_len_interpolation_factor", None),
        rope_scaling=getattr(config, "use_rope_scaling", False),
        rope_scaling_factor=getattr(config, "rope_scaling_factor", 8.0),
    )


def llama3_scaled_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> torch.Tensor:
    """Llama 3.x's RoPE frequency scaling (Megatron's ``--use-rope-scaling``, its constants).

    Wavelengths ``2 pi / f`` shorter than ``original_context / high_freq_factor`` keep their
    frequency; those longer than ``original_context / low_freq_factor`` are divided by
    ``factor``; in between, the frequency blends linearly from ``f / factor`` to ``f`` as
    ``original_context / wavelength`` goes from ``low_freq_factor`` to ``high_freq_factor``.
    """
    wavelength = 2 * torch.pi / inv_freq
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    long = wavelength > original_context / low_freq_factor
    short = wavelength < original_context / high_freq_factor
    return torch.where(long, inv_freq / factor, torch.where(short, inv_freq, blended))


def _rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``, each ``[s, rot_dim]`` in ``dtype``; cached on ``freqs`` when it came from
    ``RotaryEmbedding`` (so no layer recomputes them), else computed here."""
    tables = getattr(freqs, "_rope_tables", None)
    if tables is not None and dtype in tables:
        return tables[dtype]
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    half = angles.shape[-1] // 2
    sin = torch.sin(angles)
    # rotate_half(x) * sin == swap_halves(x) * signed_sin with the first half of sin negated.
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return torch.cos(angles).to(dtype), signed_sin.to(dtype)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotates the first ``rot_dim`` channels of ``t`` by the angles in ``freqs``.

    Computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``,
    written as ``addcmul(x * cos, swap_halves(x), signed_sin)``: three kernels
    forward, four backward (this runs in every layer, every step).

    Args:
        t: ``[s, b, n, d]`` (any number of dims between ``s`` and ``d`` works, e.g.
            ``[s, b, groups, heads_per_group, d]``).
        freqs: ``[s_max >= s, 1, 1, rot_dim]`` angles from ``RotaryEmbedding``.

    Returns:
        A tensor shaped like ``t``, in ``t``'s dtype (computed in that dtype, as
        Megatron's unfused path does).
    """
    seq_len, rot_dim = t.shape[0], freqs.shape[-1]
    cos, signed_sin = _rope_tables(freqs, t.dtype)
    # Broadcast [s, 1, ..., 1, rot_dim] against t's middle dims whatever t's rank.
    shape = (seq_len, *([1] * (t.dim() - 2)), rot_dim)
    cos, signed_sin = cos[:seq_len].view(shape), signed_sin[:seq_len].view(shape)
    t_rot = t if rot_dim == t.shape[-1] else t[..., :rot_dim]
    # Swap the two halves of the rotated channels: a flip of a [2, rot_dim / 2] view (its backward
    # is a flip too; torch.roll's kernel is several times slower on these strided inputs).
    swapped = t_rot.unflatten(-1, (2, rot_dim // 2)).flip(-2).flatten(-2)
    rotated = torch.addcmul(t_rot * cos, swapped, signed_sin)
    if t_rot is t:
        return rotated
    return torch.cat((rotated, t[..., rot_dim:]), dim=-1)


def apply_rotary_pos_emb_interleaved(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``--rotary-interleaved``: rotates adjacent channel pairs ``(x0, x1), (x2, x3), ...``.

    Pair ``i`` of the rotated channels turns by the ``i``-th frequency (the same
    frequencies as the half-split convention, assigned to pairs instead of halves).

    Args:
        t: ``[s, b, ..., d]``.
        freqs: ``[s_max >= s, 1, 1, rot_dim]`` angles from ``RotaryEmbedding``.
    """
    seq_len, rot_dim = t.shape[0], freqs.shape[-1]
    angles = freqs.reshape(freqs.shape[0], rot_dim)[:seq_len, : rot_dim // 2]  # [s, rot_dim / 2]
    shape = (seq_len, *([1] * (t.dim() - 2)), rot_dim // 2)
    cos = torch.cos(angles).to(t.dtype).view(shape)
    sin = torch.sin(angles).to(t.dtype).view(shape)
    t_rot = t if rot_dim == t.shape[-1] else t[..., :rot_dim]
    even, odd = t_rot.unflatten(-1, (rot_dim // 2, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    if t_rot is t:
        return rotated
    return torch.cat((rotated, t[..., rot_dim:]), dim=-1)
