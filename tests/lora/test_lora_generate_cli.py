"""`radiance generate --lora NAME`: the answer of a --lora-modules adapter (the merged weights' text), and a name it
cannot serve refused in one line before the model loads."""

from __future__ import annotations

import pytest
import torch

from radiance.cli import main
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir, write_tokenizer
from tests.lora.adapters import adapter_tensors, merged_state_dict, write_adapter

FP32 = dict(TINY, torch_dtype="float32")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cli")
    base = dense_state_dict(dtype=torch.float32)
    tensors = adapter_tensors(4, seed=1)
    paths = {"base": write_dir(str(root / "base"), base, FP32),
             "adapter": write_adapter(root / "adapter", tensors, 4, 8.0),
             "merged": write_dir(str(root / "merged"), merged_state_dict(base, tensors, 4, 8.0), FP32)}
    for name in ("base", "merged"):
        write_tokenizer(paths[name], FP32["vocab_size"])
    return paths


def generate(model: str, *flags: str) -> list[str]:
    return ["generate", "w5 w9 w23 w7", "--model", model, "--device", "cpu", "--dtype", "float32", "--no-chat",
            "--no-progress", "--max-tokens", "8", "--ignore-eos", *flags]


def answer(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_generate_answers_with_the_chosen_adapter(dirs, capsys):
    modules = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"other={dirs['adapter']}",
               f"mine={dirs['adapter']}"]
    with_adapter = answer(capsys, generate(dirs["base"], *modules, "--lora", "mine"))
    assert with_adapter == answer(capsys, generate(dirs["merged"]))
    assert with_adapter != answer(capsys, generate(dirs["base"], *modules))  # no --lora: the base model


@pytest.mark.parametrize("flags, words", [
    (["--lora", "mine"], "no adapter to choose from; load it with --enable-lora --lora-modules mine=PATH"),
    (["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--lora", "mine"],
     "--lora 'mine' is not one of the --lora-modules adapters: a, b"),
])
def test_a_lora_it_cannot_serve_is_one_error_line_before_the_load(dirs, capsys, monkeypatch, flags, words):
    import radiance.engine.llm as llm_module

    monkeypatch.setattr(llm_module.LLM, "from_engine_config", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(generate(dirs["base"], *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
