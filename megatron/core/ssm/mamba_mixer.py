"""The Mamba-2 mixer: in-projection, causal conv, SSD scan, gated grouped RMSNorm, out-projection.

``[s, b, h] -> [s, b, h]``. One column-parallel in-projection produces, per position,
``z`` (gate), ``x`` (inputs), ``B``, ``C`` (per group) and ``dt`` (per head), in that
order; ``x, B, C`` go through a causal depthwise conv + SiLU, then the SSD scan
(``ssd.py``) with ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` and the ``D``
skip; the result is gated by ``silu(z)``, normalised per group (RMSNorm over each
group's channels, Megatron's ``norm_before_gate=False``) and projected back by a
row-parallel out-projection.

Parameter names and initialisation are Megatron's: ``in_proj``, ``conv1d`` (weight
``[channels, 1, d_conv]`` + bias), ``dt_bias``, ``A_log``, ``D``, ``norm``,
``out_proj``. Every parameter is in the model's dtype, as Megatron's ``Float16Module`` leaves them
(``A_log``, ``D`` and ``dt_bias`` included); the mixer reads them in at least float32.

Tensor parallelism is laid out like Megatron's: heads and groups are split across the
TP ranks (each rank's in-projection rows are its own ``[z, x, B, C, dt]`` slices; the
``partition_sizes`` attribute records them), and the scan, the conv and the norm are
rank-local, so only the two linear layers communicate.

The fused ``mamba-ssm`` / ``causal-conv1d`` kernels are used when installed and the
input is on CUDA (never required). The PyTorch path has no host syncs and static
shapes, so it can be captured in a CUDA graph.
"""

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from megatron.core.ssm.causal_conv1d import causal_conv1d
from megatron.core.ssm.ssd import ssd_chunked_scan
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
    init_method_normal,
    rank_slice,
    resolve_device,
    section_shard,
    sectioned_init,
)

try:  # optional fused kernels; never required
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined

    HAVE_MAMBA_SSM = True
except ImportError:  # pragma: no cover - depends on the environment
    mamba_chunk_scan_combined = mamba_split_conv1d_scan_combined = None
    HAVE_MAMBA_SSM = False


