"""The raw bytes of a token, for the `bytes` of OpenAI's logprobs.

A token holding part of a multi-byte character decodes alone to U+FFFD; its `bytes` must be its own bytes (so a
client can join them back into the character), not those of U+FFFD. The vocabulary's piece says them: a byte-level
BPE (GPT-2, Llama 3, Qwen, SmolLM) spells each byte as one printable character, a SentencePiece vocabulary with byte
fallback holds `<0xE6>` pieces and spells spaces as U+2581. Other tokenizers (or special tokens) fall back to the
UTF-8 of the decoded text.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character of each byte (the alphabet tokenizers' ByteLevel uses), inverted."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_SCHEMES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _scheme(tokenizer: Any) -> str:
    """"byte_level", "byte_fallback", "metaspace" or "text", from the tokenizer's decoder (a tokenizers one)."""
    try:
        return _SCHEMES[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - not a tokenizers-backed tokenizer (a test's fake, a slow tokenizer)
        decoder = {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    scheme = ("byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds
              else "metaspace" if kinds & {"Metaspace", "Replace"} else "text")
    try:
        _SCHEMES[tokenizer] = scheme
    except TypeError:  # not weak-referenceable: worked out again next time
        pass
    return scheme


def token_bytes(tokenizer: Any, token_ids: list[int], texts: dict[int, str]) -> dict[int, list[int]]:
    """{token id: its raw bytes} for `token_ids`; `texts`: their decoded texts (the fallback)."""
    scheme = _scheme(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    pieces = (tokenizer.convert_ids_to_tokens(list(token_ids)) if scheme != "text" else [None] * len(token_ids))
    out = {}
    for tid, piece in zip(token_ids, pieces):
        raw = None if piece is None or tid in special else _piece_bytes(scheme, piece)
        out[tid] = list(raw if raw is not None else texts[tid].encode("utf-8"))
    return out


def _piece_bytes(scheme: str, piece: str) -> bytes | None:
    if scheme == "byte_level":
        if all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return None  # an added token written as plain text
    match = _BYTE_PIECE.fullmatch(piece)
    if match and scheme == "byte_fallback":
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
