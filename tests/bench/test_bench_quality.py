import dataclasses
import json
import math
import re

import pytest
import torch

from radiance.bench import quality
from radiance.bench.quality import EvalRequest, Variant
from radiance.errors import ConfigError


class BigramModel(torch.nn.Module):
    """logits[t] = table[token t]: the simplest model with forward_logits."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward_logits(self, input_ids):
        return self.table[input_ids]


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary; unknown words map to 0."""

    def __init__(self, vocab):
        self.vocab = {w: i for i, w in enumerate(vocab)}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.get(w, 0) for w in text.split()]}


def test_chunking():
    ids = list(range(25))
    chunks = quality.chunk_token_ids(ids, 3, 8)
    assert chunks.tolist() == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    assert quality.chunk_token_ids(ids, 10, 8).shape == (3, 8)  # fewer when the text is short
    assert quality.chunk_token_ids(ids, 2, 8, first=1).tolist() == [list(range(8, 16)), list(range(16, 24))]
    with pytest.raises(ConfigError):
        quality.chunk_token_ids(ids, 1, 8, first=3)
    with pytest.raises(ConfigError, match="fewer than 1 chunk"):
        quality.chunk_token_ids(ids, 1, 64)
    with pytest.raises(ConfigError):
        quality.chunk_token_ids(ids, 1, 1)


def test_uniform_model_has_perplexity_vocab_size():
    v = 13
    chunks = torch.randint(0, v, (4, 9))
    out = quality.evaluate(chunks, {"uniform": BigramModel(torch.zeros(v, v))}, progress=False)
    assert out["uniform"]["tokens"] == 4 * 8
    assert out["uniform"]["ppl"] == pytest.approx(v)
    assert "kl" not in out["uniform"]


def test_kl_and_ppl_match_a_direct_computation():
    torch.manual_seed(0)
    v = 11
    ref_table, table = torch.randn(v, v), torch.randn(v, v)
    chunks = torch.randint(0, v, (3, 7))
    out = quality.evaluate(chunks, {"m": BigramModel(table)}, reference=BigramModel(ref_table), progress=False)
    # independent computation: plain python loops over positions with softmax in float64
    kls, nll, agree, n = [], 0.0, 0, 0
    for row in chunks.tolist():
        for t in range(len(row) - 1):
            p = torch.softmax(ref_table[row[t]].double(), 0).tolist()
            q = torch.softmax(table[row[t]].double(), 0).tolist()
            kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
            nll -= math.log(q[row[t + 1]])
            agree += int(max(range(v), key=p.__getitem__) == max(range(v), key=q.__getitem__))
            n += 1
    assert out["m"]["kl"] == pytest.approx(sum(kls) / n, rel=1e-5)
    assert out["m"]["kl_max"] == pytest.approx(max(kls), rel=1e-5)
    assert out["m"]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-9)
    assert out["m"]["top1_agreement"] == pytest.approx(agree / n)
    # the reference against itself: KL 0, full agreement
    same = quality.evaluate(chunks, {"r": BigramModel(ref_table)}, reference=BigramModel(ref_table), progress=False)
    assert same["r"]["kl"] < 1e-9 and same["r"]["top1_agreement"] == 1.0
    assert same["reference"]["ppl"] == pytest.approx(same["r"]["ppl"])


def test_variant_parsing_and_labels():
    assert Variant.parse("nvfp4/none") == Variant("nvfp4", "none")
    assert Variant.parse("mxfp4/ocp/bf16").label == "mxfp4 ocp W4A16"
    assert Variant.parse("mxfp4").label == "mxfp4 mse W4A8"
    assert Variant.parse("nvfp4/noclip").label == "nvfp4->mxfp4 noclip W4A8"
    assert Variant("nvfp4", "none").label == "nvfp4 as W4A16"
    assert Variant.parse("mxfp4/mse/fp8+head") == Variant("mxfp4", "mse", "fp8", lm_head="mxfp4")
    assert Variant.parse("mxfp4+head").label == "mxfp4 mse W4A8 +4-bit head"
    assert Variant.parse("nvfp4/ocp+head2") == Variant("nvfp4", "ocp", lm_head="mxfp4x2")
    assert Variant.parse("mxfp4+head2").label == "mxfp4 mse W4A8 +2x4-bit head"
    assert Variant.parse("none+fp8kv") == Variant("none", kv_cache="fp8") and Variant("none", kv_cache="fp8").changes_numerics
    assert Variant.parse("mxfp4/mse/fp8+head2+fp8kv").label == "mxfp4 mse W4A8 +2x4-bit head +fp8 KV"
    assert not Variant("none").changes_numerics
    for bad in ("int4", "mxfp4/none", "mxfp4/mse/fp4", "a/b/c/d", "none+head", "mxfp4+head/mse",
                "nvfp4/none+head2", "none+head2", "mxfp4+fp8kv+head", "none+kv"):
        with pytest.raises(ConfigError):
            Variant.parse(bad)


