"""radiance's GGUF header reader against gguf-py's own reader and writer, and on broken files."""

import os

import gguf
import numpy as np
import pytest

from radiance.checkpoint.gguf_file import GgufFile
from radiance.checkpoint.gguf_reader import embedded_model_path
from radiance.errors import CheckpointError


def _reference_metadata(reader: gguf.GGUFReader) -> dict:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _assert_same_as_gguf_py(path: str) -> GgufFile:
    ours, ref = GgufFile(path), gguf.GGUFReader(path)
    assert ours.metadata == _reference_metadata(ref)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.n_bytes == int(theirs.n_bytes)
        assert np.array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                              gguf.quants.dequantize(theirs.data, theirs.tensor_type))
    return ours


def test_every_value_type_and_tensor_type_as_gguf_py_writes_them(tmp_path):
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo wörld ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü" * 300])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("q41", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = _assert_same_as_gguf_py(path)
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.str"] == "héllo wörld ✓"
    assert ours.metadata["t.strs"] == ["a", "", "ü" * 300] and ours.metadata["t.bool"] is True
    q41 = ours.tensors[2]
    assert q41.shape == (64, 4) and q41.data.shape == (4, 40)  # 2 blocks of 20 bytes per row


def test_the_embedded_model_reads_as_gguf_py_reads_it():
    ours = _assert_same_as_gguf_py(embedded_model_path())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ours.tensors) == 272


def _truncated_copy(tmp_path, n_bytes: int) -> str:
    with open(embedded_model_path(), "rb") as f:
        head = f.read(n_bytes)
    path = tmp_path / "cut.gguf"
    path.write_bytes(head)
    return str(path)


def test_a_file_cut_inside_the_tensor_data_names_the_first_tensor_past_the_end(tmp_path):
    full = GgufFile(embedded_model_path())
    last = full.tensors[-1]
    end_of_last = os.path.getsize(embedded_model_path())
    path = _truncated_copy(tmp_path, end_of_last - last.n_bytes // 2)
    with pytest.raises(CheckpointError, match="runs past the end of the file") as err:
        GgufFile(path)
    assert err.value.tensor == last.name and err.value.file == path


@pytest.mark.parametrize("n_bytes", [0, 3, 24, 100_000])
def test_a_file_cut_inside_the_header_is_a_checkpoint_error(tmp_path, n_bytes):
    path = _truncated_copy(tmp_path, n_bytes)
    with pytest.raises(CheckpointError) as err:
        GgufFile(path)
    assert err.value.file == path


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="no GGUF magic"):
        GgufFile(str(path))


def test_the_tokenizer_is_the_one_autotokenizer_builds():
    """The checkpoint builds PreTrainedTokenizerFast directly (AutoTokenizer first parses the whole file for a
    config); both must tokenize, detokenize and template the same."""
    from transformers import AutoTokenizer

    from radiance.checkpoint import open_checkpoint

    ck = open_checkpoint(None)
    ours = ck.tokenizer()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(ck.path), gguf_file=os.path.basename(ck.path))
    for text in ("Hello world, the capital of France is Paris.", "  two  spaces\n\nnew lines\t tab",
                 "émoji 🤖 ünïcödé 中文", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ours.all_special_ids == ref.all_special_ids and len(ours) == len(ref)


def test_a_qwen2_gguf_tokenizes_as_autotokenizer_does(tmp_path):
    """For a qwen2 file AutoTokenizer picks Qwen2Tokenizer, the checkpoint the generic class: same tokens."""
    from transformers import AutoTokenizer

    from radiance.checkpoint import open_checkpoint

    meta = GgufFile(embedded_model_path()).metadata
    path = str(tmp_path / "qwen2.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    writer.add_tensor("token_embd.weight", np.zeros((len(meta["tokenizer.ggml.tokens"]), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = open_checkpoint(path).tokenizer()
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="qwen2.gguf")
    for text in ("Hello world, the capital of France is Paris.", "  two  spaces\n\nnew lines\t tab 12345 678",
                 "émoji 🤖 ünïcödé 中文", "<|im_start|>user\nhi<|im_end|>", "I'm sure we'll"):
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
