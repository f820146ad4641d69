"""Qwen3.5 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the language model of their
`...ForConditionalGeneration`) and Qwen3-Next (`Qwen3NextForCausalLM`): hybrid decoders, as transformers computes them.

- Three layers of four (config.json's `layer_types`, else every `full_attention_interval`-th layer attends) are Gated
  DeltaNet linear attention: q / k / v from one projection through a causal depthwise conv (SiLU), q and k
  L2-normalized, a per-head decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b), the
  delta rule over a [key_dim, value_dim] state per value head (radiance.layers.gated_delta), then an RMSNorm gated
  by SiLU(z) and out_proj. Each sequence keeps that state and the conv's last inputs in a slot of the engine's
  recurrent-state cache (engine.state_cache) instead of a KV cache.
- The other layers attend over the paged KV cache with Qwen3's q / k norms, rotary on the leading quarter of each
  head (partial_rotary_factor 0.25; the vision model's mRoPE is the plain rope for text), and an output gate: q_proj
  gives each head's query and a gate, and the attention's output is multiplied by sigmoid(gate) before o_proj.
- Every RMSNorm but the gated one scales by 1 + weight, as Gemma's (folded at load).
- The MoE models' sparse MLPs are Qwen2-MoE's (a gated shared expert); Qwen3-Next's linear attention stores its
  projections grouped by key head (GroupedGatedDeltaNet).
The checkpoints' multi-token-prediction weights (`mtp.*`) are not read, as transformers skips them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radiance.errors import ConfigError
from radiance.kernels._triton import gated_delta as decode_kernels
from radiance.kernels._triton.conv_prefill import causal_conv1d_prefill
from radiance.kernels._triton.gated_delta_chunked import CHUNK, chunked_prefill
from radiance.kernels._triton.gated_delta_prefill import recurrent_prefill
from radiance.kernels._triton.gated_norm_quant import gated_rms_norm_quant
from radiance.kernels.activation import Fp8Activations
from radiance.layers.attention import AttentionMetadata
from radiance.layers.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen, gated_rms_norm
from radiance.layers.linear import UnloadedLinear, takes_fp8
from radiance.layers.moe import SparseMoeBlock
from radiance.layers.norm import RMSNorm, scale_by_one_plus_weight, weights_in_fp32
from radiance.layers.rotary import RotaryEmbedding
from radiance.models.arch_config import ArchConfig, LinearAttentionConfig
from radiance.models.config_fields import positive
from radiance.models.llama import (LlamaAttention, LlamaBody, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, for_norm,
                                   input_norm)

LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(LlamaAttention):
    """Llama's attention (with Qwen3's q / k norms) whose q_proj also gives a gate per head: [q_h | gate_h] for each
    head h, and the output is attention * sigmoid(gate)."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int = 0):
        super().__init__(cfg, rotary, index)
        self.qkv_proj = UnloadedLinear(cfg.hidden_size, 2 * cfg.q_size + 2 * cfg.kv_size,
                                       (2 * cfg.q_size, cfg.kv_size, cfg.kv_size))

    def forward(self, positions, x, meta):
        cfg = self.cfg
        q_gate, k, v = self.qkv_proj(x).split((2 * cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        lead = q_gate.shape[:-1]
        q, gate = q_gate.reshape(*lead, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q, k, qk_norm = self.normed_qk(q.reshape(*lead, cfg.q_size), k)
        q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        rotary = (self.rotary[0], positions) if self.rotary[0] is not None else None
        # 16-bit out (no fp8 codes from the attention's merge): the gate multiplies it first
        attended = self.attn(q, k, v, meta, rotary=rotary, quantize=False, qk_norm=qk_norm)
        return for_norm(self.o_proj, attended * torch.sigmoid(gate.reshape(*lead, cfg.q_size)))


class CausalConv1d(nn.Module):
    """The depthwise causal conv's weight, [channels, 1, kernel] as checkpoints store nn.Conv1d's."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head times SiLU(z) (a plain weight: not one of the 1 + weight norms)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. With a cache (meta and bound states) it reads and updates each sequence's slot;
    without one (evaluation, the activation probe) every row of the batch starts from a zero state."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        la = self.la = cfg.linear_attention
        # the checkpoint's in_proj_qkv | in_proj_z and in_proj_b | in_proj_a, each pair one linear
        # (names.LINEAR_ATTENTION_MERGES): two GEMMs per step, one fp8 quantization of their input
        self.in_proj_qkvz = UnloadedLinear(cfg.hidden_size, la.conv_channels + la.value_size,
                                           (la.conv_channels, la.value_size))
        self.in_proj_ba = UnloadedLinear(cfg.hidden_size, 2 * la.num_value_heads,
                                         (la.num_value_heads, la.num_value_heads))
        self.conv1d = CausalConv1d(la.conv_channels, la.conv_kernel)
        # the decay's parameters in fp32 whatever the model's dtype (exp / softplus of them set every state's decay)
        self.dt_bias = nn.Parameter(torch.ones(la.num_value_heads, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(la.num_value_heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = UnloadedLinear(la.value_size, cfg.hidden_size)
        # bound by the engine (engine.state_cache): [slots, conv_channels, conv_kernel - 1] and
        # [slots, value heads, key_head_dim, value_head_dim] float32
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.cut = None  # while piecewise CUDA graphs are captured: the capture (engine.piecewise_graphs)

    def takes_fp8(self) -> bool:
        """Whether both input projections run the W4A8 kernel: the norm before them then hands them one
        Fp8Activations."""
        return takes_fp8(self.in_proj_qkvz) and takes_fp8(self.in_proj_ba)

    def _states(self, meta: AttentionMetadata | None, rows: torch.Tensor, lead: tuple) -> tuple:
        """(conv states, recurrent states, each sequence's slot, q_lens, whether each continues its state): the
        engine's slots with a cache; without one, zero states for each row of a [B, T] batch (a [T] one: one
        sequence)."""
        la = self.la
        if meta is not None and self.recurrent_state is not None:
            # a decode step's sequences all continue their states (a graph's metadata gives no list)
            continues = meta.continues_state if meta.continues_state is not None else [True] * len(meta.q_lens)
            return self.conv_state, self.recurrent_state, meta.state_slots, meta.q_lens, continues
        batch = rows.shape[0] // lead[-1] if lead else 1
        conv_state = rows.new_zeros(batch, la.conv_channels, la.conv_kernel - 1)
        state = torch.zeros(batch, la.num_value_heads, la.key_head_dim, la.value_head_dim, dtype=torch.float32,
                            device=rows.device)
        return conv_state, state, torch.arange(batch, device=rows.device), [lead[-1]] * batch, [False] * batch

    def forward(self, x: torch.Tensor | Fp8Activations, meta: AttentionMetadata | None):
        la = self.la
        if isinstance(x, Fp8Activations):  # quantized by the norm for both projections (takes_fp8)
            lead, rows = x.lead, x._replace(lead=(x.x_q.shape[0],))
            probe = x.x_q.new_empty((x.x_q.shape[0], 0), dtype=x.dtype)  # rows' count, device and dtype
        else:
            lead = x.shape[:-1]
            rows = probe = x.reshape(-1, x.shape[-1])
        qkv, z, b, a = self.projections(rows)
        # on CUDA with the engine's states the Triton launches (a decode step's take no host data: CUDA graphs
        # capture them; a graph's padding rows, slot -1, touch no state); the torch ops elsewhere
        if not (probe.is_cuda and meta is not None and self.recurrent_state is not None):
            return self._torch_forward(qkv, z, b, a, meta, probe, lead)
        g, beta = decode_kernels.decay_and_beta(a, b, self.A_log, self.dt_bias)
        if meta.is_decode:
            mixed = decode_kernels.conv_update(qkv, self.conv1d.weight[:, 0], self.conv_state, meta.state_slots)
            q, k, v = self._heads(mixed)
            out = decode_kernels.recurrent_step(q, k, v, g, beta, self.recurrent_state, meta.state_slots)
        elif self.cut is not None:  # capturing piecewise graphs: the capture runs the step's launches between pieces
            out = self.cut.delta_rule(self, qkv, g, beta, meta)
        else:
            out = self.prefill_delta_rule(qkv, g, beta, meta)
        n = probe.shape[0]
        gate = z.reshape(n, la.num_value_heads, la.value_head_dim)
        if takes_fp8(self.out_proj):  # the norm quantizes for the W4A8 kernel: one launch, not two
            fp8 = gated_rms_norm_quant(out.reshape(-1, la.value_head_dim), gate, self.norm.weight, self.norm.eps)
            return for_norm(self.out_proj, fp8._replace(lead=tuple(lead)))
        out = decode_kernels.gated_rms_norm(out.reshape(-1, la.value_head_dim), gate, self.norm.weight, self.norm.eps)
        return for_norm(self.out_proj, out.reshape(*lead, la.value_size))

    def prefill_delta_rule(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        """A CUDA prefill step's conv and delta rule (the layer's launches whose grids depend on how the step's
        tokens split into sequences: a piecewise CUDA graph runs them between its pieces): qkv [T, conv_channels]
        the conv's inputs, g and beta [T, Hv] the gates; the states at meta.state_slots updated in place, the prefix
        cache's saves kept. Returns the delta rule's output [T, Hv, Dv] (in `out` if given)."""
        flags = meta.continues_state_device
        if flags is None:
            flags = torch.tensor(meta.continues_state, dtype=torch.int32, device=qkv.device)
        mixed = causal_conv1d_prefill(qkv, self.conv1d.weight[:, 0], self.conv_state, meta.state_slots,
                                      meta.cu_seqlens_q, flags, max(meta.q_lens))
        if meta.state_saves:
            self._keep_conv_tails(qkv, self.conv_state, meta.q_lens, meta.state_saves)
        q, k, v = self._heads(mixed)
        state, slots = self.recurrent_state, meta.state_slots
        if meta.delta_chunks is not None:  # a step of long enough sequences: in chunks, on the tensor cores
            return chunked_prefill(q, k, v, g, beta, state, slots, meta.delta_chunks, flags,
                                   keep=tuple((save.chunk, save.row) for save in meta.state_saves), out=out)
        return recurrent_prefill(q, k, v, g, beta, state, slots, meta.cu_seqlens_q, flags, out=out)  # token by token

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [N, key heads, key_head_dim] and v [N, value heads, value_head_dim]: views of the conv's output."""
        la, n = self.la, mixed.shape[0]
        q, k, v = mixed.split((la.key_size, la.key_size, la.value_size), dim=-1)
        return (q.reshape(n, la.num_key_heads, la.key_head_dim), k.reshape(n, la.num_key_heads, la.key_head_dim),
                v.reshape(n, la.num_value_heads, la.value_head_dim))

    def _torch_forward(self, qkv, z, b, a, meta: AttentionMetadata | None, probe: torch.Tensor, lead: tuple):
        """The layer in torch ops after its projections (the CPU, and the reference)."""
        la = self.la
        conv_state, state, slots, q_lens, continues = self._states(meta, probe, lead)
        mixed = causal_conv1d_varlen(qkv, self.conv1d.weight[:, 0], conv_state, slots, q_lens, continues)
        saves = meta.state_saves if meta is not None else ()
        if saves:
            self._keep_conv_tails(qkv, conv_state, q_lens, saves)
        q, k, v = self._heads(mixed)
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule_varlen(q, k, v, g, torch.sigmoid(b), state, slots, q_lens, continues,
                                      keep=tuple((save.seq, save.tokens // CHUNK, save.row) for save in saves))
        out = self.norm(out, z.reshape(probe.shape[0], la.num_value_heads, la.value_head_dim))
        return for_norm(self.out_proj, out.reshape(*lead, la.value_size))

    def _keep_conv_tails(self, qkv: torch.Tensor, conv_state: torch.Tensor, q_lens: list[int], saves) -> None:
        """A prefix cache's conv tails from inside the step: the kernel - 1 inputs before each save's token (its
        delta-rule state is kept by the delta rule's launch)."""
        width = self.la.conv_kernel - 1
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        for save in saves:
            end = starts[save.seq] + save.tokens  # tokens >= 64 > width: the inputs are this step's
            conv_state[save.row] = qkv[end - width:end].T.to(conv_state.dtype)

    def projections(self, rows: torch.Tensor | Fp8Activations) -> tuple[torch.Tensor, ...]:
        """(q | k | v [N, conv_channels] as the conv reads them, z [N, value_size], b and a [N, value heads]): views
        of the two GEMMs' outputs (the kernels after them read strided rows)."""
        la = self.la
        qkv, z = self.in_proj_qkvz(rows).split((la.conv_channels, la.value_size), dim=-1)
        b, a = self.in_proj_ba(rows).split((la.num_value_heads, la.num_value_heads), dim=-1)
        return qkv, z, b, a


class GroupedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layer: the same computation from two projections whose rows run key head by key head,
    in_proj_qkvz = [q_g | k_g | v_g | z_g] and in_proj_ba = [b_g | a_g] for each key head g (with the value heads it
    serves), regrouped here into the conv's q | k | v order."""

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        la = self.la
        # stored whole (one partition each), rows grouped by key head
        self.in_proj_qkvz = UnloadedLinear(cfg.hidden_size, 2 * la.key_size + 2 * la.value_size)
        self.in_proj_ba = UnloadedLinear(cfg.hidden_size, 2 * la.num_value_heads)

    def projections(self, rows: torch.Tensor | Fp8Activations) -> tuple[torch.Tensor, ...]:
        la = self.la
        per_group = la.num_value_heads // la.num_key_heads
        value = per_group * la.value_head_dim
        qkvz = self.in_proj_qkvz(rows)
        n = qkvz.shape[0]
        q, k, v, z = qkvz.reshape(n, la.num_key_heads, -1).split(
            (la.key_head_dim, la.key_head_dim, value, value), dim=-1)
        b, a = self.in_proj_ba(rows).reshape(n, la.num_key_heads, -1).split((per_group, per_group), dim=-1)
        qkv = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return qkv, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)


class Qwen3_5DecoderLayer(LlamaDecoderLayer):
    attention_class = GatedAttention
    linear_attention_class = GatedDeltaNet

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, index: int):
        linear = index in cfg.linear_layers
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, launch="attn_norm")
        self.self_attn = None if linear else self.attention_class(cfg, rotary, index)
        self.linear_attn = self.linear_attention_class(cfg) if linear else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, launch="mlp_norm")
        self.mlp = self._mlp(cfg, index)

    @staticmethod
    def _mlp(cfg: ArchConfig, index: int) -> nn.Module:
        return SparseMoeBlock(cfg.hidden_size, cfg.moe) if cfg.is_moe_layer(index) else LlamaMLP(cfg)

    def forward(self, positions, x, residual, meta):
        if self.linear_attn is None:
            return super().forward(positions, x, residual, meta)
        # fp8 norm output when both input projections take it, else 16-bit (a 16-bit in_proj_ba, say)
        x, residual = input_norm(self.input_layernorm, x, residual, fp8=self.linear_attn.takes_fp8())
        return self.feed_forward(self.linear_attn(x, meta), residual, meta)


class Qwen3_5Body(LlamaBody):
    layer_class = Qwen3_5DecoderLayer

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        weights_in_fp32(self)  # transformers' Qwen3_5RMSNorm: (x * (1 + w)) in fp32, then one rounding


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    body_class = Qwen3_5Body
    arch_overrides = {"qk_norm": True, "attention_output_gate": True}

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        num_layers = hf_config.get("num_hidden_layers")
        if not isinstance(num_layers, int) or num_layers < 1:
            return dict(cls.arch_overrides)  # ArchConfig names the missing size
        types = layer_types(hf_config, num_layers)
        return {**cls.arch_overrides, "linear_attention": linear_attention_config(hf_config),
                "linear_layers": frozenset(i for i, t in enumerate(types) if t == "linear_attention")}

    def finish_loading(self) -> None:
        scale_by_one_plus_weight(self.model)  # every RMSNorm but the gated ones (another class)

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn is not None]

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """The layers that keep a recurrent state per sequence (engine.state_cache binds theirs)."""
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's MoE models: the same layers with sparse MLPs (softmax top-k, always renormalized, and a shared expert
    behind a sigmoid gate, as Qwen2-MoE's) on every layer."""

    supports_moe = True

    @classmethod
    def overrides(cls, hf_config: dict) -> dict:
        # no dense MLP, and transformers' config has no intermediate_size: the experts' size stands in for it
        return {**super().overrides(hf_config),
                "intermediate_size": hf_config.get("intermediate_size") or hf_config.get("moe_intermediate_size")}


