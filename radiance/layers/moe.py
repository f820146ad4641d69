"""Sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, gpt-oss, Llama 4, GLM-4.5): a router picks `top_k` of E GLU
experts per token; Qwen2-MoE adds a shared expert every token goes through, scaled by a sigmoid gate; gpt-oss biases
the router and both expert linears and clamps its SwiGLU (MoeConfig.activation); Llama 4 routes each token to one
expert whose input it scales by the sigmoid of that expert's logit, and adds an ungated shared expert; GLM-4.5 picks
by sigmoid score plus a learned bias within the best expert groups (moe_routing.grouped_sigmoid_top_k), in fp32, and
adds an ungated shared expert.

Each expert is a pair of ordinary linears (`experts.<e>.gate_up_proj`, `experts.<e>.down_proj`) that the
loader installs like any other, so every checkpoint format reaches MXFP4 the usual way. When all of them
run the W4A8 kernel, `finish_loading` stacks their prepared weights and forward runs two grouped GEMMs
over expert-sorted token tiles (radiance.kernels.moe, moe_routing, moe_expanded); 16-bit experts on a GPU with torch's grouped GEMM
(sm_90: `torch._grouped_mm`, CUTLASS) are stacked the same way and run on it. Neither syncs with the host,
so CUDA graphs can capture them. Otherwise (CPU, the reference path) forward loops over the picked experts.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from radiance.kernels import moe as grouped_kernels
from radiance.kernels import moe_expanded, moe_routing
from radiance.kernels.activation import Fp8Activations, quantize_activations
from radiance.kernels.glu import SILU, GluActivation, glu_mul, glu_reference, silu_mul
from radiance.layers.linear import DenseLinear, UnloadedLinear, takes_fp8
from radiance.models.moe_config import MoeConfig


class Expert(nn.Module):
    """One GLU expert: a merged [gate | up] linear and a down linear, each with an optional bias (gpt-oss)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: GluActivation = SILU):
        super().__init__()
        self.activation = activation
        self.gate_up_proj = UnloadedLinear(hidden_size, 2 * intermediate_size, (intermediate_size, intermediate_size))
        self.down_proj = UnloadedLinear(intermediate_size, hidden_size)
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(2 * intermediate_size), requires_grad=False)
            self.down_bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_up_bias is None and self.activation == SILU:
            return self.down_proj(silu_mul(gate_up))
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias
        out = self.down_proj(glu_reference(gate_up, self.activation))
        return out + self.down_bias if self.down_bias is not None else out


