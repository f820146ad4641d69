"""The tiny HF models of tests/engine, saved once per session for the LoRA tests."""

from __future__ import annotations

import pytest

from tests.engine.conftest import tiny_hf_model


@pytest.fixture(scope="session")
def tiny_arch_dir(tmp_path_factory):
    """arch -> the directory of a tiny random model of that architecture (tests/engine's tiny_hf_model)."""
    cache = {}

    def get(arch: str) -> str:
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            tiny_hf_model(arch).save_pretrained(path)
            cache[arch] = str(path)
        return cache[arch]

    return get