@pytest.mark.parametrize("spec, message", [
    ("none/ocp", "the 16-bit model (none) has no block-exponent rule"),  # was the 16-bit model, without a word
    ("none/mse/bf16+fp8kv", "the 16-bit model (none) has no block-exponent rule"),
    ("nvfp4/none/fp8", "keeps 16-bit activations, not fp8"),
])
def test_a_variant_part_that_would_change_nothing_is_an_error(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Variant.parse(spec)
    assert Variant.parse("nvfp4/none/bf16") == Variant("nvfp4", "none", "bf16")  # what it serves: fine


@pytest.mark.parametrize("flags", [["--rule", "ocp"], ["--activations", "bf16"]])
def test_eval_of_the_16_bit_model_refuses_a_rule_or_activations(flags, tmp_path, capsys):
    from radiance.cli import main

    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    assert main(["eval", "ppl", "--text", str(text), *flags]) == 2
    err = capsys.readouterr().err
    assert "the 16-bit model (none) has no block-exponent rule" in err and len(err.strip().splitlines()) == 1
    assert f"--quantization none {' '.join(flags)}:" in err  # only what was typed (no default --rule mse quoted)


def test_run_eval_end_to_end_with_a_fake_loader(tmp_path):
    vocab = ["the", "cat", "sat", "on", "mat", "a", "dog"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(vocab[i % 7] for i in range(3 * 40)))
    torch.manual_seed(1)
    base = torch.randn(7, 7)
    loaded = []

    def loader(model, variant, device, dtype):
        loaded.append(variant)
        noise = 0.0 if variant.quantization == "none" else (0.3 if variant.activations == "fp8" else 0.1)
        return BigramModel(base + noise * torch.randn(7, 7)), WordTokenizer(vocab)

    req = EvalRequest("kl", None, (Variant("mxfp4", activations="fp8"), Variant("mxfp4", activations="bf16")),
                      str(text), chunks=4, chunk_len=16)
    out = quality.run_eval(req, loader, progress=False)
    assert [v.quantization for v in loaded] == ["none", "mxfp4", "mxfp4"]
    assert out["chunks"] == 4 and out["tokens"] == 4 * 15
    w4a8, w4a16 = out["results"]
    assert w4a8["label"] == "mxfp4 mse W4A8" and w4a8["kl"] > w4a16["kl"] > 0  # more noise, more KL
    assert out["kl"] == w4a8["kl"] and out["ppl"] == w4a8["ppl"]
    assert out["reference_ppl"] > 1
    json.dumps(out)  # serializable as-is
    with pytest.raises(ConfigError, match="itself"):
        quality.run_eval(EvalRequest("kl", None, (Variant("none"),), str(text), 2, 16), loader, progress=False)
    with pytest.raises(ConfigError, match="not found"):
        quality.run_eval(EvalRequest("ppl", None, (Variant("none"),), str(tmp_path / "x.txt"), 2, 16), loader,
                         progress=False)
    ppl_only = quality.run_eval(EvalRequest("ppl", None, (Variant("none"),), str(text), 2, 16), loader, progress=False)
    assert "kl" not in ppl_only and ppl_only["ppl"] > 1


def test_chunks_longer_than_the_model_context_are_refused(tmp_path):
    """Positions past the context have no rotary angles: an IndexError traceback on the CPU, reads
    out of bounds on CUDA. The chunk length is checked against the loaded model instead."""
    from types import SimpleNamespace

    vocab = ["the", "cat", "sat"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(vocab[i % 3] for i in range(200)))

    def loader(model, variant, device, dtype):
        bigram = BigramModel(torch.zeros(3, 3))
        bigram.config = SimpleNamespace(context_length=32)
        return bigram, WordTokenizer(vocab)

    with pytest.raises(ConfigError, match="chunk_len 33 .*32"):
        quality.run_eval(EvalRequest("ppl", None, (Variant("none"),), str(text), 2, 33), loader, progress=False)
    at_limit = quality.run_eval(EvalRequest("ppl", None, (Variant("none"),), str(text), 2, 32), loader, progress=False)
    assert at_limit["tokens"] == 2 * 31


def test_a_chunk_past_the_context_from_the_config_fails_before_any_model_loads(tmp_path):
    """With context_of (the context read from the model's config), a chunk longer than it is refused before the
    load of one or two models, not after."""
    text = tmp_path / "text.txt"
    text.write_text("the cat sat " * 50)
    loaded = []

    def loader(model, variant, device, dtype):
        loaded.append(variant)
        return BigramModel(torch.zeros(3, 3)), WordTokenizer(["the", "cat", "sat"])

    req = EvalRequest("kl", "m", (Variant("mxfp4"),), str(text), 2, 33)
    with pytest.raises(ConfigError, match="chunk_len 33 exceeds the model's context of 32 tokens"):
        quality.run_eval(req, loader, progress=False, context_of=lambda model: 32 if model == "m" else None)
    assert loaded == []
    fits = quality.run_eval(dataclasses.replace(req, chunk_len=16), loader, progress=False, context_of=lambda m: 32)
    assert fits["chunks"] == 2 and len(loaded) == 2


@pytest.mark.parametrize("text_name, chunks, chunk_len, first, match", [
    ("missing.txt", 2, 16, 0, "not found"),
    ("text.txt", 0, 16, 0, "chunks must be positive"),
    ("text.txt", -1, 16, 0, "chunks must be positive"),
    ("text.txt", 2, 1, 0, "chunk_len must be at least 2"),
    ("text.txt", 2, 16, -1, "first_chunk non-negative"),
])
def test_bad_requests_fail_before_any_model_loads(tmp_path, text_name, chunks, chunk_len, first, match):
    """A typo in --text or --chunks costs an error line, not the load of one or two large models first."""
    (tmp_path / "text.txt").write_text("the cat sat " * 50)
    loaded = []

    def loader(model, variant, device, dtype):
        loaded.append(variant)
        return BigramModel(torch.zeros(3, 3)), WordTokenizer(["the", "cat", "sat"])

    req = EvalRequest("kl", None, (Variant("mxfp4"),), str(tmp_path / text_name), chunks, chunk_len, first_chunk=first)
    with pytest.raises(ConfigError, match=match):
        quality.run_eval(req, loader, progress=False)
    assert loaded == []


@pytest.mark.parametrize("content, match", [
    ("caf\xe9 au lait".encode("latin-1"), "is not UTF-8"),
    (b"", "is empty"),
    (b"  \n\n ", "is empty"),
])
def test_unreadable_text_fails_before_any_model_loads(tmp_path, content, match):
    """A latin-1 file was a UnicodeDecodeError (without the file's name) after the model loads, which takes minutes
    for a large one (two for kl); an empty file said '0 tokens' only after them."""
    text = tmp_path / "text.txt"
    text.write_bytes(content)
    loaded = []

    def loader(model, variant, device, dtype):
        loaded.append(variant)
        return BigramModel(torch.zeros(3, 3)), WordTokenizer(["the", "cat", "sat"])

    with pytest.raises(ConfigError, match=f"text.txt {match}"):
        quality.run_eval(EvalRequest("kl", None, (Variant("mxfp4"),), str(text), 2, 16), loader, progress=False)
    assert loaded == []


def test_a_variant_past_float_range_reports_inf_perplexity():
    """Logits of +-1e5 that always miss the next token: mean NLL 2e5 nats, exp() of it overflows a float. The
    running progress figure and the result used to raise OverflowError; now the variant reads inf (null in --json)."""
    v = 3
    table = torch.full((v, v), -1e5)
    table[torch.arange(v), torch.arange(v)] = 1e5  # predicts the token it saw; the text never repeats one
    chunks = torch.tensor([[0, 1, 2, 0, 1, 2]])
    out = quality.evaluate(chunks, {"broken": BigramModel(table)}, progress=False)
    assert out["broken"]["ppl"] == math.inf and out["broken"]["nll"] == pytest.approx(2e5)
    from radiance.bench.report import to_json

    assert json.loads(to_json(out))["broken"]["ppl"] is None


class InterruptedAt(BigramModel):
    """A bigram model whose forward on the `at`-th chunk (0-based) is cut short by Ctrl-C."""

    def __init__(self, table: torch.Tensor, at: int):
        super().__init__(table)
        self.calls, self.at = 0, at

    def forward_logits(self, input_ids):
        self.calls += 1
        if self.calls - 1 == self.at:
            raise KeyboardInterrupt
        return super().forward_logits(input_ids)


def test_ctrl_c_keeps_the_whole_chunks_scored_before_it():
    """Ctrl-C during the third chunk's model forward: the first two chunks' numbers (the reference's too: it had
    scored the third chunk already, which is not counted), marked interrupted; during the first, nothing to report."""
    v = 6
    gen = torch.Generator().manual_seed(0)
    chunks = torch.randint(0, v, (5, 9), generator=gen)
    table, ref_table = torch.randn(v, v, generator=gen), torch.randn(v, v, generator=gen)
    out = quality.evaluate(chunks, {"m": InterruptedAt(table, at=2)}, reference=BigramModel(ref_table),
                           progress=False)
    whole = quality.evaluate(chunks[:2], {"m": BigramModel(table)}, reference=BigramModel(ref_table), progress=False)
    assert out["interrupted_after"] == 2
    assert out["m"] == whole["m"] and out["reference"] == whole["reference"]
    with pytest.raises(KeyboardInterrupt):
        quality.evaluate(chunks, {"m": InterruptedAt(table, at=0)}, progress=False)
