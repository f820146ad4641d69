"""What a Hugging Face Hub id that cannot be served says: one line naming the reference as typed (`org/name@rev:TAG`)
and what to do, for offline mode, no network, a refusal of the Hub (gated, unknown, no such revision, a bad token),
a repo radiance cannot read, a full disk. No network: huggingface_hub's functions are replaced, and the cache is a
real one laid out in a temp folder as huggingface_hub lays it out (its own snapshot_download reads it)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint import hub as hub_module
from radiance.checkpoint.gguf_reader import embedded_model_path
from radiance.cli import main
from radiance.errors import CheckpointError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
NO_DNS = socket.gaierror(-2, "Name or service not known")


def _hub_error(cls, status: int = 404, text: str = "Client Error"):
    """huggingface_hub's HTTP error `cls` without the HTTP response its __init__ wants."""
    error = cls.__new__(cls)
    Exception.__init__(error, f"{status} {text}")
    error.response = SimpleNamespace(status_code=status, headers={})
    return error


def _never(*args, **kwargs):
    pytest.fail("the Hub was asked")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache in a temp folder, and no network: the Hub's host name does not resolve."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub_module, "_unresolvable_endpoint", lambda: NO_DNS)
    return folder


@pytest.fixture
def offline(cache, monkeypatch):
    """HF_HUB_OFFLINE=1, as huggingface_hub read it at import: the Hub (and its DNS) is never asked."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_module, "_unresolvable_endpoint", _never)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", _never)
    return cache


@pytest.fixture
def online(cache, monkeypatch):
    """The Hub reachable: list_repo_files answers `listing` (or raises it), downloads raise `download` if set."""
    state = SimpleNamespace(listing=["config.json", "model.safetensors"], download=None)

    def listing(repo, revision=None):
        if isinstance(state.listing, Exception):
            raise state.listing
        return state.listing

    def download(*args, **kwargs):
        raise state.download or AssertionError("no download failure set")

    monkeypatch.setattr(hub_module, "_unresolvable_endpoint", lambda: None)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", listing)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return state


def _cache_repo(cache, repo: str, files: dict[str, str], listed: tuple[str, ...] = ()) -> None:
    """`repo` at `main` in the cache as huggingface_hub lays it out: refs/main -> snapshots/<commit>/<files>
    (symlinks, as its blobs), and the commit's tree listing, which names `listed` files radiance never fetched."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(source, snapshot / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    tree = {name: {"size": 1, "blob_id": f"{i:040x}"} for i, name in enumerate([*files, *listed])}
    (repo_dir / "trees").mkdir()
    (repo_dir / "trees" / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": tree}))


@pytest.fixture
def cached_tiny(cache, tmp_path):
    """org/tiny cached as radiance fetches it: without the PyTorch copy its tree listing names."""
    src = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY, tokenizer=True)
    _cache_repo(cache, "org/tiny", {name: os.path.join(src, name) for name in os.listdir(src)},
                listed=("pytorch_model.bin", "original/consolidated.pth"))
    return src


@pytest.fixture
def cached_gguf(cache):
    _cache_repo(cache, "org/smol-GGUF", {"smol.Q4_1.gguf": embedded_model_path()},
                listed=("smol.Q8_0.gguf", "README.md"))


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith(f"radiance {command}: error: "), err
    return lines[0].split(": error: ", 1)[1]


# ------------------------------------------------------------------------------ offline mode, no network


@pytest.mark.parametrize("argv", [["inspect", "foo/bar"], ["generate", "hi", "--model", "foo/bar"],
                                  ["convert", "foo/bar", "OUT", "--format", "mxfp4"]])
def test_offline_mode_and_an_uncached_model_says_offline_mode_not_unreachable(offline, capsys, tmp_path, argv):
    """Was "the Hugging Face Hub could not be reached to fetch it (gaierror ...)": HF_HUB_OFFLINE never named."""
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    error = _error_line(capsys, argv[0])
    assert error.startswith("foo/bar: no such local path, and Hugging Face offline mode is on (HF_HUB_OFFLINE=1)")
    assert f"the Hugging Face cache ({offline}) does not hold this model" in error
    assert "unset HF_HUB_OFFLINE" in error and "`HF_HUB_OFFLINE=0 radiance inspect foo/bar`" in error
    assert "could not be reached" not in error and "gaierror" not in error


