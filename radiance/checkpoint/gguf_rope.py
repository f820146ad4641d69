"""A GGUF's rotary scaling read into the config.json form (`rope_parameters`): `{arch}.rope.scaling.*` metadata, Llama
3's per-frequency divisors (the `rope_freqs` tensor) recognized as its llama3 scaling, and Phi-3's LongRoPE factor
sets (`rope_factors_short` / `rope_factors_long` tensors)."""

from __future__ import annotations

import math

import numpy as np
import torch

from radiance.errors import CheckpointError

ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x: its rope scaling as per-frequency divisors, read into the config
# Phi-3.5 / Phi-4-mini / the 128k Phi-3s: LongRoPE's two sets of per-frequency divisors, read into the config
LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}


def llama3_rope_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Llama 3's rope scaling (factor, low/high_freq_factor, original_max_position_embeddings) that divides
    the default frequencies by `divisors`, as llama.cpp's converter wrote them to rope_freqs; None when they
    are all 1. Frequencies depend on the scaling only through the band edges, so a band without inner
    points is placed between its neighbours. Raises ValueError for divisors no such scaling gives."""
    from radiance.layers.rotary import rope_inv_freq

    divisors = divisors.astype(np.float64)
    if len(divisors) != head_dim // 2:
        raise ValueError(f"{len(divisors)} rope factors for head_dim {head_dim} (want {head_dim // 2})")
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(divisors.max())
    kept, slowed = divisors <= 1 + 1e-6, divisors >= factor * (1 - 1e-6)
    band = ~kept & ~slowed
    if band.sum() >= 2:  # inside the band 1/divisor blends 1/factor and 1: smooth = old_len/wavelen*k - low*k
        smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
        slope, offset = np.linalg.lstsq(np.stack([1 / wavelen[band], -np.ones(band.sum())], 1), smooth, rcond=None)[0]
        low_wavelen, high_wavelen = slope / offset, slope / (1 + offset)
    elif kept.any() and slowed.any() and not band.any():
        edge = math.sqrt(wavelen[kept].max() * wavelen[slowed].min())
        high_wavelen, low_wavelen = math.sqrt(wavelen[kept].max() * edge), math.sqrt(edge * wavelen[slowed].min())
    else:
        raise ValueError("the factors do not rise from 1 to one maximum")
    def nearly_whole(x: float) -> float:  # 8191.9999 as fitted: 8192, as the model's config.json said
        return float(round(x)) if abs(x - round(x)) < 1e-5 * x else float(x)

    # with low_freq_factor 1, original_max_position_embeddings is the band's long edge
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": nearly_whole(low_wavelen / high_wavelen),
               "original_max_position_embeddings": nearly_whole(low_wavelen)}
    want = rope_inv_freq(head_dim, theta, None).double() / torch.from_numpy(divisors)
    got = rope_inv_freq(head_dim, theta, scaling).double()
    if not (low_wavelen > high_wavelen > 0) or not torch.allclose(got, want, rtol=1e-4, atol=0):
        raise ValueError("they are not Llama 3 rope scaling")
    return scaling


class GgufRope:
    """GgufCheckpoint's rope reading (its metadata fields, tensors and dequantization)."""

    def _rope_parameters(self, theta: float, head_dim: int) -> dict:
        """rope_parameters (transformers 5's form) from {arch}.rope.scaling.* or a Llama 3 rope_freqs tensor.
        A type radiance lacks (longrope, ...) is passed on for the model config to refuse in one line."""
        a = self.arch
        kind = str(self._field(f"{a}.rope.scaling.type", "none"))
        if any(name in self.tensors for name in LONGROPE_FACTORS.values()):
            return self._longrope_parameters(theta)
        if ROPE_FREQS in self.tensors:
            if kind != "none":
                raise CheckpointError(f"both {ROPE_FREQS} and {a}.rope.scaling.type {kind} scale the rope",
                                      file=self.file.path, tensor=ROPE_FREQS)
            try:
                scaling = llama3_rope_scaling(self._dequantize(ROPE_FREQS, unpermute=False).numpy().ravel(),
                                              head_dim, theta)
            except ValueError as exc:
                raise CheckpointError(f"{ROPE_FREQS} holds rope factors radiance cannot apply: {exc}",
                                      file=self.file.path, tensor=ROPE_FREQS) from None
            return {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
        factor = self._field(f"{a}.rope.scaling.factor")
        if kind == "none" and self._field(f"{a}.rope.scale_linear", 1.0) != 1.0:  # the key of older files
            kind, factor = "linear", self._field(f"{a}.rope.scale_linear")
        if kind == "none":
            return {"rope_type": "default", "rope_theta": theta}
        attn_factor = self._field(f"{a}.rope.scaling.attn_factor", 1.0)
        if attn_factor != 1.0:  # llama.cpp's multiplier on yarn's own attention factor: not read here
            raise CheckpointError(f"GGUF metadata {a}.rope.scaling.attn_factor {attn_factor} is not supported",
                                  file=self.file.path)
        params = {"rope_type": kind, "rope_theta": theta, "factor": factor,
                  "original_max_position_embeddings": self._field(f"{a}.rope.scaling.original_context_length"),
                  "beta_fast": self._field(f"{a}.rope.scaling.yarn_beta_fast"),
                  "beta_slow": self._field(f"{a}.rope.scaling.yarn_beta_slow"),
                  # the converter's copy of config.json's attention_factor (YaRN's own default when absent)
                  "attention_factor": self._field(f"{a}.rope.scaling.yarn_attn_factor")}
        return {key: value for key, value in params.items() if value is not None}

    def _longrope_parameters(self, theta: float) -> dict:
        """LongRoPE as llama.cpp's converter writes it: no scaling type, the factor sets as tensors, the attention
        factor it computed (sqrt(1 + ln(scale) / ln(original))) as rope.scaling.attn_factor."""
        params = {"rope_type": "longrope", "rope_theta": theta}
        for key, name in LONGROPE_FACTORS.items():
            if name not in self.tensors:
                other = next(n for n in LONGROPE_FACTORS.values() if n != name)
                raise CheckpointError(f"GGUF file has {other} but not {name}: LongRoPE needs both factor sets",
                                      file=self.file.path)
            params[key] = [float(v) for v in self._dequantize(name, unpermute=False).numpy().ravel()]
        attn_factor = self._field(f"{self.arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            params["attention_factor"] = float(attn_factor)
        return params
