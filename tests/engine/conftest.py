"""Fixtures of the engine tests: tiny random HF models saved to disk and read back through
`open_checkpoint`, and the embedded SmolLM2 loaded once per session."""

from __future__ import annotations

import pytest
import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# gpt-oss's published rope (YaRN, no truncation) on a shorter original context, so 300 tokens pass it
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 4.0],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}
YARN_ROPE = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 64, "rope_theta": 150000.0}


def tiny_hf_model(arch: str, seed: int = 0, vocab_size: int = 256):
    """A 2-layer random model of `arch` with every parameter random (biases and norms too), so a
    missing bias, norm or rope variant changes the logits."""
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, Glm4MoeConfig, GptOssConfig,
                              GraniteConfig, LlamaConfig,
                              Llama4TextConfig, MistralConfig, MixtralConfig, Olmo2Config, Olmo3Config, Phi3Config, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512)
    if arch == "llama3":
        config = LlamaConfig(**common, rope_scaling=dict(LLAMA3_ROPE), rope_theta=5000.0)
    elif arch == "llama_gelu":  # a GeGLU MLP through hidden_act
        config = LlamaConfig(**common, hidden_act="gelu_pytorch_tanh")
    elif arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=32)
    elif arch == "qwen3moe":  # layer 0 sparse (8 experts, top 2, renormalized), layer 1 dense
        config = Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    elif arch == "qwen2moe":  # layer 1 sparse (8 experts, top 2, not renormalized, a gated shared expert)
        config = Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, mlp_only_layers=[0])
    elif arch == "gptoss":  # a 32-token window on layer 0, full attention on layer 1; 8 experts, top 2
        config = GptOssConfig(**common, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
                              sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=dict(YARN_ROPE), swiglu_limit=1.0)  # a limit the clamps reach
        config._attn_implementation = "eager"  # the implementation that applies the sinks
    elif arch == "mistral":  # a 24-token window on every layer; head_dim given apart from hidden / heads (Nemo)
        config = MistralConfig(**common, head_dim=32, sliding_window=24)
    elif arch == "gemma3":  # a 24-token window on layer 0 (its own rope base), full attention with linear rope on
        # layer 1; a query scale apart from head_dim; GeGLU; tied head
        config = Gemma3TextConfig(**common, head_dim=32, sliding_window=24, query_pre_attn_scalar=20,
                                  layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    elif arch == "gemma2":  # sliding (24 tokens) and full layers alternating; caps small enough to matter here
        config = Gemma2Config(**common, head_dim=32, sliding_window=24, query_pre_attn_scalar=20,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        config._attn_implementation = "eager"  # the implementation that applies the attention soft cap
    elif arch == "phi3":  # a 20-token window on every layer (Phi-3-mini-4k's shape); merged qkv and gate_up
        config = Phi3Config(**common, sliding_window=20, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "phi3longrope":  # Phi-4-mini's shape: LongRoPE past a 32-token pretraining context, 12 of 16 dims
        # rotated
        config = Phi3Config(**common, original_max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, rope_parameters=dict(LONGROPE, partial_rotary_factor=0.75))
    elif arch == "olmo2":  # post-norms only; q and k normed over all their heads at once
        config = Olmo2Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "olmo3":  # OLMo 2's layers; a 24-token window on layer 0 (its own rope base), YaRN on full layer 1
        config = Olmo3Config(**common, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters={
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 # without `truncate`, as OLMo 3 ships it (transformers reads no per-type truncate)
                                 "full_attention": {k: v for k, v in YARN_ROPE.items() if k != "truncate"}})
    elif arch == "mixtral":  # 8 experts, top 2, every MLP sparse; a 24-token window on every layer
        config = MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, sliding_window=24,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "granite":  # its four multipliers, none of them 1 (nor a power of two), and attention biases
        config = GraniteConfig(**common, embedding_multiplier=12.0, attention_multiplier=0.2, residual_multiplier=0.22,
                               logits_scaling=8.0, attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "smollm3":  # layer 1 without rotary (NoPE), sliding over 24 tokens (use_sliding_window on)
        config = SmolLM3Config(**common, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=24,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "llama4":  # 4 layers: 0 and 2 rotate (llama3 rope) within 16-token chunks, 1 and 3 NoPE with the
        # query temperature from position 7 on; 1 and 3 sparse (4 experts, top 1, shared expert), 0 and 2 dense (MLP 96)
        config = Llama4TextConfig(**dict(common, num_hidden_layers=4), head_dim=32, intermediate_size_mlp=96,
                                  num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                  no_rope_layer_interval=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
                                  rope_parameters={**LLAMA3_ROPE, "rope_theta": 5000.0}, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)
    elif arch == "glm4moe":  # 3 layers: 0 dense, 1 and 2 sparse (8 experts in 4 groups, the best 2 groups, top 2,
        # scaled 2.5, a shared expert); q / k / v biases, q / k norms, rotary on half of each head
        config = Glm4MoeConfig(**dict(common, num_hidden_layers=3), moe_intermediate_size=32, n_routed_experts=8,
                               num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                               first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
                               use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch == "qwen3_5":  # Gated DeltaNet on layers 0, 1 and 3 (grouped: 2 k heads for 4 v heads), gated
        # attention with q / k norms and a quarter of each head rotating on layer 2
        from transformers import Qwen3_5TextConfig
        config = Qwen3_5TextConfig(**dict(common, num_hidden_layers=4), head_dim=16,
                                   layer_types=["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"],
                                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                   linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25},
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif arch in ("qwen3_5_moe", "qwen3_next"):  # the same layers with sparse MLPs (8 experts, top 2, a gated shared
        # expert); Qwen3-Next's linear attention projections grouped by key head, its layer 0's MLP dense
        from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig
        hybrid = dict(common, num_hidden_layers=4, head_dim=16,
                      layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                      linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        if arch == "qwen3_next":
            config = Qwen3NextConfig(**hybrid, norm_topk_prob=True, mlp_only_layers=[0])
        else:
            config = Qwen3_5MoeTextConfig(**hybrid)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model)
    return model


def randomize(model) -> None:
    """Every parameter random (biases and norms too, from the global generator), so that a missing piece shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):  # large enough to take a visible share of the softmax
                p.copy_(2.0 + torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's router bias: large enough to move picks
                b.copy_(0.3 * torch.randn_like(b))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch -> (directory saved with save_pretrained, the HF model)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = tiny_hf_model(arch)
            path = tmp_path_factory.mktemp(arch)
            model.save_pretrained(path)
            cache[arch] = (str(path), model)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """LLM factory over the tiny Llama 3 model: tiny_llm(**engine_options)."""
    from radiance import LLM

    path, _ = tiny_model_dir("llama3")

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")  # exact: results must not depend on batching or chunking
        return LLM(path, **options)

    return make


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct on the CPU as served by default (its Q4_1 linears on the int4
    kernel, bfloat16 where the CPU has it), loaded once."""
    from radiance import LLM

    return LLM(device="cpu", max_num_seqs=8)


TINY_TOKENIZER_VOCAB = 320  # the model's vocabulary: the tokenizer's ~300 tokens and a few unused rows


def tiny_byte_bpe_tokenizer():
    """A byte-level BPE tokenizer (256 bytes, `<eos>`, merges of a few English sentences), as small models
    ship them: enough for tests that need text, not just token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The quick brown fox jumps over the lazy dog.", '{"name": "Ann", "age": 31, "city": "Paris"}',
            "Paris is the capital of France, and Rome is the capital of Italy."] * 20
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def tiny_text_llm(tmp_path_factory):
    """LLM factory over a tiny random Llama 3 with a real (byte-level BPE) tokenizer saved beside it."""
    from radiance import LLM

    path = tmp_path_factory.mktemp("llama3-text")
    tokenizer = tiny_byte_bpe_tokenizer()
    model = tiny_hf_model("llama3", seed=1, vocab_size=TINY_TOKENIZER_VOCAB)
    for config in (model.config, model.generation_config):  # Llama's defaults (1, 2) are byte tokens here
        config.bos_token_id, config.eos_token_id = None, tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")
        return LLM(str(path), **options)

    return make


def assert_engine_greedy_matches_transformers(path, hf, prompt_len: int, chunk: int | None, low: int = 0,
                                              new_tokens: int = 24, **engine_options) -> None:
    """The engine's greedy tokens (fp32, CPU; prefill whole or in `chunk`-token pieces, then `new_tokens` - 1 decodes)
    equal `transformers.generate`'s for a random prompt of `prompt_len` tokens from [low, 256)."""
    from radiance import LLM, SamplingParams

    prompt = torch.randint(low, 256, (prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          min_new_tokens=new_tokens)
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(path, device="cpu", dtype="float32", **options, **engine_options)
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref[0, prompt_len:].tolist()


def assert_window_changes_logits(path, window: int, tokens: int) -> None:
    """The same weights without config.json's sliding window give other logits past it (equal inside it), so a match
    with transformers depends on the window."""
    from radiance.checkpoint import open_checkpoint
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model

    ckpt = open_checkpoint(path)
    windowed = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ckpt.config = dict(ckpt.config, sliding_window=None)
    full = load_model(ModelConfig(device="cpu", dtype="float32"), checkpoint=ckpt, progress=False).model
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(3))
    a, b = windowed.forward_logits(ids), full.forward_logits(ids)
    assert torch.equal(a[:, :window], b[:, :window])  # inside the window both attend to everything
    assert ((a[:, window:] - b[:, window:]).norm() / b[:, window:].norm()).item() > 1e-2