def test_transformers_offline_is_named_when_it_is_the_one_set(offline, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"offline mode is on \(TRANSFORMERS_OFFLINE=1\).*unset "
                                              r"TRANSFORMERS_OFFLINE"):
        open_checkpoint("foo/bar")


def test_both_offline_variables_are_named_when_both_are_set(offline, monkeypatch):
    """Was "unset HF_HUB_OFFLINE" alone: huggingface_hub then reads TRANSFORMERS_OFFLINE=1 and stays offline."""
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("foo/bar")
    message = str(err.value)
    assert "offline mode is on (HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1)" in message
    assert "unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE so that" in message
    assert "`HF_HUB_OFFLINE=0 radiance inspect foo/bar`" in message


def test_an_offline_variable_set_to_0_is_not_named(offline, monkeypatch):
    """huggingface_hub reads "0" as off; the message told the user to unset TRANSFORMERS_OFFLINE=0 too."""
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("foo/bar")
    assert "offline mode is on (HF_HUB_OFFLINE=1) while" in str(err.value)
    assert "TRANSFORMERS_OFFLINE" not in str(err.value)


def test_no_network_and_an_uncached_model_says_unreachable_and_not_cached(cache):
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("foo/bar@v2")
    message = str(err.value)
    assert message.startswith("foo/bar@v2: no such local path, and the Hugging Face Hub could not be reached to "
                              "fetch it (gaierror: [Errno -2] Name or service not known)")
    assert f"the Hugging Face cache ({cache}) does not hold it" in message and "offline mode" not in message
    assert "\n" not in message


@pytest.mark.parametrize("mode", ["offline", "no network"])
def test_a_cached_model_is_served_without_the_hub(request, cached_tiny, mode, caplog):
    """Its cached tree listing names files radiance leaves (pytorch_model.bin): huggingface_hub >= 1.x calls such a
    snapshot incomplete, which read as "the cache does not hold it"."""
    if mode == "offline":
        request.getfixturevalue("offline")
    with caplog.at_level("INFO", logger="radiance.checkpoint.hub"):
        assert open_checkpoint("org/tiny").architecture == "LlamaForCausalLM"
    said = "served from the Hugging Face cache (offline mode" if mode == "offline" else "could not be asked"
    assert said in caplog.text


def test_a_cached_gguf_is_served_by_its_tag_offline_and_another_tag_names_what_is_cached(offline, cached_gguf):
    assert open_checkpoint("org/smol-GGUF:q4_1").architecture == "LlamaForCausalLM"
    assert open_checkpoint("org/smol-GGUF").architecture == "LlamaForCausalLM"  # the one cached
    with pytest.raises(CheckpointError, match=r"^org/smol-GGUF:Q8_0: no such local path, and Hugging Face offline "
                                              r"mode is on .* does not hold this model \(of it the cache holds: "
                                              r"smol\.Q4_1\.gguf\)"):
        open_checkpoint("org/smol-GGUF:Q8_0")


def test_a_cache_missing_a_shard_its_index_names_does_not_hold_the_model(offline, cache, tmp_path):
    src = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY)
    index = tmp_path / "src" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    shutil.copyfile(os.path.join(src, "model.safetensors"), tmp_path / "src" / "model-00001-of-00002.safetensors")
    files = {name: os.path.join(src, name) for name in ("config.json", "model.safetensors.index.json",
                                                         "model-00001-of-00002.safetensors")}
    _cache_repo(cache, "org/cut", files)
    with pytest.raises(CheckpointError, match="org/cut: no such local path.*does not hold this model"):
        open_checkpoint("org/cut")


