"""Llama-family decoder (Llama 2/3, SmolLM2), the base Qwen2 and Qwen3 extend.

Linears are placeholders until the loader installs the module each checkpoint weight becomes
(`Mxfp4Linear`, `DenseLinear`, ...): the model only fixes names and shapes, in the canonical merged
naming (`self_attn.qkv_proj`, `mlp.gate_up_proj`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from radiance.kernels.glu import glu_mul
from radiance.layers.attention import Attention, AttentionMetadata
from radiance.layers.embedding import LMHead, VocabEmbedding
from radiance.layers.linear import DenseLinear, Mxfp4Linear, UnloadedLinear, takes_fp8
from radiance.layers.moe import SparseMoeBlock
from radiance.layers.norm import RMSNorm
from radiance.layers.rotary import RotaryEmbedding
from radiance.models.arch_config import ArchConfig


def for_norm(linear: nn.Module, x):
    """linear(x) for an output that a residual-add RMSNorm reads next: the split-K partials of a W4A8
    GEMM where the layer can leave them for the norm to sum (Mxfp4Linear.forward_for_norm)."""
    forward = getattr(linear, "forward_for_norm", None)
    return forward(x) if forward is not None else linear(x)


def input_norm(norm: nn.Module, x, residual, fp8: bool):
    """A decoder layer's first norm: (its output, the residual stream). The first layer starts the stream with its
    input; the others add their input to it in the norm's kernel."""
    if residual is None:
        return norm(x, fp8=fp8), x
    return norm(x, residual, fp8=fp8)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int = 0):
        super().__init__()
        self.cfg = cfg
        # a list: shared by every layer, not registered as a submodule each time; None: a NoPE layer (SmolLM3)
        self.rotary = [None if index in cfg.nope_layers else rotary]
        self.qkv_proj = UnloadedLinear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size,
                                       (cfg.q_size, cfg.kv_size, cfg.kv_size))
        self.o_proj = UnloadedLinear(cfg.q_size, cfg.hidden_size)
        self.qkv_bias = None
        if cfg.qkv_bias:
            self.qkv_bias = nn.Parameter(torch.zeros(cfg.q_size + 2 * cfg.kv_size), requires_grad=False)
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # gpt-oss: one learned logit per head joins every softmax denominator (fp32, as its kernels read it)
        self.sinks = (nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32), requires_grad=False)
                      if cfg.attention_sinks else None)
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale=cfg.attention_scale,
                              sliding_window=cfg.window_of(index), softcap=cfg.attn_softcap,
                              attention_chunk=cfg.chunk_of(index))

    def finish_loading(self) -> None:
        """Hand the q/k/v and o biases (Qwen2, gpt-oss) to their linears where those add a bias themselves:
        the GEMM's epilogue adds it in fp32 before its one rounding, as F.linear does, and the separate add
        launch goes away. Other linears keep the add in forward."""
        for linear_name, bias_name in (("qkv_proj", "qkv_bias"), ("o_proj", "o_bias")):
            linear, bias = getattr(self, linear_name), getattr(self, bias_name)
            if bias is not None and isinstance(linear, (Mxfp4Linear, DenseLinear)) and linear.bias is None:
                linear.bias = bias.detach()
                setattr(self, bias_name, None)

    def normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """(q, k, the per-head norms the attention applies to them (Qwen3) or None): q [..., q_size] and
        k [..., kv_size] as they leave the qkv projection."""
        return q, k, ((self.q_norm, self.k_norm) if self.q_norm is not None else None)

    def scaled_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q as attention takes it, given each row's position: unchanged here (Llama 4 scales its NoPE layers')."""
        return q

    def forward(self, positions, x, meta):
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q, k, qk_norm = self.normed_qk(q, k)
        q = self.scaled_queries(q, positions)
        lead = qkv.shape[:-1]
        q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        # rotary inside attention: on CUDA one launch normalizes (Qwen3) and rotates q and k and writes k, v
        # to the KV cache
        rotary = (self.rotary[0], positions) if self.rotary[0] is not None else None
        attended = self.attn(q, k, v, meta, rotary=rotary, quantize=takes_fp8(self.o_proj), qk_norm=qk_norm,
                             sinks=self.sinks)
        if self.o_bias is not None:  # a bias after the GEMM: its split-K sums cannot be left to the norm
            return self.o_proj(attended) + self.o_bias
        return for_norm(self.o_proj, attended)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.activation = cfg.mlp_activation  # SiLU; Gemma's GeGLU
        self.gate_up_proj = UnloadedLinear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                           (cfg.intermediate_size, cfg.intermediate_size))
        self.down_proj = UnloadedLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        if takes_fp8(self.down_proj) and takes_fp8(self.gate_up_proj) and self.gate_up_proj.fuses_glu():
            # both W4A8: the GLU (SiLU, GeGLU) runs in the gate_up GEMM's epilogue, then one quantize launch
            return for_norm(self.down_proj, self.gate_up_proj.forward_glu(x, self.activation))
        # one kernel on CUDA (fp8 out when down_proj is W4A8); torch's act(gate) * up on the CPU
        return for_norm(self.down_proj, glu_mul(self.gate_up_proj(x), self.activation,
                                                quantize=takes_fp8(self.down_proj)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, launch="attn_norm")
        self.self_attn = self.attention_class(cfg, rotary, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, launch="mlp_norm")
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe) if cfg.is_moe_layer(index) else LlamaMLP(cfg)

    def forward(self, positions, x, residual, meta):
        # the norms hand W4A8 linears fp8 activations straight from their fused kernel, and sum the
        # split-K partials the o_proj and down_proj GEMMs leave them at decode sizes (for_norm)
        x, residual = input_norm(self.input_layernorm, x, residual, fp8=takes_fp8(self.self_attn.qkv_proj))
        return self.feed_forward(self.self_attn(positions, x, meta), residual, meta)

    def feed_forward(self, x, residual, meta):
        """The layer's second half: the residual add and norm of the attention's output `x`, then the MLP."""
        # a sparse MLP's router reads the 16-bit norm output: W4A8 experts get it with its fp8 codes
        sparse = isinstance(self.mlp, SparseMoeBlock)
        mlp_fp8 = self.mlp.takes_fp8() if sparse else takes_fp8(self.mlp.gate_up_proj)
        x, residual = self.post_attention_layernorm(x, residual, fp8=mlp_fp8, keep_values=sparse)
        if sparse:  # a graph's padding rows pick no experts
            return self.mlp(x, meta.valid_rows if meta is not None else None), residual
        return self.mlp(x), residual


class LlamaBody(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.embed_scale, self.embed_scale_rounded = cfg.embed_scale, cfg.embed_scale_rounded
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling,
                                      rotary_dim=cfg.rotary_dim)
        # sliding layers with a rope of their own (Gemma 3, OLMo 3): its base, no scaling
        self.sliding_rotary = None
        if cfg.sliding_rope_theta is not None:
            self.sliding_rotary = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.sliding_rope_theta,
                                                  rotary_dim=cfg.rotary_dim)
        sliding = self.sliding_rotary if self.sliding_rotary is not None else self.rotary
        self.layers = nn.ModuleList(self.layer_class(cfg, sliding if cfg.window_of(i) else self.rotary, i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # Gemma multiplies by sqrt(hidden_size) rounded to the weights' dtype (sqrt(3072) = 55.43 -> 55.5)
            scale = self.embed_scale
            x = x * (float(torch.tensor(scale, dtype=x.dtype)) if self.embed_scale_rounded else scale)
        residual = None
        sliding = self.sliding_rotary.step(positions) if self.sliding_rotary is not None else nullcontext()
        with self.rotary.step(positions), sliding:
            for layer in self.layers:
                x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta) -> hidden [T, H] over the paged cache;
    compute_logits(hidden, fp32=True) -> fp32 logits (the model's dtype with fp32=False);
    forward_logits(input_ids [B, T]) -> [B, T, V] without a cache."""

    arch_overrides: dict = {}  # ArchConfig fields the architecture fixes, whatever config.json says
    supports_moe = False  # whether config.json's experts are served (else a clear error at load)
    body_class = LlamaBody

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        """The ArchConfig fields this architecture sets itself (arch_overrides; some read config.json)."""
        return dict(cls.arch_overrides)

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.config = cfg
        self.model = self.body_class(cfg)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, fp32)

    def checkpoint_linear(self, name: str, weight):
        """A checkpoint's linear (canonical name, radiance.formats weight) as this model serves it: unchanged here
        (Granite folds its residual multiplier into the linears that feed the residual stream)."""
        return weight

    @torch.inference_mode()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        return self.compute_logits(self.forward(input_ids, positions, None))

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
