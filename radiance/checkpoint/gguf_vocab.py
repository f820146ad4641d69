"""The vocabulary side of a GGUF checkpoint: its tokenizer (transformers' GGUF support), chat templates and the
ids that end generation, with the checks a broken conversion needs (ids beyond the token list, no end of a chat
turn declared). A mixin of GgufCheckpoint, which provides `file`, `path`, `config`, `warnings`, `_tokenizer` and
`_field`.
"""

from __future__ import annotations

import logging
import os

from radiance.errors import CheckpointError

logger = logging.getLogger(__name__)

# Tokens that end generation, by their text, for files whose metadata names no end of a chat turn (older
# conversions of Llama 3 Instruct declare <|end_of_text|> only, Qwen base models <|endoftext|>): llama.cpp
# guesses them the same way (llama-vocab.cpp, its end-of-generation list).
_TURN_END_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>"})
_END_TEXTS = _TURN_END_TEXTS | {"<|endoftext|>", "<|end_of_text|>"}
# the special ids transformers' GGUF tokenizer reads (transformers.integrations.ggml)
_TOKENIZER_SPECIAL_IDS = tuple(f"tokenizer.ggml.{name}_token_id"
                               for name in ("bos", "eos", "unknown", "padding"))


def _guessed_end_warning(ids: list[int], tokens: list[str]) -> str:
    named = ", ".join(f"{tokens[i]} ({i})" for i in ids)
    return (f"GGUF metadata names no end-of-turn token: generation also ends at {named}, found by its text "
            "as llama.cpp does")


