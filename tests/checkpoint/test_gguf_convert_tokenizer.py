"""`radiance convert` of a GGUF without tokenizer metadata converts weights-only with a warning (as an HF directory
without tokenizer files does); broken tokenizer metadata fails before any tensor is read."""

import logging

import pytest

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.gguf_reader import GgufCheckpoint
from radiance.checkpoint.servable import check_servable
from radiance.config import ConvertConfig
from radiance.errors import CheckpointError
from tests.checkpoint.test_gguf_chat_templates import spm_tokenizer
from tests.checkpoint.test_gguf_metadata import write_gguf


def test_a_gguf_without_tokenizer_converts_weights_only_with_a_warning(tmp_path, caplog):
    """Was: a CheckpointError from the tokenizer after every tensor had been read and converted."""
    src = open_checkpoint(write_gguf(tmp_path / "m.gguf"))
    with caplog.at_level(logging.WARNING):
        convert_checkpoint(src, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    assert "has no tokenizer metadata" in caplog.text
    out = open_checkpoint(str(tmp_path / "out"))
    check_servable(out)
    with pytest.raises(CheckpointError):
        out.tokenizer()


def test_broken_tokenizer_metadata_fails_before_any_tensor_is_read(tmp_path, monkeypatch):
    src = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=spm_tokenizer(**{"tokenizer.ggml.model": "rwkv"})))
    monkeypatch.setattr(GgufCheckpoint, "iter_weights", lambda *a, **k: pytest.fail("read tensors first"))
    with pytest.raises(CheckpointError, match="cannot build the tokenizer"):
        convert_checkpoint(src, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    assert not (tmp_path / "out").exists()
