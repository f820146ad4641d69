"""Models named by Hugging Face Hub id (checkpoint.hub), against a fake Hub: huggingface_hub's listing and
download functions replaced by ones serving local files into a local "cache" (CI has no Hub to ask)."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

from radiance.checkpoint import EMBEDDED_MODEL_NAME, model_name, open_checkpoint
from radiance.checkpoint.gguf_reader import embedded_model_path
from radiance.checkpoint import hub as hub_module
from radiance.checkpoint.hub import TRANSFORMERS_FILES, hub_model
from radiance.errors import CheckpointError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir


def _not_found(repo: str) -> RepositoryNotFoundError:
    error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
    Exception.__init__(error, f"404: {repo}")
    return error


class FakeHub:
    """repo -> {file name: local source}; downloads copy into `cache`, snapshots keep what they fetched."""

    def __init__(self, cache: str):
        self.cache, self.repos, self.fetched = cache, {}, []
        self.online = True  # the listing answers (False: a connection error, as with the Hub down)
        self.dns = True  # the Hub's host name resolves (False: no network at all)

    def add(self, repo: str, files: dict[str, str]) -> None:
        self.repos[repo] = files

    def _snapshot(self, repo: str) -> str:
        return os.path.join(self.cache, repo.replace("/", "--"))

    def _copy(self, repo: str, name: str) -> str:
        target = os.path.join(self._snapshot(repo), name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(self.repos[repo][name], target)
        self.fetched.append(name)
        return target

    def list_repo_files(self, repo, revision=None):
        if not self.online:
            raise ConnectionError("[Errno -2] Name or service not known")
        if repo not in self.repos:
            raise _not_found(repo)
        return list(self.repos[repo])

    def hf_hub_download(self, repo, filename, revision=None):
        return self._copy(repo, filename)

    def snapshot_download(self, repo, revision=None, allow_patterns=None, ignore_patterns=None,
                          local_files_only=False):
        if local_files_only:
            if not os.path.isdir(self._snapshot(repo)):
                raise LocalEntryNotFoundError(f"{repo} is not cached")
            return self._snapshot(repo)
        for name in self.repos[repo]:
            allowed = allow_patterns is None or any(fnmatch.fnmatch(name, p) for p in allow_patterns)
            if allowed and not any(fnmatch.fnmatch(name, p) for p in ignore_patterns or ()):
                self._copy(repo, name)
        return self._snapshot(repo)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(str(tmp_path / "cache"))
    for name in ("list_repo_files", "hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, getattr(fake, name))
    monkeypatch.setattr(hub_module, "_unresolvable_endpoint",
                        lambda: None if fake.dns else OSError("[Errno -2] Name or service not known"))
    return fake


@pytest.fixture
def transformers_repo(tmp_path, hub):
    src = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY, tokenizer=True)
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(b"a PyTorch copy of the weights, never fetched")
    copy = os.path.join(src, "model.safetensors")  # stand-ins for a maker's own layouts, never fetched either
    hub.add("org/tiny", {**{name: os.path.join(src, name) for name in os.listdir(src)},
                         "consolidated.safetensors": copy, "original/model.safetensors": copy})
    return src


def test_embedded_names_the_embedded_model_in_every_command(tmp_path, monkeypatch):
    """`convert embedded` and `inspect embedded` took it; `generate --model embedded`, `serve embedded` and `eval ppl
    embedded` said "no such file or directory" (they all open it here). A local path of that name stays a path."""
    assert open_checkpoint("embedded").path == embedded_model_path() and model_name("embedded") == EMBEDDED_MODEL_NAME
    monkeypatch.chdir(tmp_path)
    (tmp_path / "embedded").mkdir()
    with pytest.raises(CheckpointError, match="neither config.json nor a .gguf file"):
        open_checkpoint("embedded")


def test_hub_ids_and_paths_that_are_not_ones():
    assert hub_model("Qwen/Qwen3-8B").repo == "Qwen/Qwen3-8B"
    pinned = hub_model("bartowski/X-GGUF@v2:Q4_K_M")
    assert (pinned.repo, pinned.revision, pinned.tag) == ("bartowski/X-GGUF", "v2", "Q4_K_M")
    assert all(hub_model(p) is None for p in ("/abs/x", "./x/y", "~/x/y", "a/b/c", "name"))


def test_a_transformers_repo_is_fetched_without_its_other_copies_and_served_under_its_id(hub, transformers_repo):
    ckpt = open_checkpoint("org/tiny")
    local = open_checkpoint(transformers_repo)
    assert ckpt.architecture == local.architecture == "LlamaForCausalLM"
    fetched, served = ckpt.state_dict(), local.state_dict()
    assert fetched.keys() == served.keys()
    values = lambda weight: getattr(weight, "tensor", weight)  # noqa: E731 - a DenseWeight's, or a plain tensor
    assert all(torch.equal(values(fetched[k]), values(served[k])) for k in served)
    assert "model.safetensors" in hub.fetched
    assert not {"pytorch_model.bin", "consolidated.safetensors", "original/model.safetensors"} & set(hub.fetched)
    assert all(any(fnmatch.fnmatch(f, p) for p in TRANSFORMERS_FILES) for f in hub.fetched)
    assert model_name("org/tiny") == "org/tiny"  # what vLLM serves it as: clients keep their model field


@pytest.mark.parametrize("cut", ["hub down", "no network"])
def test_offline_the_cache_serves_what_it_holds_and_says_so_when_it_holds_nothing(hub, transformers_repo, cut,
                                                                                   caplog):
    open_checkpoint("org/tiny")  # cached
    hub.online, hub.dns = False, cut == "hub down"  # without DNS the Hub is not asked (its retries took ~25 s)
    with caplog.at_level("WARNING", logger="radiance.checkpoint.hub"):
        assert open_checkpoint("org/tiny").architecture == "LlamaForCausalLM"
    assert re.search(r"org/tiny: the Hugging Face Hub could not be asked \((ConnectionError|OSError).*serving the "
                     r"copy in its cache", caplog.text)
    with pytest.raises(CheckpointError, match=r"org/other: no such local path, and the Hugging Face Hub could not "
                                              r"be reached .*(ConnectionError|OSError)"):
        open_checkpoint("org/other")


def test_an_unknown_repo_and_a_missing_local_path_are_one_line_each(hub):
    with pytest.raises(CheckpointError, match=r"org/none: no such local path, and no such model on the Hugging "
                                              r"Face Hub"):
        open_checkpoint("org/none")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        open_checkpoint("./org/none")  # a path, not an id: the Hub is not asked
    assert hub.fetched == []


def test_a_gguf_repo_takes_the_file_its_tag_names(hub, tmp_path):
    gguf = embedded_model_path()
    hub.add("org/smol-GGUF", {"smol.Q4_1.gguf": gguf, "smol.Q8_0.gguf": gguf, "mmproj-smol-f16.gguf": gguf,
                              "big-Q6_K-00001-of-00002.gguf": gguf, "big-Q6_K-00002-of-00002.gguf": gguf,
                              "README.md": gguf})
    with pytest.raises(CheckpointError, match=r"several GGUF files: name one as org/smol-GGUF:TAG.*smol\.Q8_0\.gguf"):
        open_checkpoint("org/smol-GGUF")
    ckpt = open_checkpoint("org/smol-GGUF:q4_1")  # any case, as llama.cpp's -hf
    assert ckpt.architecture == "LlamaForCausalLM" and hub.fetched == ["smol.Q4_1.gguf"]
    with pytest.raises(CheckpointError, match="no GGUF file matches 'IQ2_XS'"):
        open_checkpoint("org/smol-GGUF:IQ2_XS")
    with pytest.raises(CheckpointError, match="split GGUF"):
        open_checkpoint("org/smol-GGUF:Q6_K")
    hub.add("org/only-GGUF", {"only.gguf": gguf, "mmproj.gguf": gguf})
    assert open_checkpoint("org/only-GGUF").architecture == "LlamaForCausalLM"  # the projector is no model


def test_a_repo_without_weights_radiance_reads_names_what_it_holds(hub, tmp_path):
    (tmp_path / "w.bin").write_bytes(b"")
    hub.add("org/bin-only", {"config.json": str(tmp_path / "w.bin"), "pytorch_model.bin": str(tmp_path / "w.bin")})
    with pytest.raises(CheckpointError, match=r"holds neither .* its files: config.json, pytorch_model.bin"):
        open_checkpoint("org/bin-only")