class SparseMoeBlock(nn.Module):
    """forward(x [..., H]) -> sum over the top_k experts of router weight * expert(x), in x's dtype. x may come
    as Fp8Activations holding its 16-bit `values` too (takes_fp8: the norm before quantized it in its launch)."""

    def __init__(self, hidden_size: int, moe: MoeConfig):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.activation = moe.activation
        self.scores_scale_input = moe.scores_scale_input  # Llama 4 (its routing weights are then all 1)
        self.moe = moe
        if moe.sigmoid_grouped:  # GLM-4.5: the router and its correction bias in fp32, as transformers keeps them
            self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False, dtype=torch.float32)
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        else:  # the router, kept in 16 bits
            self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(Expert(hidden_size, moe.intermediate_size, moe.expert_bias, moe.activation)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = Expert(hidden_size, moe.shared_expert_size)
            if moe.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.grouped = None  # (gate_up, down) PreparedExperts once finish_loading stacked them
        self.grouped_16bit = None  # (gate_up [E, 2I, H], down [E, H, I]) 16-bit weights, likewise
        self.stacked_bias = (None, None)  # (gate_up [E, 2I], down [E, H]) expert biases, stacked likewise

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, top_k], expert ids int64 [T, top_k]): softmax over the router logits in fp32,
        the top_k of it, renormalized to sum to 1 where the model asks for it (or GLM-4.5's grouped sigmoid pick)."""
        return self._pick(self._gate_logits(x))

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits in torch's linear: in x's dtype, or fp32 for GLM-4.5's fp32 router."""
        return self.gate(x.float()) if self.moe.sigmoid_grouped else self.gate(x)

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, top_k], expert ids int64 [T, top_k]) from the router logits, in torch ops."""
        moe = self.moe
        if moe.sigmoid_grouped:
            return moe_routing.grouped_sigmoid_top_k(logits, self.gate.e_score_correction_bias, self.top_k,
                                                     moe.num_groups, moe.top_groups, self.norm_topk_prob,
                                                     moe.routed_scaling)
        return moe_routing.top_k_experts(logits, self.top_k, self.norm_topk_prob)

    def _route_tokens(self, logits: torch.Tensor, block_m: int, valid_rows: torch.Tensor | None):
        """moe_routing.route_tokens' (weights, int32 ids, ExpertRouting): its one launch for the softmax routers and
        GLM-4.5's sigmoid one over a single expert group (every GLM-4.5 / 4.6 release); with groups, the grouped
        pick in torch ops and route_to_experts."""
        moe = self.moe
        if not moe.sigmoid_grouped:
            return moe_routing.route_tokens(logits, self.top_k, self.norm_topk_prob, block_m, valid_rows)
        if moe.num_groups == 1:
            return moe_routing.route_tokens(logits, self.top_k, self.norm_topk_prob, block_m, valid_rows,
                                            correction_bias=self.gate.e_score_correction_bias,
                                            scaling=moe.routed_scaling)
        weights, ids = self._pick(logits)
        return weights, ids.to(torch.int32), moe_routing.route_to_experts(ids, self.num_experts, block_m, valid_rows)

    def input_scales(self, router_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Llama 4: what each token's input to its expert is multiplied by, [T] in `dtype` (the sigmoid of its top
        logit, computed in fp32 and rounded as transformers' Llama4Router does); None for the other models."""
        if not self.scores_scale_input:
            return None
        return torch.sigmoid(router_logits.max(dim=-1).values.float()).to(dtype)

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """self.gate(x), through the routing module's GEMV at decode sizes (moe_routing.router_logits); GLM-4.5's
        fp32 router on x in fp32."""
        if self.moe.sigmoid_grouped:
            return self._gate_logits(x)
        return moe_routing.router_logits(x, self.gate.weight, self.gate.bias)

    def takes_fp8(self) -> bool:
        """Whether the experts run the grouped W4A8 kernel, so the norm before should hand over Fp8Activations
        (with their 16-bit values, for the router) and spare the block its own quantize launch."""
        return self.grouped is not None

    def forward(self, x: torch.Tensor | Fp8Activations, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
        """valid_rows (device int, element 0; the grouped paths): the rows from it on are a CUDA graph's padding,
        routed to no expert (their output is the shared expert's alone, zeros without one)."""
        quantized = None
        if isinstance(x, Fp8Activations):
            if x.values is None:
                raise ValueError("SparseMoeBlock: Fp8Activations without their 16-bit values (the router needs them)")
            quantized, x = (x.x_q, x.x_scale), x.values
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        if self.grouped is not None:
            out = self._grouped_forward(x2, valid_rows, quantized)
        elif self.grouped_16bit is not None and x2.dtype == self.grouped_16bit[0].dtype:
            out = self._grouped_16bit_forward(x2, valid_rows)
        else:
            logits = self._gate_logits(x2)
            weights, ids = self._pick(logits)
            out = self._looped_forward(x2, weights, ids, self.input_scales(logits, x2.dtype))
        if self.shared_expert is not None:  # in x's dtype, as the model computes it
            shared = self.shared_expert(x2)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x2)) * shared
            out = out + shared
        return out.reshape(*lead, self.hidden_size)

    def _looped_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        scales: torch.Tensor | None = None) -> torch.Tensor:
        """Each picked expert on its own tokens (one host sync for the expert list): CPU and fallbacks. `scales`
        [T]: the tokens' inputs are multiplied by them first (input_scales)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            token, choice = torch.where(ids == e)
            h = self.experts[e](x[token] if scales is None else x[token] * scales[token, None])
            out.index_add_(0, token, h.float() * weights[token, choice, None])
        return out.to(x.dtype)

    def _grouped_forward(self, x: torch.Tensor, valid_rows: torch.Tensor | None,
                         quantized: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """W4A8 experts: routing in one launch at decode sizes, both expert GEMMs as grouped launches.
        `quantized`: x's (e4m3 codes, scales) where the norm made them, else quantized here."""
        x_q, x_scale = quantized if quantized is not None else quantize_activations(x)
        logits = self._router_logits(x)
        scales = self.input_scales(logits, x.dtype)
        if scales is not None:  # one expert per token: its input scale joins the token's activation scale
            x_scale = x_scale * scales.float().view(-1, 1)
        if moe_expanded.expand_serves(x, x.shape[0] * self.top_k, self.grouped[0]):
            return self._grouped_expanded_forward(x, x_q, x_scale, logits, valid_rows)
        gate_up, down = self.grouped
        block_m = grouped_kernels.moe_block_m(x.shape[0] * self.top_k, self.num_experts)
        weights, _, routing = self._route_tokens(logits, block_m, valid_rows)
        gate_up_bias, down_bias = self.stacked_bias
        y_q, y_scale = grouped_kernels.w4a8_moe_gemm(x_q, x_scale, gate_up, routing, rows_per_pair_source="token",
                                                     glu=True, out_dtype=x.dtype, bias=gate_up_bias,
                                                     activation=self.activation)
        h = grouped_kernels.w4a8_moe_gemm(y_q, y_scale, down, routing, rows_per_pair_source="pair", out_dtype=x.dtype,
                                          bias=down_bias)
        return moe_routing.combine_experts(h, weights, x.dtype, valid_rows=valid_rows)

    def _grouped_expanded_forward(self, x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor,
                                  logits: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
        """W4A8 experts with many tokens each (prefill): the pairs sorted by expert, both GEMMs on the experts
        expanded to fp8 (torch's fp8 grouped GEMM); the expert biases and the way back to pair order are
        left to the GLU and combine launches, which read the sorted rows in place."""
        gate_up, down = self.grouped
        weights, ids, routing = self._route_tokens(logits, 1, valid_rows)
        order = routing.sorted_pairs.long()  # block_m 1: every slot holds a pair (a padding row's: parked last)
        rows = order // self.top_k
        # fp8 rows gathered as bytes (index_select has no e4m3 kernel)
        rows_q = x_q.view(torch.uint8)[rows].view(x_q.dtype)
        gate_up_out = moe_expanded.w4a8_moe_mm_expanded(rows_q, x_scale[rows], gate_up, routing.group_ends,
                                                           out_dtype=x.dtype)
        act = glu_mul(gate_up_out, self.activation, quantize=True, **self._gate_up_bias(routing, len(order)))
        h_sorted = moe_expanded.w4a8_moe_mm_expanded(act.x_q, act.x_scale, down, routing.group_ends,
                                                        out_dtype=x.dtype)
        return self._combine_sorted(h_sorted, weights, ids, routing, x.dtype, valid_rows)

    def _grouped_16bit_forward(self, x: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
        """16-bit experts: the pairs sorted by expert (a routing without padding), two grouped GEMMs
        (torch._grouped_mm); biases and pair order as in _grouped_expanded_forward."""
        gate_up, down = self.grouped_16bit
        logits = self._router_logits(x)
        weights, ids, routing = self._route_tokens(logits, 1, valid_rows)
        order = routing.sorted_pairs.long()  # block_m 1: every slot holds a pair (a padding row's: parked last)
        rows = x[order // self.top_k]
        scales = self.input_scales(logits, x.dtype)
        if scales is not None:
            rows = rows * scales[order // self.top_k, None]
        gate_up_out = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=routing.group_ends)
        y = glu_mul(gate_up_out, self.activation, **self._gate_up_bias(routing, len(order)))
        h_sorted = torch._grouped_mm(y, down.transpose(1, 2), offs=routing.group_ends)
        return self._combine_sorted(h_sorted, weights, ids, routing, x.dtype, valid_rows)

    def _gate_up_bias(self, routing, rows: int) -> dict:
        """glu_mul's bias operands for expert-sorted rows (none without expert biases)."""
        if self.stacked_bias[0] is None:
            return {}
        return dict(bias=self.stacked_bias[0], row_expert=moe_routing.expert_of_rows(routing.group_ends, rows))

    def _combine_sorted(self, h_sorted, weights, ids, routing, dtype, valid_rows=None) -> torch.Tensor:
        """The router-weighted sum of expert-sorted outputs, each pair's down bias added (combine_experts)."""
        down_bias = self.stacked_bias[1]
        return moe_routing.combine_experts(
            h_sorted, weights, dtype, rows=moe_routing.pair_rows(routing.sorted_pairs, routing.num_pairs),
            bias=down_bias, ids=ids if down_bias is not None else None, valid_rows=valid_rows)

    def path(self) -> str:
        """How forward runs the experts, for the startup summary."""
        if self.grouped is not None:
            _, n, k = self.grouped[0].shape
            if moe_expanded.moe_expand_listed(n, k, self.grouped[0].w_q.device):
                return (f"grouped W4A8 kernel (fp8 grouped GEMM from {moe_expanded.EXPAND_PAIRS_PER_EXPERT} "
                        "pairs per expert)")
            return "grouped W4A8 kernel"
        return "torch grouped GEMM (16-bit)" if self.grouped_16bit is not None else "a loop over the picked experts"

    def capturable(self) -> bool:
        """Whether forward runs without host syncs (a grouped path): CUDA graphs can capture it."""
        return self.grouped is not None or self.grouped_16bit is not None

    def finish_loading(self) -> None:
        """After the loader installed every expert linear: stack the experts' weights for one grouped call, the
        16-bit ones for torch._grouped_mm, or the prepared MXFP4 ones for the grouped kernel when all of them run
        the W4A8 kernel (no bias, no numerics monitor). The experts keep views into the stacked tensors, so the
        weights are held once."""
        self._stack_biases()
        pairs = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        linears = [lin for pair in pairs for lin in pair]
        if all(isinstance(lin, DenseLinear) and lin.bias is None for lin in linears):
            self._stack_16bit(pairs)
            return
        if not all(takes_fp8(lin) and lin.bias is None and lin.monitor is None for lin in linears):
            return
        stacked = tuple(grouped_kernels.stack_experts([pair[i]._prepared() for pair in pairs]) for i in (0, 1))
        for i, experts in enumerate(stacked):
            for e, pair in enumerate(pairs):
                for buffer in ("w_q", "w_shift", "w_ref", "w_scale"):
                    setattr(pair[i], buffer, getattr(experts, buffer)[e])
        self.grouped = stacked

    def _stack_biases(self) -> None:
        """Expert biases as [E, N] tensors for the grouped paths; the experts keep views of them."""
        if self.experts[0].gate_up_bias is None:
            return
        stacked = []
        for attr in ("gate_up_bias", "down_bias"):
            biases = torch.stack([getattr(e, attr).detach() for e in self.experts])
            for e, expert in enumerate(self.experts):
                setattr(expert, attr, nn.Parameter(biases[e], requires_grad=False))
            stacked.append(biases)
        self.stacked_bias = tuple(stacked)

    def _stack_16bit(self, pairs) -> None:
        """16-bit experts on a GPU where torch has a grouped GEMM for them: stacked, the experts keep views."""
        weight = pairs[0][0].weight
        if not (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
                and grouped_mm_serves(weight.device)):
            return
        stacked = tuple(torch.stack([pair[i].weight for pair in pairs]) for i in (0, 1))
        for i, experts in enumerate(stacked):
            for e, pair in enumerate(pairs):
                pair[i].weight = experts[e]
        self.grouped_16bit = stacked


def grouped_mm_serves(device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs on this GPU (CUTLASS kernels for sm_90 and up)."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) >= (9, 0)


def moe_summary(model: nn.Module) -> str | None:
    """One startup line: how many sparse layers run their experts on which path (None without any)."""
    paths = Counter(m.path() for m in model.modules() if isinstance(m, SparseMoeBlock))
    if not paths:
        return None
    return "mixture of experts: " + ", ".join(f"{n} layer{'s' if n != 1 else ''} on {path}"
                                              for path, n in sorted(paths.items()))