class GgufVocabulary:
    @property
    def has_tokenizer(self) -> bool:
        """Whether the file carries tokenizer metadata (llama.cpp writes it for every model; a weights-only
        file serves token-id prompts only)."""
        return "tokenizer.ggml.model" in self.file.metadata or "tokenizer.ggml.tokens" in self.file.metadata

    def tokenizer(self):
        if self._tokenizer is None:
            if not self.has_tokenizer:
                raise CheckpointError("the GGUF file holds no tokenizer: no tokenizer.ggml.* metadata",
                                      file=self.path)
            self._check_special_ids()
            self._check_token_lists()
            # the generic fast class, not AutoTokenizer: that one first builds a model config from the file
            # through gguf-py (~8 s for the embedded model) only to pick the class; transformers 5 picks this
            # one for GGUF files anyway
            from transformers import PreTrainedTokenizerFast
            try:
                self._tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(self.path),
                                                                          gguf_file=os.path.basename(self.path))
            except Exception as exc:
                raise CheckpointError(f"cannot build the tokenizer from GGUF metadata: {exc}", file=self.path) from None
            templates = self.chat_templates
            if set(templates) - {"default"}:
                # transformers reads the default only; named ones as it reads a tokenizer_config.json list:
                # {name: template}, apply_chat_template then takes tool_use when given tools, save_pretrained
                # writes them all (chat_template.jinja, additional_chat_templates/)
                self._tokenizer.chat_template = templates
            elif self._tokenizer.chat_template is None and templates:
                self._tokenizer.chat_template = templates["default"]
        return self._tokenizer

    def _check_special_ids(self) -> None:
        """transformers looks these ids up in the token list: one beyond it was its "list index out of range"."""
        tokens = self._field("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            return
        for key in _TOKENIZER_SPECIAL_IDS:
            value = self._field(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= len(tokens):
                raise CheckpointError(f"GGUF metadata {key} is {value}, beyond the {len(tokens)} tokens of "
                                      "tokenizer.ggml.tokens: the tokenizer cannot be built", file=self.path)

    def _check_token_lists(self) -> None:
        """The per-token lists must match tokenizer.ggml.tokens, and a BPE vocabulary needs its merges (llama.cpp
        refuses a gpt2 file without them; transformers built a tokenizer that split text into single bytes)."""
        tokens = self._field("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            return
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            values = self._field(key)
            if isinstance(values, list) and len(values) != len(tokens):
                raise CheckpointError(f"GGUF metadata {key} has {len(values)} entries for the {len(tokens)} tokens "
                                      "of tokenizer.ggml.tokens: the tokenizer cannot be built", file=self.path)
        if self._field("tokenizer.ggml.model") == "gpt2" and not self._field("tokenizer.ggml.merges"):
            raise CheckpointError("GGUF metadata tokenizer.ggml.merges is missing or empty: a gpt2 (BPE) tokenizer "
                                  "cannot be built without its merges", file=self.path)

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every chat template of the file by name: "default" (tokenizer.chat_template) and those llama.cpp's
        converter writes from a tokenizer_config.json list of {name, template} (tokenizer.chat_template.tool_use,
        ..., listed in tokenizer.chat_templates)."""
        prefix = "tokenizer.chat_template"
        for key, value in self.file.metadata.items():
            if key.startswith(prefix) and key != "tokenizer.chat_templates" and not isinstance(value, str):
                raise CheckpointError(f"GGUF metadata {key} must be a string (a jinja template), got "
                                      f"{type(value).__name__}", file=self.path)
        named = {key[len(prefix) + 1:]: value for key, value in self.file.metadata.items()
                 if key.startswith(prefix + ".") and value}
        default = self._field("tokenizer.chat_template")
        templates = {"default": default, **named} if default else named
        from radiance.server.chat_template import note_source

        for name, text in templates.items():  # a parse error, met when first rendered (generate, serve), names its key
            note_source(text, self._template_key_source(name))
        return templates

    def template_source(self, template: str) -> str:
        """Where `template` (one of chat_templates) was read from: "file PATH, metadata KEY"."""
        name = next((name for name, text in self.chat_templates.items() if text == template), "default")
        return self._template_key_source(name)

    def _template_key_source(self, name: str) -> str:
        return f"file {self.path}, metadata tokenizer.chat_template" + ("" if name == "default" else f".{name}")

    @property
    def chat_template(self) -> str | None:
        """The default template; a file with named ones only: the first, as the HF path takes from a list."""
        templates = self.chat_templates
        return templates.get("default") or next(iter(templates.values()), None)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

    def _end_of_generation_ids(self) -> list[int]:
        """The declared end ids, and where none of them ends a chat turn, the end tokens found by their text
        (a warning says which)."""
        declared = self._declared_end_ids()
        if self._ends_a_turn(declared):  # the usual file: no scan of the vocabulary at open
            return declared
        tokens = self._field("tokenizer.ggml.tokens")
        guessed = [i for i in self._end_ids_by_text() if i not in declared
                   and self._in_vocab(i, f"the end-of-generation token {tokens[i]} (found by its text)")]
        if guessed:
            self.warnings.append(_guessed_end_warning(guessed, tokens))
        return declared + guessed

    def _declared_end_ids(self) -> list[int]:
        # llama.cpp ends generation at any of them: eom is Llama 3.1's <|eom_id|> (after a built-in tool call)
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ids = []
        for key in keys:
            value = self._field(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise CheckpointError(f"GGUF metadata {key} is {value!r}, not a token id", file=self.file.path)
            if value is not None and self._in_vocab(value, f"GGUF metadata {key}"):
                ids.append(value)
        return list(dict.fromkeys(ids))

    def _in_vocab(self, token_id: int, what: str) -> bool:
        """Whether the model can produce `token_id`. An id beyond the vocabulary (a broken conversion) is dropped
        with a warning, not refused: llama.cpp loads such a file too, warning of a "bad special token"."""
        vocab = self.config.get("vocab_size")
        if vocab is None or token_id < vocab:
            return True
        message = (f"{what} is {token_id}, beyond the vocabulary of {vocab} tokens: ignored, as llama.cpp ignores "
                   f"it (file {self.file.path})")
        self.warnings.append(message)
        logger.warning(message)
        return False

    def _end_ids_by_text(self) -> list[int]:
        """Ids of the vocabulary's end-of-generation tokens (_END_TEXTS), in id order."""
        tokens = self._field("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            return []
        return [i for i, text in enumerate(tokens) if text in _END_TEXTS]

    def _ends_a_turn(self, ids: list[int]) -> bool:
        tokens = self._field("tokenizer.ggml.tokens") or []
        return any(0 <= i < len(tokens) and tokens[i] in _TURN_END_TEXTS for i in ids)
