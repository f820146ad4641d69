"""`radiance eval ppl|kl`: perplexity of a model and KL(ref || model) of its next-token
distributions, where the reference is the same model on the same stack with quantization none.

Text is tokenized once and cut into `chunks` non-overlapping windows of `chunk_len` tokens; every
model sees exactly the same windows. Position t of a window predicts token t+1, so a window
contributes chunk_len - 1 scored positions, for perplexity and KL alike. Several quantized
variants can be compared against one reference pass (`evaluate`), each scored on the same chunks.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from radiance.bench import metrics
from radiance.config import LM_HEAD_FORMATS, CacheConfig, KernelConfig, ModelConfig
from radiance.errors import ConfigError
from radiance.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


class LogitsModel(Protocol):
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # [B, T] -> [B, T, V]


# variant suffixes that quantize the lm_head, and the ModelConfig.lm_head_format each one means
HEAD_SUFFIXES = {"+head": "mxfp4", "+head2": "mxfp4x2"}
KV_SUFFIX = "+fp8kv"  # K/V rounded as an fp8 KV cache stores them (CacheConfig.kv_cache_dtype fp8)


def split_suffixes(spec: str) -> tuple[str, str | None, str]:
    """'mxfp4+head2+fp8kv' -> ('mxfp4', 'mxfp4x2', 'fp8'): the quantization, the lm_head format (None: 16-bit)
    and the KV cache dtype ('auto' without the suffix)."""
    kv = "fp8" if spec.endswith(KV_SUFFIX) else "auto"
    spec = spec.removesuffix(KV_SUFFIX)
    for suffix, fmt in HEAD_SUFFIXES.items():
        if spec.endswith(suffix):
            return spec.removesuffix(suffix), fmt, kv
    return spec, None, kv


@dataclass(frozen=True)
class Variant:
    """One way to serve the model: the knobs that change numerics."""

    quantization: str = "none"  # none | mxfp4 | nvfp4
    rule: str = "mse"  # mse | noclip | ocp; "none" with nvfp4 = serve NVFP4 dequantized (W4A16)
    activations: str = "fp8"  # fp8 = W4A8, bf16 = W4A16 (16-bit activations)
    lm_head: str | None = None  # the lm_head quantized too, in this LM_HEAD_FORMATS format (spec suffix "+head"
    # = mxfp4, "+head2" = mxfp4x2: HEAD_SUFFIXES); None = 16-bit
    kv_cache: str = "auto"  # "fp8" (spec suffix "+fp8kv"): attention reads K/V as an fp8 cache holds them

    def __post_init__(self):
        if self.quantization not in ("none", "mxfp4", "nvfp4"):  # ModelConfig takes "auto" too: not a variant
            raise ConfigError(f"quantization must be none, mxfp4 or nvfp4, got {self.quantization!r}")
        if self.lm_head is not None and self.lm_head not in LM_HEAD_FORMATS:  # ModelConfig has no None
            raise ConfigError(f"lm_head must be one of {LM_HEAD_FORMATS} or None, got {self.lm_head!r}")
        # the rest is what serving it would refuse: the configs' own checks, run once here
        self.model_config(model=None, device=None, dtype=None)
        self.kernel_config()
        CacheConfig(kv_cache_dtype=self.kv_cache)

    def model_config(self, model: str | None, device: str | None, dtype: str | None) -> ModelConfig:
        return ModelConfig(model=model, quantization=self.quantization, rule=self.rule,
                           quantize_lm_head=self.lm_head is not None, lm_head_format=self.lm_head or "mxfp4",
                           device=device, dtype=dtype)

    def kernel_config(self) -> KernelConfig:
        return KernelConfig(activations=self.activations)

    @property
    def changes_numerics(self) -> bool:
        """Whether it differs from the 16-bit model served with a 16-bit cache (the KL reference)."""
        return self.quantization != "none" or self.kv_cache != "auto"

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """'mxfp4', 'mxfp4/ocp', 'nvfp4/mse/bf16', 'nvfp4/none', 'mxfp4/mse/fp8+head', 'none+fp8kv',
        'mxfp4/mse/fp8+head2+fp8kv' -> Variant."""
        body, head, kv = split_suffixes(spec)
        parts = body.split("/")
        if not 1 <= len(parts) <= 3:
            raise ConfigError(f"variant {spec!r}: expected QUANT[/RULE[/ACTIVATIONS]][+head|+head2][{KV_SUFFIX}]")
        try:
            variant = cls(*parts, lm_head=head, kv_cache=kv)
        except ConfigError as exc:
            raise ConfigError(f"variant {spec!r}: {exc}") from None
        unused = variant.unused_parts(rule_given=len(parts) > 1, activations_given=len(parts) > 2)
        if unused:  # was dropped without a word: 'none/ocp' evaluated the 16-bit model
            raise ConfigError(f"variant {spec!r}: {unused}")
        return variant

    def applied(self) -> dict:
        """The knobs as --json reports them: None for a part this variant does not use (unused_parts), not the
        default it was never served with (the 16-bit model's "mse" rule and "fp8" activations)."""
        out = asdict(self)
        if self.unused_parts(rule_given=True, activations_given=False):
            out["rule"] = None
        if self.unused_parts(rule_given=False, activations_given=True):
            out["activations"] = None
        return out

    def label_in(self, dtype: str | None, stored: dict[str, str] | None = None) -> str:
        """The label of what was served: the unquantized model named by the dtype it ran in (a CPU runs it in
        float32, not 16-bit), and the weights by what the checkpoint stored (`stored`: stored_linear_formats; None
        or all 16-bit: `label`). A pre-quantized checkpoint's linears are dequantized, or served as stored, or
        requantized from their format: "float32 (dequantized mxfp4)", "mxfp4 as stored W4A8" (no rule applied),
        "nvfp4->mxfp4 mse W4A8"; each was labelled as if quantized from 16 bit."""
        weights = self._served_weights_label(stored or {})
        if self.quantization == "none" and dtype:
            weights = dtype + weights.removeprefix("16-bit")
        return weights + self._suffixes

    def unused_parts(self, rule_given: bool, activations_given: bool) -> str | None:
        """Why a rule or activations given would change nothing, or None."""
        if self.quantization == "none" and (rule_given or activations_given):
            return "the 16-bit model (none) has no block-exponent rule or 4-bit activations to pick"
        if self.rule == "none" and activations_given and self.activations == "fp8":
            return "NVFP4 served as W4A16 (rule none) keeps 16-bit activations, not fp8"
        return None

    @property
    def label(self) -> str:
        """The label of this variant of a 16-bit checkpoint (run_eval's key; label_in is what a row shows)."""
        return self._weights_label + self._suffixes

    @property
    def _suffixes(self) -> str:
        return ({None: "", "mxfp4": " +4-bit head", "mxfp4x2": " +2x4-bit head"}[self.lm_head]
                + (" +fp8 KV" if self.kv_cache == "fp8" else ""))

    @property
    def _scheme(self) -> str:
        return "W4A8" if self.activations == "fp8" else "W4A16"

    @property
    def _weights_label(self) -> str:
        if self.quantization == "none":
            return "16-bit"
        if self.quantization == "nvfp4" and self.rule == "none":
            return "nvfp4 as W4A16"
        source = "mxfp4" if self.quantization == "mxfp4" else "nvfp4->mxfp4"
        return f"{source} {self.rule} {self._scheme}"

    def _served_weights_label(self, stored: dict[str, str]) -> str:
        """_weights_label for linears stored in these formats (engine.linears.build_linear decides how each is
        served): MXFP4 ones are served as stored, NVFP4 / FP8 ones requantized from theirs (or, as W4A16, dequantized
        unless NVFP4), GGUF's quantized types from their values, as 16-bit weights are."""
        formats = set(stored.values())
        if self.lm_head is not None and "lm_head" not in stored:  # a 16-bit (or tied) head, quantized at load
            formats.add(SIXTEEN_BIT)
        quantized = sorted(formats - {SIXTEEN_BIT})
        if not quantized:
            return self._weights_label
        if self.quantization == "none":
            return f"16-bit (dequantized {', '.join(quantized)})"
        values_path = "nvfp4" if self.quantization == "nvfp4" else None  # what 16-bit values are quantized to first
        if self.rule == "none":  # NVFP4 values of 16-bit (and GGUF) weights served 16-bit; any other format dequantized
            via = [f for f in quantized if f not in HF_QUANTIZED]
            dequantized = [f for f in quantized if f in HF_QUANTIZED and f != "nvfp4"]
            notes = ([f"from {', '.join(via)}"] if via else []) + \
                ([f"dequantized {', '.join(dequantized)}"] if dequantized else [])
            return self._weights_label + (f" ({'; '.join(notes)})" if notes else "")
        sources = set()
        for fmt in formats:
            if fmt == SIXTEEN_BIT:
                sources.add("mxfp4" if values_path is None else f"{values_path}->mxfp4")
            elif fmt in HF_QUANTIZED:
                if fmt != "mxfp4":  # MXFP4 linears are served as stored: no rule applied to them
                    sources.add(f"{fmt}->mxfp4")
            else:  # a GGUF type: its values, quantized like 16-bit ones
                sources.add("->".join([fmt, *([values_path] if values_path else []), "mxfp4"]))
        if not sources:
            return f"mxfp4 as stored {self._scheme}"
        return f"{'+'.join(sorted(sources))} {self.rule} {self._scheme}"


# --------------------------------------------------------------------------- text


def check_chunking(chunks: int, chunk_len: int, first: int = 0) -> None:
    if chunk_len < 2:
        raise ConfigError("chunk_len must be at least 2 (one token predicts the next)")
    if chunks < 1 or first < 0:
        raise ConfigError("chunks must be positive and first_chunk non-negative")


def check_chunk_fits(chunk_len: int, context_length: int | None) -> None:
    if context_length is not None and chunk_len > context_length:
        raise ConfigError(f"chunk_len {chunk_len} exceeds the model's context of {context_length} tokens")


def check_context(model: LogitsModel, chunk_len: int) -> None:
    """A chunk must fit the model's positions: past its context (ArchConfig.context_length) there are no rotary
    angles (an IndexError on the CPU, out-of-bounds reads on CUDA). The rotary tables are sized to one chunk, each
    chunk being one forward: LongRoPE then picks its factors by the chunk's length, as transformers does per
    forward (the short ones for chunks within the pretraining context; the model's whole context took the long)."""
    check_chunk_fits(chunk_len, getattr(getattr(model, "config", None), "context_length", None))
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        if isinstance(module, RotaryEmbedding):  # built for the first EAGER_TABLE_POSITIONS positions only
            module.serve_context(chunk_len)


def chunk_token_ids(token_ids: list[int] | torch.Tensor, chunks: int, chunk_len: int, first: int = 0) -> torch.Tensor:
    """[chunks, chunk_len] non-overlapping windows, starting at window `first` of the token stream
    (so a long evaluation can be split into slices); fewer chunks when the text is short."""
    check_chunking(chunks, chunk_len, first)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    available = ids.numel() // chunk_len - first
    if available <= 0:
        raise ConfigError(f"the text has {ids.numel()} tokens, fewer than {first + 1} chunk(s) of {chunk_len}: give a "
                          "longer text, or fewer tokens per chunk (chunk_len) or chunks to skip (first_chunk)")
    if available < chunks:
        logger.warning("text holds only %d chunks of %d tokens from chunk %d (asked for %d)",
                       available, chunk_len, first, chunks)
    n = min(chunks, available)
    return ids[first * chunk_len: (first + n) * chunk_len].reshape(n, chunk_len)


def read_text(path: str) -> str:
    """The text file's content; a missing, empty or non-UTF-8 file is one error line, found before any model loads."""
    file = Path(path)
    if file.is_dir():  # "not found" would send the user looking for a file that is there
        raise ConfigError(f"text file {path} is a directory, expected a UTF-8 text file")
    if not file.is_file():
        raise ConfigError(f"text file not found: {path}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"text file {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise ConfigError(f"text file {path} is empty")
    return text


# tokens at the end of a cut-off prefix that can differ from the whole text's (the cut splits a word)
_CUT_TOKENS = 8


def tokenize_text(tokenizer, text: str, tokens_needed: int) -> list[int]:
    """Token ids of the text; only a prefix long enough for `tokens_needed` is tokenized. The prefix's last
    tokens are never among those needed: where the prefix ends inside a word they are not the text's tokens."""
    if tokenizer is None:
        raise ConfigError("this model has no tokenizer (synthetic models cannot be evaluated on text)")
    take = tokens_needed * 8  # chars per token is below 8 for any natural text and BPE vocabulary
    while True:
        ids = tokenizer(text[:take], add_special_tokens=False)["input_ids"]
        if take >= len(text):
            return ids
        if len(ids) >= tokens_needed + _CUT_TOKENS:
            return ids[:len(ids) - _CUT_TOKENS]
        take *= 2


# --------------------------------------------------------------------------- scoring


@dataclass
class _Accumulator:
    nll: float = 0.0
    tokens: int = 0
    kl_values: list[torch.Tensor] | None = None
    top1: float = 0.0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor | None) -> None:
        self.nll += metrics.token_nll(logits, targets).sum().item()
        self.tokens += targets.numel()
        if ref_logits is not None:
            if self.kl_values is None:
                self.kl_values = []
            self.kl_values.append(metrics.kl_divergence(ref_logits, logits).reshape(-1).float())
            self.top1 += metrics.top1_agreement(ref_logits, logits).sum().item()

    def result(self) -> dict:
        out = {"ppl": metrics.perplexity(self.nll, self.tokens), "nll": self.nll / self.tokens, "tokens": self.tokens}
        if self.kl_values is not None:
            kl = torch.cat(self.kl_values).double()
            out.update(kl=kl.mean().item(), kl_p99=torch.quantile(kl, 0.99).item() if kl.numel() <= 16_000_000 else math.nan,
                       kl_max=kl.max().item(), top1_agreement=self.top1 / self.tokens)
        return out


def _scored_logits(model: LogitsModel, window: torch.Tensor, device) -> torch.Tensor:
    with torch.inference_mode():
        logits = model.forward_logits(window.to(device).unsqueeze(0))
    return logits[0, :-1].float().cpu()  # the last position has no target in the window


def evaluate(chunks: torch.Tensor, models: dict[str, LogitsModel], reference: LogitsModel | None = None,
             device=None, progress: bool = True) -> dict:
    """Score every model on every chunk. With a reference, also KL(ref || model) and top-1 agreement;
    the reference's own perplexity is reported under key "reference". Returns {name: metrics}."""
    accs = {name: _Accumulator() for name in models}
    ref_acc = _Accumulator() if reference is not None else None
    bar = tqdm(chunks, desc="eval", unit="chunk", disable=not progress, leave=False)
    scored = 0
    try:
        for window in bar:
            targets = window[1:]
            # every model's logits of the chunk first, then the sums: a Ctrl-C leaves whole chunks counted
            ref_logits = _scored_logits(reference, window, device) if reference is not None else None
            logits = {name: _scored_logits(model, window, device) for name, model in models.items()}
            if ref_acc is not None:
                ref_acc.add(ref_logits, targets, None)
            for name, acc in accs.items():
                acc.add(logits[name], targets, ref_logits)
            scored += 1
            # running numbers of the first model, so a long run shows where it is heading
            first = next(iter(accs.values()))
            bar.set_postfix(ppl=f"{metrics.perplexity(first.nll, first.tokens):.3f}",
                            **({"kl": f"{torch.cat(first.kl_values).double().mean().item():.4f}"}
                               if first.kl_values else {}))
    except KeyboardInterrupt:
        if not scored:
            raise
        bar.close()
        return {**_results(accs, ref_acc), "interrupted_after": scored}
    return _results(accs, ref_acc)


def _results(accs: dict[str, _Accumulator], ref_acc: _Accumulator | None) -> dict:
    out = {name: acc.result() for name, acc in accs.items()}
    if ref_acc is not None:
        out["reference"] = ref_acc.result()
    return out


@dataclass(frozen=True)
class EvalRequest:
    mode: str  # "ppl" or "kl"
    model: str | None
    variants: tuple[Variant, ...]
    text: str
    chunks: int = 64
    chunk_len: int = 512
    device: str | None = None
    dtype: str | None = None
    first_chunk: int = 0


def run_eval(req: EvalRequest, loader, progress: bool = True, tokenizer_loader=None, context_of=None) -> dict:
    """Load the reference (for kl) and every variant with `loader(model, variant, device, dtype)`,
    which returns (model with forward_logits, tokenizer), then score them on the same chunks. With
    `tokenizer_loader(model, device)` the text is tokenized and chunked before any model loads, so a text too short
    for the chunks asked is an error in seconds, not after minutes of loading and quantizing; with
    `context_of(model)` (the model's context in tokens, from its config) so is a chunk longer than the context."""
    if req.mode not in ("ppl", "kl"):
        raise ConfigError(f"eval mode must be ppl or kl, got {req.mode!r}")
    if not req.variants or len({v.label for v in req.variants}) != len(req.variants):
        raise ConfigError("give at least one variant, each once")
    if req.mode == "kl" and not all(v.changes_numerics for v in req.variants):
        raise ConfigError("KL of the 16-bit model against itself is 0 by construction; pick a quantization "
                          f"(or {KV_SUFFIX})")
    # the request's own mistakes before any model loads (a large one takes minutes, kl loads two)
    check_chunking(req.chunks, req.chunk_len, req.first_chunk)
    text = read_text(req.text)
    start = time.perf_counter()
    chunks = None
    if tokenizer_loader is not None:  # (it refuses a bad --device and a synthetic model first)
        chunks = _chunked(tokenizer_loader(req.model, req.device), text, req)
    if context_of is not None:
        check_chunk_fits(req.chunk_len, context_of(req.model))
    models, tokenizer = {}, None
    reference = None
    if req.mode == "kl":
        reference, tokenizer = loader(req.model, Variant("none"), req.device, req.dtype)
        check_context(reference, req.chunk_len)
    for variant in req.variants:
        models[variant.label], tok = loader(req.model, variant, req.device, req.dtype)
        check_context(models[variant.label], req.chunk_len)
        tokenizer = tokenizer or tok
    if chunks is None:
        chunks = _chunked(tokenizer, text, req)
    loaded = [reference, *models.values()]
    device = next(_model_device(m) for m in loaded if m is not None)
    dtype = next((d for d in map(_model_dtype, loaded) if d is not None), None)
    scores = evaluate(chunks, models, reference, device=device, progress=progress)
    results = []
    for variant in req.variants:
        stored = getattr(models[variant.label], "stored_formats", None)  # loading.load_eval_model's
        row = {**variant.applied(), "label": variant.label_in(dtype, stored), **scores[variant.label]}
        results.append(row)
    scored = scores.get("interrupted_after", int(chunks.shape[0]))  # Ctrl-C: the whole chunks scored before it
    out = {"mode": req.mode, "model": req.model or "embedded SmolLM2", "text": req.text,
           "chunks": scored, "first_chunk": req.first_chunk, "chunk_len": req.chunk_len, "tokens": results[0]["tokens"],
           "dtype": dtype, "device": str(device), "seconds": time.perf_counter() - start, "results": results}
    if "reference" in scores:
        out["reference_ppl"] = scores["reference"]["ppl"]
        # the reference is the checkpoint served unquantized: a 4-bit one's values dequantized, not a 16-bit model
        out["reference_label"] = Variant("none").label_in(dtype, getattr(reference, "stored_formats", None))
    if "interrupted_after" in scores:
        out["interrupted"] = True
    # the first variant's numbers at the top level: `--json | jq .ppl` works for the single case
    out.update({k: results[0][k] for k in ("ppl", "kl", "kl_p99", "top1_agreement") if k in results[0]})
    return out


def _chunked(tokenizer, text: str, req: EvalRequest) -> torch.Tensor:
    ids = tokenize_text(tokenizer, text, (req.first_chunk + req.chunks) * req.chunk_len)
    return chunk_token_ids(ids, req.chunks, req.chunk_len, req.first_chunk)


SIXTEEN_BIT = "16-bit"
HF_QUANTIZED = ("mxfp4", "nvfp4", "fp8")  # linear formats a quantized HF checkpoint stores (and MXFP4 GGUF tensors)
_GGUF_16BIT = ("F32", "F16", "BF16")


def stored_linear_formats(checkpoint) -> dict[str, str]:
    """{linear: its stored format} for the linears the loader builds from `checkpoint` (its describe(): no tensor
    data read): "mxfp4", "nvfp4" or "fp8"; a GGUF's quantized type ("Q4_1", types joined by "/" where a merged
    linear's parts differ); "16-bit" for the rest. A 16-bit lm_head is not among them (it is a plain tensor)."""
    out = {}
    for entry in checkpoint.describe():
        if not entry.is_linear:
            continue
        if entry.format in HF_QUANTIZED:
            out[entry.name] = entry.format
            continue
        types = [t for t in entry.source_format.split("/") if t and t not in _GGUF_16BIT]
        out[entry.name] = "/".join(types) if types else SIXTEEN_BIT
    return out


def _model_dtype(model) -> str | None:
    """The dtype the 16-bit parts ran in ("float32" on a CPU by default), read off the loaded model."""
    sizes = {}  # most of the 16-bit elements: the embedding's and norms' dtype, not a float32 scale's
    for p in model.parameters() if isinstance(model, torch.nn.Module) else ():
        if p.dtype in (torch.float32, torch.float16, torch.bfloat16):
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return str(max(sizes, key=sizes.get)).removeprefix("torch.") if sizes else None


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")
