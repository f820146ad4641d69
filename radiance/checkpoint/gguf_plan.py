"""Which GGUF tensors become which of the in-memory checkpoint's entries (GgufCheckpoint's plan): each tensor by its
transformers name (gguf_arch), a merged linear's parts gathered under its canonical name (names), a sparse MLP's
stacked experts one linear per expert, a tensor llama.cpp stored transformed read back through its inverse
(GgufArch.derived), the multi-token-prediction blocks past the layers left out; and every part of a merged linear
checked present."""

from __future__ import annotations

import logging
import re

from radiance.checkpoint.gguf_arch import ARCHITECTURES, DerivedTensor, hf_name, missing_part, ref_name
from radiance.checkpoint.gguf_rope import LONGROPE_FACTORS, ROPE_FREQS
from radiance.checkpoint.names import canonical_linear, canonical_tensor, sort_key
from radiance.errors import CheckpointError

logger = logging.getLogger(__name__)

# a sparse MLP's experts stacked in one tensor per projection (llama.cpp's Mixtral, Qwen-MoE files), or, in files
# converted before 2024-04, one tensor per expert
_STACKED_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")
# canonical names of plain tensors (norms, embeddings, biases, gpt-oss's sinks); the others name linears
PLAIN_LEAVES = (".weight", ".bias", ".sinks", ".e_score_correction_bias", ".dt_bias", ".A_log")


class GgufPlan:
    """The plan of a GgufCheckpoint (which has `tensors`, `arch`, `config` and `path`)."""

    def _plan(self) -> dict[str, dict[int, str | tuple[str, int]]]:
        """canonical name -> {partition index: gguf tensor name, or (name, expert) for one expert of a stacked
        tensor}."""
        groups: dict[str, dict[int, str | tuple[str, int]]] = {}
        # GLM-4.5's multi-token-prediction blocks, which block_count counts: not read (elsewhere a block past the
        # layers is a tensor the model does not use, which the servability check reports)
        layers = self.config.get("num_hidden_layers") if self.config.get("num_nextn_predict_layers") else None
        past = []
        for name in self.tensors:
            block = _BLOCK_INDEX.match(name)
            if block and layers is not None and int(block.group(1)) >= layers:
                past.append(name)
                continue
            target = hf_name(name, self.arch)
            if (name == ROPE_FREQS or name in LONGROPE_FACTORS.values()) and self.arch in ARCHITECTURES:
                continue  # read into the config's rope scaling
            stacked = _STACKED_EXPERTS.match(name)
            if stacked and self.arch in ARCHITECTURES:  # [experts, rows, cols]: one linear per expert
                layer, proj, leaf = stacked.group(1), f"{stacked.group(2)}_proj", stacked.group(3)
                for expert in range(int(self.tensors[name].shape[-1])):
                    canonical, index = canonical_linear(f"model.layers.{layer}.mlp.experts.{expert}.{proj}")
                    canonical += ".bias" if leaf == "bias" else ""
                    groups.setdefault(canonical, {})[index] = (name, expert)
                continue
            single = _EXPERT.match(name)
            if single and self.arch in ARCHITECTURES:
                layer, proj, expert = single.groups()
                canonical, index = canonical_linear(f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj")
                groups.setdefault(canonical, {})[index] = name
                continue
            derived = self._derived(name)
            if derived:  # stored transformed (Qwen3.5's A_log as -exp, ...): read back through the inverse
                for hf_block, transform in derived:
                    canonical, index = canonical_tensor(f"model.layers.{block.group(1)}.{hf_block}")
                    groups.setdefault(canonical, {})[index] = DerivedTensor(name, transform)
                continue
            if target is None:  # kept under its GGUF name: the servability check reports it unused
                groups.setdefault(name, {})[0] = name
                continue
            canonical, index = canonical_tensor(target)
            groups.setdefault(canonical, {})[index] = name
        if past:
            logger.info("%d tensors of the blocks past the model's %d layers (a multi-token-prediction module, which "
                        "radiance does not run) not read, e.g. %s", len(past), layers, past[0])
        self._check_partitions(groups)
        return dict(sorted(groups.items(), key=lambda kv: sort_key(kv[0])))

    def _derived(self, name: str) -> list | None:
        """The HF tensors a block tensor of this architecture becomes through a value transform, or None."""
        known = ARCHITECTURES.get(self.arch)
        if known is None or known.derived is None or not name.startswith("blk."):
            return None
        return known.derived(name.split(".", 2)[2], self.config)

    def _check_partitions(self, groups: dict[str, dict]) -> None:
        """Every part of a merged linear is in the file: a missing attn_k made q and v a qkv_proj of the wrong
        shape, reported under that merged name (and `inspect` called the file servable)."""
        for canonical, parts in groups.items():
            if canonical.endswith(".bias"):  # a merged linear's biases: one per part too
                module, leaf = canonical[:-len(".bias")], ".bias"
            elif canonical.endswith(PLAIN_LEAVES):  # norms, embeddings, sinks
                continue
            else:
                module, leaf = canonical, ".weight"
            missing = missing_part(module, leaf, set(parts), ref_name(next(iter(parts.values()))), self.arch)
            if missing is not None:
                hf, gguf_tensor, needed = missing
                raise CheckpointError(f"tensor missing from the GGUF file ({hf} in transformers' names): the model's "
                                      f"{module.rpartition('.')[2]} needs all of {needed}", file=self.path,
                                      tensor=gguf_tensor)