def test_the_real_command_reads_hf_hub_offline_from_its_environment(tmp_path):
    """End to end, as a user runs it: huggingface_hub reads HF_HUB_OFFLINE once, at import."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run([sys.executable, "-m", "radiance", "inspect", "foo/bar:Q4_K_M"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert ("radiance inspect: error: foo/bar:Q4_K_M: no such local path, and Hugging Face offline mode is on "
            "(HF_HUB_OFFLINE=1)") in run.stderr
    assert "gaierror" not in run.stderr


# ------------------------------------------------------------------------------ the reference as typed, the tag


def test_a_tag_matching_no_gguf_names_the_whole_reference_and_the_gguf_files(online):
    """Were "org/x: no GGUF file matches ..." (the tag dropped from the name) for `org/x:IQ2_XS`."""
    online.listing = ["x.Q4_K_M.gguf", "x.Q8_0.gguf", "mmproj-x-f16.gguf", "README.md"]
    with pytest.raises(CheckpointError, match=r"^org/x@v2:IQ2_XS: no GGUF file matches 'IQ2_XS' \(its GGUF files: "
                                              r"x\.Q4_K_M\.gguf, x\.Q8_0\.gguf\)"):
        open_checkpoint("org/x@v2:IQ2_XS")


def test_a_tag_on_a_repo_without_gguf_files_lists_its_files_and_says_to_drop_the_tag(online):
    online.listing = ["config.json", "model.safetensors", "tokenizer.json"]
    with pytest.raises(CheckpointError, match=r"^org/x:Q4_K_M: no GGUF file matches 'Q4_K_M': the repo holds none "
                                              r"\(its files: config\.json, model\.safetensors, tokenizer\.json\) "
                                              r"\(drop :Q4_K_M to take its \.safetensors weights\)$"):
        open_checkpoint("org/x:Q4_K_M")


def test_a_tag_matching_several_ggufs_and_a_split_one_name_the_reference(online):
    online.listing = ["x.Q4_K_M.gguf", "x-v2.Q4_K_M.gguf", "x-Q6_K-00001-of-00002.gguf", "x-Q6_K-00002-of-00002.gguf"]
    with pytest.raises(CheckpointError, match=r"^org/x:Q4_K_M: several GGUF files match 'Q4_K_M'"):
        open_checkpoint("org/x:Q4_K_M")
    with pytest.raises(CheckpointError, match=r"^org/x:Q6_K: 'Q6_K' names a split GGUF"):
        open_checkpoint("org/x:Q6_K")


def test_a_repo_without_weights_radiance_reads_is_one_line_with_its_files(online):
    online.listing = ["config.json", "pytorch_model.bin", "README.md"]
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("org/bin-only@main")
    assert str(err.value).startswith("org/bin-only@main on the Hugging Face Hub holds neither a config.json with "
                                     ".safetensors weights nor a .gguf file (radiance reads those; its files: "
                                     "README.md, config.json, pytorch_model.bin)")


def test_an_invalid_id_is_said_before_the_hub_or_cache_is_asked(offline):
    with pytest.raises(CheckpointError, match=r"^org/a\.\.b: no such local path, and no valid Hugging Face Hub id "
                                              r"\(.*'org/a\.\.b'"):
        open_checkpoint("org/a..b")


# ------------------------------------------------------------------------------ the Hub says no


REFUSALS = [
    (lambda: _hub_error(errors.GatedRepoError, 403), "org/x:Q4_K_M: a gated model on the Hugging Face Hub, not open "
     "to this account: accept its terms at https://huggingface.co/org/x and log in"),
    (lambda: _hub_error(errors.RepositoryNotFoundError, 401), "org/x:Q4_K_M: no such local path, and no such model "
     "on the Hugging Face Hub: check the id (a private one needs `hf auth login` or HF_TOKEN)"),
    (lambda: _hub_error(errors.HfHubHTTPError, 401, "Invalid credentials in Authorization header"),
     "org/x:Q4_K_M: the Hugging Face Hub refused the token (401): HF_TOKEN or the one `hf auth login` saved is "
     "invalid or expired"),
    (lambda: _hub_error(errors.HfHubHTTPError, 403, "Forbidden"), "org/x:Q4_K_M: the Hugging Face Hub refused "
     "access (403): the token lacks read access to org/x"),
    (lambda: _hub_error(errors.DisabledRepoError, 403), "org/x:Q4_K_M: its repository is disabled on the Hugging "
     "Face Hub"),
]


@pytest.mark.parametrize("error, said", REFUSALS)
def test_a_refused_listing_is_one_line_naming_the_reference_and_what_to_do(online, cache, error, said):
    online.listing = error()
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("org/x:Q4_K_M")
    assert str(err.value).startswith(said) and "\n" not in str(err.value)


def test_a_revision_the_hub_does_not_have_is_named(online):
    online.listing = _hub_error(errors.RevisionNotFoundError)
    with pytest.raises(CheckpointError, match=r"^org/x@v9: the Hugging Face Hub has no revision 'v9' of org/x \(a "
                                              r"branch, tag or commit of it: see https://huggingface.co/org/x/commits"):
        open_checkpoint("org/x@v9")


@pytest.mark.parametrize("listing", [["config.json", "model.safetensors"], ["x.Q4_K_M.gguf"]])
def test_a_gated_repo_whose_listing_is_public_is_said_at_its_download(online, listing):
    """The Hub lists a gated repo's files to anyone; the download is what it refuses (was a traceback)."""
    online.listing, online.download = listing, _hub_error(errors.GatedRepoError, 403)
    with pytest.raises(CheckpointError, match=r"^org/gated: a gated model on the Hugging Face Hub"):
        open_checkpoint("org/gated")