def _at_least_fp32(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """bf16/fp16 -> float32; float32 and float64 unchanged (``copy``: in new storage even then)."""
    return t.to(torch.promote_types(t.dtype, torch.float32), copy=copy)


class GroupedRMSNorm(torch.nn.Module):
    """RMSNorm over each group's channels, optionally gated first: ``norm(x * silu(z)) * weight``.

    Args:
        hidden_size: Channels (all groups of this rank).
        group_size: Channels per group.
        eps: Added to the mean square.
        device, dtype: Of the weight (ones).
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        assert hidden_size % group_size == 0, (hidden_size, group_size)
        self.group_size = group_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return GatedGroupRMSNorm.apply(x, z, self.weight, self.group_size, self.eps)


SCAN_CHUNK = 128
"""The SSD scan's chunk length (``MambaMixer``'s ``chunk_size`` default, as in Megatron's mixer)."""
NORM_CHUNK_BYTES = 8 * 2**20
"""GatedGroupRMSNorm works on this many bytes of float32 rows at a time (at least one row)."""


class GatedGroupRMSNorm(torch.autograd.Function):
    """``norm(x * silu(z)) * weight`` per group, computed in at least float32, with a written-out backward.

    Autograd would keep four float32 copies of ``x``'s size for backward; this keeps ``x``,
    ``z`` and one ``rsqrt`` per group, and recomputes the rest in backward. Both directions
    run over chunks of rows (tokens), so their float32 temporaries are a chunk's, not ``x``'s.
    """

    @staticmethod
    def forward(ctx, x, z, weight, group_size: int, eps: float):
        ctx.group_size = group_size
        d = x.shape[-1]
        rows, zrows = x.reshape(-1, d), None if z is None else z.reshape(-1, d)
        out = torch.empty_like(rows)
        wf = _at_least_fp32(weight)
        compute = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.empty(rows.shape[0], d // group_size, 1, dtype=compute, device=x.device)
        for part in _row_chunks(rows):
            u = _at_least_fp32(rows[part], copy=True)  # ours: modified in place below
            if zrows is not None:
                u.mul_(F.silu(_at_least_fp32(zrows[part], copy=True), inplace=True))
            grouped = rearrange(u, "r (g c) -> r g c", c=group_size)
            rstd[part] = torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
            out[part] = rearrange(grouped.mul_(rstd[part]), "r g c -> r (g c)").mul_(wf)
        # z is a slice of the in-projection's output: keep a copy, not that whole output.
        ctx.save_for_backward(x, None if z is None else z.contiguous(), weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dout):
        x, z, weight, rstd = ctx.saved_tensors
        d = x.shape[-1]
        rows, zrows, drows = x.reshape(-1, d), None if z is None else z.reshape(-1, d), dout.reshape(-1, d)
        dx = torch.empty_like(rows)
        dz = None if z is None else torch.empty_like(zrows)
        dweight = torch.zeros(d, dtype=rstd.dtype, device=x.device)
        wf = _at_least_fp32(weight)
        for part in _row_chunks(rows):
            dx_part, dz_part = _norm_backward_rows(
                rows[part], None if z is None else zrows[part], wf, rstd[part], drows[part], ctx.group_size, dweight
            )
            dx[part] = dx_part
            if dz is not None:
                dz[part] = dz_part
        return dx.view(x.shape), None if dz is None else dz.view(z.shape), dweight.to(weight.dtype), None, None


def _row_chunks(rows: torch.Tensor) -> list[slice]:
    """Slices of ``rows`` ([tokens, channels]) of at most NORM_CHUNK_BYTES as float32."""
    step = max(1, NORM_CHUNK_BYTES // (4 * rows.shape[-1]))
    return [slice(lo, lo + step) for lo in range(0, rows.shape[0], step)]


def _norm_backward_rows(x, z, weight_fp32, rstd, dout, c: int, dweight: torch.Tensor):
    """GatedGroupRMSNorm's backward on a chunk of rows: ``(dx, dz)``; adds the weight's gradient into
    ``dweight``. The float32 copies of x and z are remade where needed, and the in-place ops work
    on buffers made here, so few temporaries are alive at once."""
    u = _at_least_fp32(x) if z is None else _at_least_fp32(x) * F.silu(_at_least_fp32(z))
    normed = rearrange(u, "r (g c) -> r g c", c=c) * rstd
    del u
    dout = _at_least_fp32(dout)
    dweight += (dout * rearrange(normed, "r g c -> r (g c)")).sum(dim=0)
    dnormed = rearrange(dout * weight_fp32, "r (g c) -> r g c", c=c)
    del dout
    # d/du of u * rstd(u) over each group: rstd * (dn - n * mean(dn * n)).
    dot = (dnormed * normed).mean(dim=-1, keepdim=True)
    du = rearrange(dnormed.sub_(normed.mul_(dot)).mul_(rstd), "r g c -> r (g c)")
    del dnormed, normed
    if z is None:
        return du, None
    zf = _at_least_fp32(z, copy=True)
    dx = F.silu(zf).mul_(du)
    du.mul_(_at_least_fp32(x))
    torch.ops.aten.silu_backward.grad_input(du, zf, grad_input=du)  # autograd's own kernel, in place
    return dx, du


class ConvWeights(torch.nn.Module):
    """The depthwise conv's parameters (``weight [channels, 1, d_conv]``, ``bias [channels]`` unless
    ``bias=False``), as ``nn.Conv1d`` names them; ``causal_conv1d`` applies them."""

    def __init__(self, channels: int, d_conv: int, device=None, dtype=None, bias: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(channels, 1, d_conv, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(channels, device=device, dtype=dtype)) if bias else None

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, d_conv={self.weight.shape[-1]}"


class MambaMixer(torch.nn.Module):
    """Mamba-2 mixer.

    Args:
        config: Finalized ``TransformerConfig`` (hidden size, init std, layer count, params dtype).
        mamba_config: ``MambaConfig`` (state dim, head dim, groups, heads, states dtype).
        layer_number: 1-based global layer number.
        pg: ``ProcessGroups`` (or ``None`` for a world of one); heads are split over its TP size.
        device: Device for the parameters (default: torch's default device).
        d_conv: Taps of the causal convolution.
        conv_init: Uniform init range of the conv weight (None: kaiming-uniform, as ``nn.Conv1d``).
        expand: ``d_inner / hidden size`` when ``--mamba-num-heads`` is unset.
        A_init_range: ``A`` is drawn uniformly from this range (``A_log = log A``).
        D_has_hdim: ``D`` per channel instead of per head.
        rmsnorm: Gated grouped RMSNorm before the out-projection.
        dt_min, dt_max, dt_init_floor: ``softplus(dt_bias)`` starts log-uniform in ``[dt_min, dt_max]``.
        chunk_size: Chunk length of the SSD scan.
        use_fused_kernels: Use mamba-ssm / causal-conv1d (None: when installed and on CUDA).
    """

    def __init__(
        self,
        config,
        mamba_config,
        layer_number: int = 1,
        pg=None,
        *,
        device=None,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        chunk_size: int = SCAN_CHUNK,
        use_fused_kernels: bool | None = None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.d_model = config.hidden_size
        self.d_conv = d_conv
        self.d_state = mamba_config.mamba_state_dim
        self.headdim = mamba_config.mamba_head_dim
        self.ngroups = mamba_config.mamba_num_groups
        if mamba_config.mamba_num_heads is not None:
            self.nheads = mamba_config.mamba_num_heads
        else:
            if expand * self.d_model % self.headdim:
                raise ValueError(
                    f"{expand} * --hidden-size ({expand * self.d_model}) must be divisible by --mamba-head-dim "
                    f"({self.headdim}); or set --mamba-num-heads."
                )
            self.nheads = expand * self.d_model // self.headdim
        self.d_inner = self.nheads * self.headdim
        self.D_has_hdim = D_has_hdim
        self.rmsnorm = rmsnorm
        self.chunk_size = chunk_size
        self.states_dtype = mamba_config.ssm_states_dtype
        self.use_mem_eff_path = mamba_config.use_mamba_mem_eff_path
        self.use_fused_kernels = use_fused_kernels
        if self.nheads % self.ngroups:
            raise ValueError(f"Mamba heads ({self.nheads}) must be divisible by --mamba-num-groups ({self.ngroups}).")
        tp = get_tensor_model_parallel_size(pg)
        if self.nheads % tp or self.ngroups % tp:
            raise ValueError(
                f"Mamba heads ({self.nheads}) and --mamba-num-groups ({self.ngroups}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})."
            )
        # This rank's share: whole heads and whole groups.
        self.nheads_local = self.nheads // tp
        self.ngroups_local = self.ngroups // tp
        self.d_inner_local = self.d_inner // tp
        device = resolve_device(device)
        dtype = config.params_dtype

        n_bc = self.ngroups * self.d_state
        self.in_proj = ColumnParallelLinear(
            self.d_model,
            2 * self.d_inner + 2 * n_bc + self.nheads,  # z, x, B, C, dt
            config=config,
            init_method=sectioned_init(init_method_normal(config.hidden_init_std()), self._split_sizes(), tp),
            bias=False,
            gather_output=False,
            pg=pg,
            device=device,
        )
        self.in_proj.weight.partition_sizes = self._split_sizes()  # rank-local [z, x, B, C, dt] rows
        self.in_proj.weight.use_muon = False  # Megatron steps it with Adam under --optimizer muon

        # Every draw is of the one-process (full) tensor; this rank keeps its slices, so all TP
        # layouts start from the same model.
        tp_rank = get_tensor_model_parallel_rank(pg)
        conv_sections = self._split_sizes()[1:4]  # rank-local [x, B, C] channels
        self.conv1d = ConvWeights(sum(conv_sections), d_conv, device=device, dtype=dtype)
        full_weight = torch.empty(sum(conv_sections) * tp, 1, d_conv, device=device, dtype=dtype)
        full_bias = torch.empty(sum(conv_sections) * tp, device=device, dtype=dtype)
        with torch.no_grad():
            if conv_init is not None:
                full_weight.uniform_(-conv_init, conv_init)
            else:
                torch.nn.init.kaiming_uniform_(full_weight, a=math.sqrt(5))
            bound = 1.0 / math.sqrt(d_conv)  # fan-in of a depthwise filter: 1 channel x d_conv taps
            full_bias.uniform_(-bound, bound)
            self.conv1d.weight.copy_(section_shard(full_weight, conv_sections, tp, tp_rank))
            self.conv1d.bias.copy_(section_shard(full_bias, conv_sections, tp, tp_rank))

        with torch.no_grad():
            # softplus(dt_bias) log-uniform in [dt_min, dt_max]; dt_bias is its inverse softplus.
            # Drawn in float32, then stored in the model's dtype, as Megatron's Float16Module casts them.
            dt = torch.exp(
                torch.rand(self.nheads, device=device, dtype=torch.float32) * (math.log(dt_max) - math.log(dt_min))
                + math.log(dt_min)
            ).clamp(min=dt_init_floor)
            inv_dt = rank_slice(dt + torch.log(-torch.expm1(-dt)), tp, tp_rank).clone()  # its own storage
            assert 0 < A_init_range[0] <= A_init_range[1], A_init_range
            A = rank_slice(
                torch.empty(self.nheads, device=device, dtype=torch.float32).uniform_(*A_init_range), tp, tp_rank
            )
        self.dt_bias = torch.nn.Parameter(inv_dt.to(dtype))
        self.A_log = torch.nn.Parameter(torch.log(A).to(dtype))
        self.D = torch.nn.Parameter(
            torch.ones(self.d_inner_local if D_has_hdim else self.nheads_local, device=device, dtype=dtype)
        )
        if rmsnorm:
            self.norm = GroupedRMSNorm(
                self.d_inner_local, self.d_inner_local // self.ngroups_local, eps=1e-5, device=device, dtype=dtype
            )
        else:
            self.norm = None
        self.out_proj = RowParallelLinear(
            self.d_inner,
            self.d_model,
            config=config,
            init_method=init_method_normal(config.output_init_std()),
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            pg=pg,
            device=device,
        )
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D):
            p.tensor_model_parallel = True
            p.partition_dim = 0
        for p in (self.conv1d.weight, self.conv1d.bias):
            p.partition_sizes = conv_sections
        if self.norm is not None:
            self.norm.weight.tensor_model_parallel = True
            self.norm.weight.partition_dim = 0

    def _split_sizes(self) -> list[int]:
        """Rank-local widths of ``z, x, B, C, dt`` in the in-projection output."""
        n_bc = self.ngroups_local * self.d_state
        return [self.d_inner_local, self.d_inner_local, n_bc, n_bc, self.nheads_local]

    def _fused(self, hidden_states: torch.Tensor) -> bool:
        if self.use_fused_kernels is not None:
            return self.use_fused_kernels
        return HAVE_MAMBA_SSM and hidden_states.is_cuda

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h] -> (out [s, b, h], None)`` (the out-projection has no bias)."""
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, 2 d_inner + 2 g n + heads] (this rank's part)
        zxbcdt = rearrange(zxbcdt, "s b d -> b s d")
        A = -torch.exp(_at_least_fp32(self.A_log))  # [heads]
        if self._fused(hidden_states):
            y = self._fused_ssm(zxbcdt, A)
        else:
            pieces = self._pieces(zxbcdt)
            del zxbcdt  # nothing keeps it for backward: its memory goes before the scan runs
            y = self._ssm(pieces, A)
        y = rearrange(y, "b s d -> s b d")
        out, _ = self.out_proj(y)
        return out, None

    def _pieces(self, zxbcdt: torch.Tensor) -> list[torch.Tensor]:
        """``[z, x|B|C, dt]`` of the in-projection output, each in storage of its own (dt in float32)."""
        z, x, B, C, dt = torch.split(zxbcdt, self._split_sizes(), dim=-1)
        return [
            z.contiguous(),
            torch.cat([x, B, C], dim=-1),
            _at_least_fp32(dt, copy=True),
        ]

    def _ssm(self, pieces: list[torch.Tensor], A: torch.Tensor) -> torch.Tensor:
        """PyTorch path: ``_pieces``' list (emptied here, so each piece is freed once used) ->
        ``[b, s, d_inner]`` (gated and normalised)."""
        z, xbc, dt = pieces
        pieces.clear()
        xbc = causal_conv1d(
            rearrange(xbc, "b s d -> b d s"), self.conv1d.weight, self.conv1d.bias, activation="silu", use_fused=False
        )
        x, B, C = torch.split(rearrange(xbc, "b d s -> b s d"), self._split_sizes()[1:4], dim=-1)
        dt = F.softplus(dt + _at_least_fp32(self.dt_bias))  # [b, s, heads]
        D = _at_least_fp32(self.D)
        if self.D_has_hdim:
            D = rearrange(D, "(h p) -> h p", p=self.headdim)
        y = ssd_chunked_scan(
            rearrange(x, "b s (h p) -> b s h p", p=self.headdim),
            dt,
            A,
            rearrange(B, "b s (g n) -> b s g n", n=self.d_state),
            rearrange(C, "b s (g n) -> b s g n", n=self.d_state),
            self.chunk_size,
            D=D,
            state_dtype=self.states_dtype,
        )
        y = rearrange(y, "b s h p -> b s (h p)")
        if self.norm is not None:
            return self.norm(y, z)
        return y * F.silu(z)

    def _fused_ssm(self, zxbcdt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """mamba-ssm path (same math, Triton kernels)."""
        if not HAVE_MAMBA_SSM:
            raise RuntimeError("use_fused_kernels=True needs the mamba-ssm package (pip install mamba-ssm)")
        D = self.D.float()
        if self.D_has_hdim:
            D = rearrange(D, "(h p) -> h p", p=self.headdim)
        kwargs = {} if self.states_dtype is None else {"state_dtype": self.states_dtype}
        if self.use_mem_eff_path:
            # Conv, scan and gating by z in one kernel; returns y * silu(z).
            y = mamba_split_conv1d_scan_combined(
                zxbcdt,
                rearrange(self.conv1d.weight, "d 1 w -> d w"),
                self.conv1d.bias,
                self.dt_bias.float(),
                A,
                D=D,
                chunk_size=self.chunk_size,
                activation="silu",
                headdim=None if self.D_has_hdim else self.headdim,
                ngroups=self.ngroups_local,
                norm_before_gate=False,
                **kwargs,
            )
            return self.norm(y) if self.norm is not None else y
        z, x, B, C, dt = torch.split(zxbcdt, self._split_sizes(), dim=-1)
        xbc = causal_conv1d(rearrange(torch.cat([x, B, C], -1), "b s d -> b d s"), self.conv1d.weight, self.conv1d.bias)
        x, B, C = torch.split(rearrange(xbc, "b d s -> b s d"), self._split_sizes()[1:4], dim=-1)
        y = mamba_chunk_scan_combined(
            rearrange(x, "b s (h p) -> b s h p", p=self.headdim),
            dt,
            A,
            rearrange(B, "b s (g n) -> b s g n", n=self.d_state),
            rearrange(C, "b s (g n) -> b s g n", n=self.d_state),
            self.chunk_size,
            D=D,
            z=None,
            dt_bias=self.dt_bias.float(),
            dt_softplus=True,
            **kwargs,
        )
        y = rearrange(y, "b s h p -> b s (h p)")
        return self.norm(y, z) if self.norm is not None else y * F.silu(z)

    def extra_repr(self) -> str:
        return (
            f"heads={self.nheads} (local {self.nheads_local}), head_dim={self.headdim}, groups={self.ngroups}, "
            f"state={self.d_state}, d_conv={self.d_conv}, chunk={self.chunk_size}"
        )