class Qwen3NextDecoderLayer(Qwen3_5DecoderLayer):
    linear_attention_class = GroupedGatedDeltaNet


class Qwen3NextBody(Qwen3_5Body):
    layer_class = Qwen3NextDecoderLayer


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5's layers with the linear attention's projections grouped by key head
    (GroupedGatedDeltaNet) and sparse MLPs as Qwen2-MoE's (norm_topk_prob, decoder_sparse_step, mlp_only_layers, a
    gated shared expert)."""

    supports_moe = True
    body_class = Qwen3NextBody


def layer_types(config: dict, num_layers: int) -> list[str]:
    """config.json's layer_types, else transformers' rule: every full_attention_interval-th layer attends (4)."""
    types = config.get("layer_types")
    if types is None:
        interval = positive(config, "full_attention_interval", 4, integer=True)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        count = len(types) if isinstance(types, list) else repr(types)
        raise ConfigError(f"config.json lists {count} layer_types for {num_layers} layers")
    unknown = sorted(set(map(str, types)) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"unsupported layer_types {unknown} (supported: {', '.join(LAYER_TYPES)})")
    return types


def linear_attention_config(config: dict) -> LinearAttentionConfig:
    """The linear-attention sizes, with transformers' Qwen3_5TextConfig defaults."""
    la = LinearAttentionConfig(
        num_key_heads=positive(config, "linear_num_key_heads", 16, integer=True),
        num_value_heads=positive(config, "linear_num_value_heads", 32, integer=True),
        key_head_dim=positive(config, "linear_key_head_dim", 128, integer=True),
        value_head_dim=positive(config, "linear_value_head_dim", 128, integer=True),
        conv_kernel=positive(config, "linear_conv_kernel_dim", 4, integer=True))
    if la.num_value_heads % la.num_key_heads:
        raise ConfigError(f"config.json: linear_num_value_heads {la.num_value_heads} is not a multiple of "
                          f"linear_num_key_heads {la.num_key_heads}")
    if la.conv_kernel < 2:
        raise ConfigError(f"config.json field 'linear_conv_kernel_dim' must be at least 2, got {la.conv_kernel}")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {config.get('hidden_act')!r} is not supported for Qwen3.5 (only silu)")
    return la
