"""Rotary position embedding (the "rotate half" / NeoX layout HF Llama and Qwen use), with the rope
scaling variants of the supported models: none/default, linear, Llama 3's frequency-band scaling, YaRN
(gpt-oss) and LongRoPE (Phi-3.5 / Phi-4-mini), over whole heads or their leading `rotary_dim` dims."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import triton
from torch import nn

from radiance.errors import ConfigError
from radiance.kernels._triton.rotary import partial_width, rotates as kernel_rotates
from radiance.kernels.device_info import supports_pdl


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth band in between
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated
    # (slowed by `factor`), those that turn more than beta_fast times kept, a linear ramp in between
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]

    def dim_turning(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (so q.k by its square); 1 for the other kinds."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "longrope":
        return float(scaling["attention_factor"])  # rope_config.longrope fills it in
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """The rotation frequencies of `head_dim` rotated dims; `long`: LongRoPE's long-context factors."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "longrope":  # per-frequency divisors, in transformers' order of operations
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if not scaling.get(key):
                raise ConfigError(f"yarn rope scaling needs {key!r}")
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    else:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn, "
                          f"longrope)")
    return inv_freq


# rows of the cos / sin tables built before the served context is known: a model's context can be millions of
# positions (Llama 4: 10M, 5 GB of tables at head_dim 128; a corrupt config's 10**12 died in an allocation), while
# what is served is capped by the KV cache (serve_context sizes the tables to it)
EAGER_TABLE_POSITIONS = 1 << 17


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q [T, Hq, D] and k [T, Hkv, D] at integer `positions` [T]; with `rotary_dim`
    below D only each head's leading rotary_dim dims rotate (Phi-4-mini), the rest pass through. `max_positions`
    is the model's context; the tables cover min(it, EAGER_TABLE_POSITIONS) rows until `serve_context` or
    `cover` says how many are used."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        self.theta, self.scaling, self.max_positions = theta, scaling, max_positions
        longrope = (scaling or {}).get("rope_type") == "longrope"
        # LongRoPE's factors follow the served context (serve_context); until told, the model's whole context
        self.long_factors = longrope and max_positions > scaling["original_max_position_embeddings"]
        cos, sin = self._tables(min(max_positions, EAGER_TABLE_POSITIONS))
        # [rows, rotary_dim/2] each; kept fp32 so low-precision models rotate with exact angles
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._step: tuple | None = None  # (positions, cos, sin) while `step` is active

    @property
    def table_positions(self) -> int:
        """The positions the tables cover (0 .. table_positions - 1)."""
        return self.cos.shape[0]

    def _tables(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, long=self.long_factors)
        freqs = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(self.scaling)
        return freqs.cos() * factor, freqs.sin() * factor

    def _rebuild(self, rows: int) -> None:
        cos, sin = self._tables(rows)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)  # buffers: assignment replaces them

    def cover(self, positions: int) -> None:
        """Tables for at least `positions` positions (up to the model's context), for a caller without an engine
        (eval's chunks)."""
        rows = min(positions, self.max_positions)
        if rows > self.table_positions:
            self._rebuild(rows)

    def serve_context(self, max_model_len: int) -> None:
        """Sizes the tables to the served context, and for LongRoPE picks the long factors when sequences may pass
        the pretraining context, else the short ones (vLLM's and llama.cpp's rule: one set for every position, so
        the KV cache never mixes rotations; transformers switches per forward by its longest position). Call
        before CUDA graphs are captured (the tables are replaced)."""
        rows = min(max_model_len, self.max_positions)
        longrope = (self.scaling or {}).get("rope_type") == "longrope"
        long = longrope and max_model_len > self.scaling["original_max_position_embeddings"]
        if long != self.long_factors or rows != self.table_positions:
            self.long_factors = long
            self._rebuild(rows)

    @contextmanager
    def step(self, positions: torch.Tensor):
        """Within one forward of the model, every layer rotates at the same positions: on the CPU their
        cos / sin rows are gathered once (4 ops per layer fewer), and for a few tokens (decode) also
        turned into one rotation matrix per token, so a layer rotates q and k with one matmul."""
        if positions.is_cuda:  # CUDA: Triton rotates
            self._step = None
        else:
            cos, sin = self._cos_sin(positions)
            small = positions.dim() == 1 and positions.numel() <= _MATRIX_MAX_TOKENS
            matrices = _rotation_matrices(cos[:, 0], sin[:, 0], self.head_dim) if small else None
            self._step = (positions, cos, sin, matrices)
        try:
            yield
        finally:
            self._step = None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._step is not None and self._step[0] is positions:
            return self._step[1], self._step[2]
        return self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)

    def fuses_kv_store(self, positions: torch.Tensor, q: torch.Tensor) -> bool:
        """Whether `rotate_and_store` serves these inputs (the Triton path: CUDA, [T, H, D], D/2 a power of 2);
        then at decode paged_decode_attention(rotary=...) rotates and stores in its own launch instead."""
        # the kernels rotate whole heads, or a power-of-2 part of their leading half (GLM-4.5's half, Qwen3.5's
        # quarter); Phi-4-mini's 3/4 stays on torch
        return (q.is_cuda and q.dim() == 3 and positions.dim() == 1
                and kernel_rotates(q.shape[-1], self.rotary_dim))

    def rotate_and_store(self, positions, q, k, v, k_cache, v_cache, slot_mapping, scales=None,
                         qk_norm=None, q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotated q (written to `q_out` when given, a contiguous tensor like q); the rotated k and v
        written to the paged cache at slot_mapping (-1: skipped), in one launch (what forward +
        store_kv_cache do in two); an fp8 cache holds them against `scales` (attention.KvScales; None:
        unscaled). qk_norm = (q_norm, k_norm) RMSNorm modules: q and k heads normalized first, in the same
        launch."""
        inv = (1.0, 1.0) if scales is None else (scales.inv_k, scales.inv_v)
        return _rotate_triton(positions, q, k, self.cos, self.sin, store=(v, k_cache, v_cache, slot_mapping, *inv),
                              qk_norm=qk_norm, q_out=q_out)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.fuses_kv_store(positions, q):
            # one Triton launch instead of ~20 small torch ops
            return _rotate_triton(positions, q, k, self.cos, self.sin)
        cos, sin = self._cos_sin(positions)
        if q.shape[:-2] == k.shape[:-2] and q.dtype == k.dtype:  # one chain of ops for both
            both = torch.cat((q, k), dim=-2)
            matrices = self._step[3] if self._step is not None and self._step[0] is positions else None
            if matrices is not None:  # [T, H, D] @ [T, D, D]
                rotated = torch.bmm(both.float(), matrices).to(q.dtype)
            else:
                rotated = _rotate(both, cos, sin)
            return rotated.split((q.shape[-2], k.shape[-2]), dim=-2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


# up to this many tokens a forward rotates with per-token [D, D] matrices (16 KB each): decode steps
_MATRIX_MAX_TOKENS = 16


def _rotation_matrices(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[T, R/2] cos, sin -> [T, D, D] M with x @ M = rotate-half rotation of the row x's leading R dims, the
    rest passed through (exact entries: every output sums the same two products as `_rotate`, plus zeros)."""
    c, s = torch.diag_embed(cos), torch.diag_embed(sin)
    rotation = torch.cat((torch.cat((c, s), dim=-1), torch.cat((-s, c), dim=-1)), dim=-2)
    rot = rotation.shape[-1]
    if rot == head_dim:
        return rotation
    matrices = torch.eye(head_dim, dtype=rotation.dtype).repeat(rotation.shape[0], 1, 1)
    matrices[:, :rot, :rot] = rotation
    return matrices


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation of x's leading 2 * cos.shape[-1] dims (all of them unless the rotary is partial)."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


# q heads per rotary program: a decode step's one token spreads its heads (and their norms) over several SMs
ROTARY_Q_HEADS_PER_PROGRAM = 8


def _rotate_triton(positions, q, k, cos, sin, store: tuple | None = None, qk_norm: tuple | None = None,
                   q_out: torch.Tensor | None = None):
    """RotaryEmbedding.forward in one Triton kernel: q [T, Hq, D], k [T, Hkv, D] (last dim contiguous views ok);
    narrower tables (rotary_dim / 2 wide) rotate each head's leading rotary_dim dims (rotary_kernel's ROT).
    With store = (v, k_cache, v_cache, slot_mapping, k_inv, v_inv) the rotated k and v go to their cache
    slots (an fp8 cache times k_inv / v_inv) and only q is returned. With qk_norm = (q_norm, k_norm) (RMSNorm
    modules of one eps) each head of q and k is normalized before its rotation. q_out: the rotated q's
    tensor (contiguous [T, Hq, D]; None: a new one)."""
    from radiance.kernels._triton.rotary import rotary_kernel

    t, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if q_out is None:
        q_out = torch.empty((t, q_heads, head_dim), dtype=q.dtype, device=q.device)
    elif q_out.shape != q.shape or q_out.dtype != q.dtype or not q_out.is_contiguous():
        raise ValueError(f"q_out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    if store is None:
        k_out = torch.empty((t, k_heads, head_dim), dtype=k.dtype, device=k.device)
        v = v_out = slots = k_out  # unused
        slot_stride, k_inv, v_inv = 0, 1.0, 1.0
    else:
        v, k_out, v_out, slots, k_inv, v_inv = store
        slot_stride = k_out.stride(1)
    if t == 0:
        return q_out if store is not None else (q_out, k_out)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pdl = supports_pdl(q.device)
    q_norm_w, k_norm_w, eps = (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps) if qk_norm else (cos, cos, 0.0)
    block_qh = min(triton.next_power_of_2(q_heads), ROTARY_Q_HEADS_PER_PROGRAM)
    grid = (t, -(-q_heads // block_qh) + 1)
    rotary_kernel[grid](q, k, q_out, k_out, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                        q_heads, k_heads, v, v_out, slots, v.stride(0), v.stride(1), slot_stride, k_inv, v_inv,
                        q_norm_w, k_norm_w, eps, HALF=head_dim // 2, BLOCK_QH=block_qh,
                        BLOCK_KH=triton.next_power_of_2(k_heads), STORE_KV=store is not None,
                        NORM=qk_norm is not None, PDL=pdl, launch_pdl=pdl,
                        ROT=partial_width(head_dim, 2 * cos.shape[-1]), num_warps=4)
    return q_out if store is not None else (q_out, k_out)