def test_a_hub_down_falls_back_to_the_cache_and_says_it_when_that_lacks_the_model(online, cache):
    """A 5xx is the Hub failing, not a network to check (it said "could not be reached")."""
    online.listing = _hub_error(errors.HfHubHTTPError, 503, "Server Error")
    with pytest.raises(CheckpointError, match=r"^org/x: no such local path, and the Hugging Face Hub answered with a "
                                              r"server error \(HfHubHTTPError: 503 Server Error\) while the "
                                              r"Hugging Face cache .* does not hold it: the Hub is failing, retry "
                                              r"later$"):
        open_checkpoint("org/x")


# ------------------------------------------------------------------------------ the download fails


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("Data processing error: I/O error: No space left on device (os error 28)"),  # hf_xet's text
])
def test_a_full_disk_while_downloading_says_where_and_what_to_do(online, cache, failure):
    """Was an OSError traceback."""
    online.download = failure
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("org/x")
    assert str(err.value) == (f"org/x: no space left on the device while downloading it into the Hugging Face cache "
                              f"({cache}): free space there, or set HF_HUB_CACHE (or HF_HOME) to a folder on a disk "
                              "with room, and retry")


def test_a_cache_it_cannot_write_says_so(online, cache):
    online.download = PermissionError(errno.EACCES, "Permission denied", str(cache / "models--org--x"))
    with pytest.raises(CheckpointError, match=r"^org/x: cannot write the Hugging Face cache .*Permission denied.*: "
                                              r"set HF_HUB_CACHE \(or HF_HOME\) to a folder you can write$"):
        open_checkpoint("org/x")


def test_a_connection_lost_while_downloading_says_retry(online):
    online.listing, online.download = ["x.Q4_K_M.gguf"], ConnectionError("Connection reset by peer\nmore detail")
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("org/x:Q4_K_M")
    assert str(err.value) == ("org/x:Q4_K_M: downloading it from the Hugging Face Hub failed (ConnectionError: "
                              "Connection reset by peer): retry (what came down stays in the cache)")


def test_a_download_failure_through_the_cli_is_one_line(online, capsys):
    online.download = OSError(errno.ENOSPC, "No space left on device")
    assert main(["inspect", "org/x"]) == 2
    assert _error_line(capsys, "inspect").startswith("org/x: no space left on the device while downloading it")


def test_several_ggufs_without_a_tag_show_the_tagged_form_with_the_revision(online):
    online.listing = ["x.Q4_K_M.gguf", "x.Q8_0.gguf"]
    with pytest.raises(CheckpointError, match=r"^org/x@v2 holds several GGUF files: name one as org/x@v2:TAG"):
        open_checkpoint("org/x@v2")
    online.listing = ["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"]
    with pytest.raises(CheckpointError, match=r"^org/x: its one GGUF model is a split GGUF"):  # was "None names"
        open_checkpoint("org/x")
