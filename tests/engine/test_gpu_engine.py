"""Engine on the GPU: CUDA graphs must not change greedy outputs (run with -m gpu on the H200)."""

from __future__ import annotations

import re

import pytest
import torch

from radiance import SamplingParams
from tests.engine.arrivals import staggered_outputs

pytestmark = pytest.mark.gpu


def test_cuda_graphs_do_not_change_greedy_outputs(tiny_llm):
    prompts = [[(7 * i + j) % 256 for j in range(3 + 11 * i)] for i in range(7)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", num_gpu_blocks_override=256, max_num_seqs=8, cuda_graph_max_batch=8)
    eager = tiny_llm(enforce_eager=True, **common)
    graphs = tiny_llm(enforce_eager=False, **common)
    in_order = tiny_llm(enforce_eager=False, overlap_decode=False, **common)
    assert eager.engine.runner.decode_graphs is None and graphs.engine.runner.decode_graphs.graphs
    assert graphs.engine.overlap_decode and not eager.engine.overlap_decode  # the default follows graphs
    out_eager = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    out_graph = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert out_eager == out_graph
    assert graphs.engine.overlapped_steps > 0
    # different lengths: the queued-ahead step is cut to the sequences still running
    mixed = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    assert ([o.outputs[0].token_ids for o in graphs.generate(prompts, mixed)]
            == [o.outputs[0].token_ids for o in in_order.generate(prompts, mixed)])
    alone = [graphs.generate(p, params)[0].outputs[0].token_ids for p in prompts[:3]]
    assert alone == out_graph[:3]


def test_gpu_matches_cpu_in_fp32(tiny_llm):
    """The Triton attention path in fp32 against the CPU SDPA path: same greedy tokens."""
    prompts = [[(5 * i + 3 * j) % 256 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in tiny_llm(device="cpu").generate(prompts, params)]
    gpu = tiny_llm(device="cuda", dtype="float32", num_gpu_blocks_override=128, max_num_seqs=8, cuda_graph_max_batch=8)
    torch.backends.cuda.matmul.allow_tf32 = False
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == cpu


@pytest.mark.parametrize("quantization", ["none", "mxfp4"])
def test_prefill_graphs_do_not_change_greedy_outputs(tiny_llm, quantization):
    """Single-sequence prefills replayed from padded CUDA graphs give the eager tokens: lengths below,
    at and between the buckets, a prefix-cache hit (context longer than the new tokens) and a prompt
    longer than the largest bucket (eager). Several prompts at once are not one sequence: eager too."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", num_gpu_blocks_override=256, max_num_seqs=4, cuda_graph_max_batch=4,
                  quantization=quantization)
    eager = tiny_llm(enforce_eager=True, **common)
    graphs = tiny_llm(enforce_eager=False, prefill_graph_tokens=(16, 32, 64), **common)
    runner = graphs.engine.runner
    assert sorted(runner.prefill_graphs.graphs) == [16, 32, 64] and eager.engine.runner.prefill_graphs is None
    prompts = [[(3 * i + 5 * j) % 256 for j in range(n)] for i, n in enumerate((5, 16, 17, 40, 64, 90))]
    for prompt in prompts:  # one at a time: each prefill is a single-sequence step
        assert (graphs.generate(prompt, params)[0].outputs[0].token_ids
                == eager.generate(prompt, params)[0].outputs[0].token_ids), len(prompt)
    # the same 40-token prompt again, extended: its first blocks come from the prefix cache
    longer = prompts[3] + [11, 12, 13, 14, 15, 16, 17]
    assert (graphs.generate(longer, params)[0].outputs[0].token_ids
            == eager.generate(longer, params)[0].outputs[0].token_ids)
    together = [o.outputs[0].token_ids for o in graphs.generate(prompts[:3], params)]
    assert together == [o.outputs[0].token_ids for o in eager.generate(prompts[:3], params)]


@pytest.mark.parametrize("quantization", ["none", "mxfp4"])
def test_piecewise_graphs_do_not_change_greedy_outputs(tiny_llm, quantization):
    """Steps no whole-step graph serves replay piecewise graphs (graphs between eager prefill-attention
    launches) and give the eager tokens: several prompts prefilling together, prompts arriving while others
    decode (a prefill chunk next to decodes), chunks of a prompt longer than the token budget, and a mix that
    fills the largest bucket; steps above it run eagerly."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", num_gpu_blocks_override=256, max_num_seqs=4, cuda_graph_max_batch=4,
                  quantization=quantization, max_num_batched_tokens=48)
    eager = tiny_llm(enforce_eager=True, **common)
    graphs = tiny_llm(enforce_eager=False, prefill_graph_tokens=(16, 32), piecewise_graph_tokens=(16, 32), **common)
    pieces = graphs.engine.runner.piecewise
    assert sorted(pieces.forwards) == [16, 32] and eager.engine.runner.piecewise is None
    assert pieces.max_seqs == 4
    served = []
    replay = pieces.replay
    pieces.replay = lambda *args: served.append(len(args[1])) or replay(*args)
    prompts = [[(3 * i + 7 * j) % 256 for j in range(n)] for i, n in enumerate((5, 13, 30, 21, 70, 9))]
    trio = [prompts[0], prompts[1], prompts[5]]  # 27 tokens prefilled in one step
    assert ([o.outputs[0].token_ids for o in graphs.generate(trio, params)]
            == [o.outputs[0].token_ids for o in eager.generate(trio, params)])
    assert served == [27]
    served.clear()
    # the 70-token prompt arrives in 48-token chunks next to decodes (33-48 tokens: above the buckets, eager)
    assert staggered_outputs(graphs, prompts, params) == staggered_outputs(eager, prompts, params)
    assert len(served) >= 3 and max(served) <= 32 and any(n > 16 for n in served), served


def test_fp8_kv_cache_gpu_matches_cpu(tiny_llm):
    """An fp8 KV cache on the GPU (Triton stores and reads, graphs, fused decode rotary) holds the bytes the
    CPU's torch path stores, so in fp32 the greedy tokens agree; a block takes half a 16-bit one's bytes."""
    prompts = [[(5 * i + 3 * j) % 256 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in tiny_llm(device="cpu", kv_cache_dtype="fp8").generate(prompts, params)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = tiny_llm(device="cuda", dtype="float32", num_gpu_blocks_override=128, max_num_seqs=8, cuda_graph_max_batch=8,
                   kv_cache_dtype="fp8")
    assert gpu.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == cpu
    from radiance.engine.kv_cache import block_bytes

    model = gpu.engine.runner.model
    assert 2 * block_bytes(model.config, 16, torch.float8_e4m3fn) == block_bytes(model.config, 16, torch.bfloat16)


def _assert_gpu_greedy_equals_cpu(path, prompts, params, **options) -> list[int]:
    """fp32 greedy tokens of the model at `path` on the GPU (Triton attention, rotary and norms, CUDA graphs) equal
    the CPU's; `options` go to both engines. Returns the rows of each step the piecewise graphs served."""
    from radiance import LLM

    cpu = [o.outputs[0].token_ids for o in LLM(str(path), device="cpu", dtype="float32", **options).generate(
        prompts, params)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = LLM(str(path), device="cuda", dtype="float32", num_gpu_blocks_override=128, max_num_seqs=4,
              cuda_graph_max_batch=4, **options)
    served, pieces = [], gpu.engine.runner.piecewise
    if pieces is not None:
        replay = pieces.replay
        pieces.replay = lambda *args, **kwargs: served.append(len(args[1])) or replay(*args, **kwargs)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == cpu
    return served


def test_qwen3_head_norms_fused_in_rotary_match_cpu(tiny_model_dir):
    """Qwen3's q_norm / k_norm run inside the rotary launch on the GPU: greedy tokens in fp32 as on the CPU."""
    path, _ = tiny_model_dir("qwen3")
    prompts = [[(5 * i + 3 * j) % 256 for j in range(20 + 9 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def test_yarn_positions_past_max_position_embeddings_match_cpu(tiny_model_dir, tmp_path):
    """A YaRN config serves original x factor positions (ArchConfig.context_length, here 32 x 4 = 128 over a
    max_position_embeddings of 48): the GPU's rotary launch reads its table past 48 as the CPU does (fp32, the
    same greedy tokens, prompts of 60-78 tokens)."""
    import json
    import shutil

    src, _ = tiny_model_dir("qwen3")
    path = tmp_path / "yarn"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    config.update(max_position_embeddings=48, rope_parameters={
        "rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    (path / "config.json").write_text(json.dumps(config))
    prompts = [[(5 * i + 3 * j) % 256 for j in range(60 + 9 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                  max_model_len=128)


def test_mistral_window_on_every_layer_matches_cpu(tiny_model_dir):
    """Mistral's 24-token window on every layer through the Triton prefill and decode attention (no sinks): greedy
    tokens in fp32 as on the CPU, prompts longer than the window and decode past it."""
    path, _ = tiny_model_dir("mistral")
    prompts = [[(7 * i + 5 * j) % 256 for j in range(30 + 11 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))


def test_phi3_merged_linears_and_window_match_cpu(tiny_model_dir, tmp_path):
    """Phi-3's checkpoint stores qkv_proj / gate_up_proj merged: fp32 greedy tokens through the 20-token window on
    every layer equal the CPU's, and MXFP4 on the W4A8 kernels (the fused SiLU epilogue reads the stored gate | up
    halves) gives the logits of the same weights stored apart (as Mistral), bit for bit."""
    from radiance.checkpoint import open_checkpoint
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model
    from tests.engine.test_phi3 import split_as_mistral

    path, _ = tiny_model_dir("phi3")
    prompts = [[(7 * i + 5 * j) % 256 for j in range(26 + 11 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    ids = torch.tensor([prompts[2]], device="cuda")
    logits = []
    for checkpoint in (path, split_as_mistral(path, tmp_path / "split")):
        loaded = load_model(ModelConfig(device="cuda", dtype="bfloat16", quantization="mxfp4"),
                            checkpoint=open_checkpoint(checkpoint), progress=False)
        assert re.search(r"\b8/8 linears on the W4A8 kernel", "\n".join(loaded.summary)), loaded.summary
        logits.append(loaded.model.forward_logits(ids))
    assert torch.equal(*logits)


@pytest.mark.parametrize("model", ["gemma3", "gemma2", "gptoss", "llama4"])
def test_kv_groups_on_the_gpu_match_the_cpu_without_them(tiny_model_dir, model):
    """KV groups (engine.kv_layout) on the GPU: the local layers' own tables and slots through the decode graphs
    (fused rotary store), the prefill graphs and the piecewise graphs, their blocks behind the window released
    (blocks of 4 tokens, decodes well past the 24 / 32-token windows, Llama 4's 16-token chunks, prompts over several
    steps of 24 tokens): fp32 greedy tokens equal the CPU's without groups."""
    from radiance import LLM

    path, _ = tiny_model_dir(model)
    prompts = [[(7 * i + 5 * j) % 256 for j in range(30 + 23 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(path), device="cpu", dtype="float32", hybrid_kv_cache=False, block_size=4)
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = LLM(str(path), device="cuda", dtype="float32", num_gpu_blocks_override=256, max_num_seqs=4,
              cuda_graph_max_batch=4, block_size=4, max_num_batched_tokens=24)
    assert gpu.engine.block_manager.layout.releases_pages
    # fp32 experts (gpt-oss, Llama 4) loop with host syncs: no graphs there
    assert (gpu.engine.runner.decode_graphs is not None) == (model not in ("gptoss", "llama4"))
    assert ([o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in cpu.generate(prompts, params)])


def test_olmo_output_norms_and_whole_width_qk_norms_match_cpu(tiny_model_dir):
    """OLMo 2 and 3 on the GPU: q and k normed over all heads by the norm kernel (strided rows of the qkv output), no norm
    before the attention or the MLP (their linears quantize their own input), the output norms summing the GEMMs'
    partials: fp32 greedy tokens equal the CPU's."""
    prompts = [[(11 * i + 3 * j) % 256 for j in range(20 + 9 * i)] for i in range(3)]
    for model in ("olmo2", "olmo3"):  # OLMo 3: a sliding layer with its own rope next to a YaRN one
        path, _ = tiny_model_dir(model)
        _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


def test_gemma2_soft_capped_logits_match_cpu(tiny_model_dir):
    """Gemma 2's soft-capped attention logits in the Triton prefill and decode kernels (SOFTCAP), alternating
    sliding (24 tokens) and full layers, the capped output logits: fp32 greedy tokens equal the CPU's."""
    path, _ = tiny_model_dir("gemma2")
    prompts = [[(3 * i + 11 * j) % 256 for j in range(26 + 9 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


def test_granite_multipliers_match_cpu(tiny_model_dir):
    """Granite on the GPU: its attention scale in the Triton attention, the embedding multiplier, the residual
    multiplier folded into o_proj / down_proj (and o_proj's bias, in the GEMM's epilogue), the logits' divisor: fp32
    greedy tokens equal the CPU's."""
    path, _ = tiny_model_dir("granite")
    prompts = [[(13 * i + 5 * j) % 256 for j in range(18 + 9 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


def test_smollm3_nope_layer_matches_cpu(tiny_model_dir):
    """SmolLM3's NoPE layer (no rotary: q and k straight from the qkv GEMM into the Triton KV store and attention, a
    24-token window on it): fp32 greedy tokens equal the CPU's, prompts and decodes past the window."""
    path, _ = tiny_model_dir("smollm3")
    prompts = [[(3 * i + 7 * j) % 256 for j in range(28 + 9 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


def test_llama4_chunks_temperature_and_scaled_expert_inputs_match_cpu(tiny_model_dir):
    """Llama 4 on the GPU: 16-token attention chunks in the Triton prefill and decode attention (the split decode
    kernel with its own rotation at 18 sequences), the NoPE layers' query temperature, the weightless head norms in
    the rotary launch, the one-expert routing with the sigmoid score on the expert's input: fp32 greedy tokens equal
    the CPU's. MXFP4 on the grouped W4A8 kernel (the score folded into the tokens' activation scales) gives the
    per-expert loop's logits."""
    from radiance import LLM
    from radiance.checkpoint import open_checkpoint
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model
    from radiance.layers.moe import SparseMoeBlock

    path, _ = tiny_model_dir("llama4")
    prompts = [[(5 * i + 7 * j) % 256 for j in range(12 + 3 * i)] for i in range(18)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32").generate(prompts, params)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = LLM(path, device="cuda", dtype="float32", num_gpu_blocks_override=256, max_num_seqs=32,
              cuda_graph_max_batch=32)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == cpu
    # MXFP4: the grouped kernel (the score folded into the activation scales) against the per-expert loop (the
    # score on the input, as the CPU and transformers apply it) on the same bytes. float32, where the two round
    # alike: in bf16 the loop's rounded score * x moves e4m3 codes, which this tiny random model amplifies (3-5%)
    loaded = load_model(ModelConfig(device="cuda", dtype="float32", quantization="mxfp4"),
                        checkpoint=open_checkpoint(path), progress=False)
    assert "2 layers on grouped W4A8 kernel" in "\n".join(loaded.summary), loaded.summary
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    ids = torch.tensor([prompts[-1] * 2], device="cuda")  # 126 tokens: eight chunks, past the temperature's steps
    grouped = loaded.model.forward_logits(ids)
    for b in blocks:
        b.grouped = None  # the experts hold views of the stacked weights: the loop runs the same bytes
    looped = loaded.model.forward_logits(ids)
    assert ((grouped - looped).norm() / looped.norm()).item() < 1e-4


@pytest.mark.parametrize("max_model_len", [32, 128])  # LongRoPE's short factors, then its long ones
def test_phi3_longrope_partial_rotary_matches_cpu(tiny_model_dir, max_model_len):
    """Phi-4-mini's rotary (12 of 16 dims rotated, LongRoPE past a 32-token pretraining context) on the GPU, where the
    Triton launches that rotate whole heads step aside: fp32 greedy tokens equal the CPU's with either factor set."""
    path, _ = tiny_model_dir("phi3longrope")
    prompts = [[(7 * i + 5 * j) % 256 for j in range(6 + 5 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                                  max_model_len=max_model_len)


@pytest.mark.parametrize("head_dim", [32, 256])  # 256: Gemma 3's own head size through the Triton attention
def test_gemma3_matches_cpu(tmp_path, head_dim):
    """Gemma 3 on the GPU: the norms of 1 + weight (fused residual-add kernels), q/k norms in the rotary launch with two
    rope tables (sliding layers with their own base, full ones with linear scaling), query_pre_attn_scalar, the 24-token
    window and the GeGLU launch: fp32 greedy tokens equal the CPU's; MXFP4 on the W4A8 kernels stays as near the
    CPU reference as the other models do (RESULTS, forty-first session: 0.05-0.06 on tiny random models)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from radiance.checkpoint import open_checkpoint
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=256, head_dim=head_dim, sliding_window=24,
                              query_pre_attn_scalar=20, max_position_embeddings=512,
                              layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    prompts = [[(7 * i + 5 * j) % 256 for j in range(26 + 11 * i)] for i in range(3)]
    _assert_gpu_greedy_equals_cpu(tmp_path, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    ids = torch.tensor([prompts[2]])
    logits = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(ModelConfig(device=device, dtype="bfloat16", quantization="mxfp4"),
                            checkpoint=open_checkpoint(str(tmp_path)), progress=False)
        logits[device] = loaded.model.forward_logits(ids.to(device)).float().cpu()
    assert re.search(r"\b8/8 linears on the W4A8 kernel", "\n".join(loaded.summary)), loaded.summary
    rel = ((logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()).item()
    assert rel < 0.1, rel


def test_allowed_token_ids_and_cache_salt_on_the_gpu(tiny_llm):
    """vLLM's allowed_token_ids masks logits on the device (graphs, overlapped decode) for its own rows only, at
    greedy and random temperature; a cache_salt changes which blocks are shared, never the tokens."""
    llm = tiny_llm(device="cuda", num_gpu_blocks_override=256, max_num_seqs=4, cuda_graph_max_batch=4)
    assert llm.engine.runner.decode_graphs.graphs and llm.engine.overlap_decode
    prompts = [[3, 17, 17, 9, 40, 22, 5], list(range(60, 100))]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    allowed = (7, 8, 9, 10)
    assert not all(t in allowed for out in plain for t in out)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True, seed=1,
                                allowed_token_ids=allowed)
        outs = llm.generate(prompts + [prompts[0]], [params, params, free])
        assert all(t in allowed for o in outs[:2] for t in o.outputs[0].token_ids)
        assert outs[2].outputs[0].token_ids == plain[0]
    salted = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, cache_salt=salt) for salt in "ab"]
    assert [llm.generate(prompts[1], p)[0].outputs[0].token_ids for p in salted] == [plain[1], plain[1]]


def test_bad_words_on_the_gpu(tiny_llm):
    """vLLM's bad_words ban on the device (graphs, overlapped decode) for their own rows only: a one-token word
    never, a two-token word's last token only after its first; the forward of a sequence with a word of several
    tokens is still queued ahead, its sampling waits for the host's previous token, so overlapped and in-order
    decode give the same tokens, at greedy and random temperature."""
    from tests.engine.test_bad_words import _occurs, _words_from

    common = dict(device="cuda", num_gpu_blocks_override=256, max_num_seqs=4, cuda_graph_max_batch=4)
    llm = tiny_llm(**common)
    in_order = tiny_llm(overlap_decode=False, **common)
    assert llm.engine.runner.decode_graphs.graphs and llm.engine.overlap_decode
    prompts = [[3, 17, 17, 9, 40, 22, 5], list(range(60, 100))]
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    words = _words_from(plain[0])
    assert all(_occurs(w, plain[0]) for w in words)  # not vacuous: the free output writes them
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=16, temperature=temperature, ignore_eos=True, seed=1,
                                bad_words_token_ids=words)
        steps = llm.engine.overlapped_steps
        outs = llm.generate(prompts + [prompts[0]], [params, params, free])
        got = [o.outputs[0].token_ids for o in outs]
        assert not any(_occurs(w, out) for w in words for out in got[:2]), (words, got)
        assert got[2] == plain[0]  # batched beside them, a free request keeps its own tokens
        assert got == [o.outputs[0].token_ids for o in in_order.generate(prompts + [prompts[0]],
                                                                         [params, params, free])]
        if temperature == 0.0:  # greedy rows are queued ahead (a seeded draw is not)
            assert llm.engine.overlapped_steps > steps


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("budget, length", [(16, 25), (512, 70), (512, 260)])
def test_qwen3_5_linear_attention_states_match_cpu(tiny_model_dir, model, budget, length):
    """Qwen3.5 / Qwen3-Next on the GPU (the prefill's conv and delta rule through Triton, in 16-token chunks beside
    decodes or whole prompts of 70 tokens and more in one step, the chunked delta rule for prompts of 260 and more;
    decode steps through the Triton launches; where the model's experts allow graphs, decode graphs that carry the
    state slots, queued ahead, and every prefill step a piecewise graph's, the conv and delta rule eager between
    its pieces; the gated attention layer on the Triton attention, a quarter of each head rotated by the rotary
    launch): fp32 greedy tokens of three prompts equal the CPU's (torch's chunked form)."""
    path, _ = tiny_model_dir(model)
    prompts = [[(11 * i + 3 * j) % 256 for j in range(length + 9 * i)] for i in range(3)]
    served = _assert_gpu_greedy_equals_cpu(path, prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                                         ignore_eos=True),
                                           max_num_batched_tokens=budget)
    if model == "qwen3_5":  # Qwen3-Next's fp32 experts run off the W4A8 kernel: no graphs
        assert served and max(served) <= budget, served


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("budget", [128, 512])
def test_qwen3_5_prefix_states_continue_on_the_gpu(tiny_model_dir, model, budget):
    """Prefix caching on the GPU: a 300-token prompt, then two sharing its first 270 tokens. In 128-token steps the
    chunks are cut on block boundaries and the states at 256 copied after their step; in one 512-token step the
    chunked delta rule's launch keeps the state entering its fifth 64-token chunk (and the layer the conv's inputs
    before it). Restored by copies queued on the device's stream; decode graphs and steps queued ahead. Greedy fp32
    tokens equal the CPU's, and the later prompts continued from the first's states at 256."""
    from radiance import LLM

    path, _ = tiny_model_dir(model)
    first = [(7 * j + 1) % 256 for j in range(300)]
    later = [first[:270] + [(5 * j + i) % 256 for j in range(20)] for i in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=budget)
    want = [o.outputs[0].token_ids for o in cpu.generate([first], params) + cpu.generate(later, params)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = LLM(str(path), device="cuda", dtype="float32", num_gpu_blocks_override=128, max_num_seqs=4,
              cuda_graph_max_batch=4, max_num_batched_tokens=budget)
    outs = gpu.generate([first], params) + gpu.generate(later, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 256, 256]
    assert gpu.engine.block_manager.prefix_states.restores == 2


def test_hybrid_piecewise_graphs_do_not_change_greedy_outputs(tiny_model_dir):
    """Qwen3.5 in MXFP4 (the tiny Qwen3-Next's 48-wide shared expert cannot be: MXFP4 takes K in 32s): steps replayed
    from piecewise graphs, each linear-attention layer's conv and delta rule eager between two pieces, give the eager
    engine's greedy tokens: prompts prefilling together, arriving while others decode, in chunks of a 48-token budget
    (cut on block boundaries, their states kept), and a repeated prompt continuing from its kept states."""
    from radiance import LLM

    path, _ = tiny_model_dir("qwen3_5")
    common = dict(device="cuda", dtype="bfloat16", quantization="mxfp4", num_gpu_blocks_override=128, max_num_seqs=4,
                  cuda_graph_max_batch=4, max_num_batched_tokens=48)
    eager = LLM(path, enforce_eager=True, **common)
    graphs = LLM(path, piecewise_graph_tokens=(16, 32), **common)
    pieces = graphs.engine.runner.piecewise
    assert sorted(pieces.forwards) == [16, 32] and graphs.engine.runner.prefill_graphs is None
    served, replay = [], pieces.replay
    pieces.replay = lambda *args, **kwargs: served.append(len(args[1])) or replay(*args, **kwargs)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[(3 * i + 7 * j) % 256 for j in range(n)] for i, n in enumerate((5, 13, 30, 21, 70, 9))]

    def greedy(llm, batch):
        outs = llm.generate(batch, params)
        return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]

    trio = [prompts[0], prompts[1], prompts[5]]  # 27 tokens prefilled in one step
    assert greedy(graphs, trio) == greedy(eager, trio) and served == [27]
    served.clear()
    assert staggered_outputs(graphs, prompts, params) == staggered_outputs(eager, prompts, params)
    assert len(served) >= 3 and max(served) <= 32, served
    again = greedy(graphs, [prompts[4]])
    assert again == greedy(eager, [prompts[4]]) and again[1][0] >= 16, again  # a hit on a block with kept states


def test_qwen3_5_gated_norm_quantizes_for_the_w4a8_out_proj(tiny_model_dir, monkeypatch):
    """MXFP4 Qwen3.5 on the GPU: each linear-attention layer's gated norm quantizes its output for the W4A8
    out_proj in the same launch (gated_norm_quant); the greedy tokens equal those of the norm, then the linear's own
    quantization (the fusion off)."""
    from radiance import LLM
    from radiance.models import qwen3_5

    path, _ = tiny_model_dir("qwen3_5")
    fused, calls = qwen3_5.gated_rms_norm_quant, []
    monkeypatch.setattr(qwen3_5, "gated_rms_norm_quant", lambda *args: calls.append(1) or fused(*args))
    llm = LLM(str(path), device="cuda", dtype="bfloat16", quantization="mxfp4", enforce_eager=True,
              num_gpu_blocks_override=128, max_num_seqs=4)
    prompts = [[(7 * i + 5 * j) % 256 for j in range(30 + 11 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls  # prefill and decode steps both took the fused launch
    monkeypatch.setattr(qwen3_5, "takes_fp8", lambda linear: False)
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == got
    assert not calls
