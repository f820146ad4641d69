"""Follow-ups of the s55 CLI audit (scratch/s55/cli_audit/REPORT.md): eval refuses a text too short before any model
loads, counts a flag typed with its default value as given, reports in --json only the settings it applied (and the
dtype it ran in); generate takes a boolean or non-object --json-schema as JSON, exits 1 on a constrained output cut by
--max-tokens, refuses an empty --regex and names --choice; convert and inspect say what to do."""

import errno
import json

import pytest
import torch

import radiance.bench.loading
from radiance.bench import quality
from radiance.bench.quality import EvalRequest, Variant
from radiance.cli import main
from radiance.engine.llm import LLM
from radiance.errors import ConfigError
from tests.cli.test_generate_inputs import _FakeLLM as _GenerateFakeLLM
from tests.cli.test_generate_inputs import _Output

WIKITEXT = "/work/shared/data/wikitext2-test.txt"


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"radiance {command}: error:"), err
    return err


# ------------------------------------------------------------------------------ eval: fakes


class _Bigram(torch.nn.Module):
    """logits[t] = table[token t], in the dtype the fake 'loaded' it in."""

    def __init__(self, vocab: int, dtype=torch.float32):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab).to(dtype), requires_grad=False)

    def forward_logits(self, input_ids):
        return self.table[input_ids]


class _Words:
    """One token per word of a fixed vocabulary."""

    vocab = ["the", "cat", "sat", "on", "a", "mat"]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.index(w) if w in self.vocab else 0 for w in text.split()]}


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(" ".join(_Words.vocab[i % 6] for i in range(400)))
    return str(path)


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: the errors asked for must come before one."""
    def load(*args, **kwargs):
        pytest.fail(f"a model loaded: {args}")
    monkeypatch.setattr(radiance.bench.loading, "load_eval_model", load)


@pytest.fixture
def fake_eval(monkeypatch):
    """Loads fake models (their dtype set by the test) and the fake tokenizer; records the variants loaded."""
    state = {"dtype": torch.float32, "loaded": []}

    def load(model, variant, device, dtype, progress=True):
        state["loaded"].append(variant)
        return _Bigram(6, state["dtype"]), _Words()

    monkeypatch.setattr(radiance.bench.loading, "load_eval_model", load)
    monkeypatch.setattr(radiance.bench.loading, "load_eval_tokenizer", lambda model, device: _Words())
    return state


# ------------------------------------------------------------------------------ 1. too short: before the load


@pytest.mark.parametrize("mode, flags, message", [
    ("kl", ["--quantization", "nvfp4"], "fewer than 1 chunk(s) of 512"),  # was 75 s of load and quantization first
    ("ppl", ["--chunk-len", "64", "--first-chunk", "500"], "fewer than 501 chunk(s) of 64"),
])
def test_eval_on_a_text_too_short_fails_before_the_model_loads(no_load, capsys, tmp_path, mode, flags, message):
    """The real tokenizer (the embedded GGUF's) counts the tokens; no model loads (no_load fails the test if one
    does)."""
    short = tmp_path / "short.txt"
    short.write_text("The city was founded in the twelfth century . " * 20)
    assert main(["eval", mode, "--text", str(short), *flags, "--no-progress"]) == 2
    assert message in _error_line(capsys, f"eval {mode}")


def test_eval_with_a_chunk_past_the_context_fails_before_the_model_loads(no_load, capsys, tmp_path):
    """The embedded model's context comes from its GGUF metadata: a --chunk-len beyond it is one line, no load."""
    from radiance.bench.loading import eval_context_length

    context = eval_context_length(None)
    long = tmp_path / "long.txt"  # enough tokens for one chunk: the text is not what is refused
    long.write_text("The city was founded in the twelfth century . " * (context // 8))
    assert main(["eval", "ppl", "--text", str(long), "--chunk-len", str(context + 1), "--no-progress"]) == 2
    assert f"--chunk-len {context + 1} exceeds the model's context of {context} tokens" in _error_line(capsys,
                                                                                                      "eval ppl")


def test_run_eval_chunks_the_text_with_the_tokenizer_alone_before_any_load(text):
    loaded = []

    def loader(model, variant, device, dtype):
        loaded.append(variant)
        return _Bigram(6), _Words()

    req = EvalRequest("kl", None, (Variant("mxfp4"),), text, chunks=2, chunk_len=64, first_chunk=10)
    with pytest.raises(ConfigError, match="fewer than 11 chunk"):
        quality.run_eval(req, loader, progress=False, tokenizer_loader=lambda model, device: _Words())
    assert loaded == []
    req = EvalRequest("kl", None, (Variant("mxfp4"),), text, chunks=2, chunk_len=64)
    out = quality.run_eval(req, loader, progress=False, tokenizer_loader=lambda model, device: _Words())
    assert out["chunks"] == 2 and [v.quantization for v in loaded] == ["none", "mxfp4"]


# ------------------------------------------------------------------------------ 2. typed defaults count as given


@pytest.mark.parametrize("mode, flags, message", [
    # the same as the variant nvfp4/none/fp8, which was refused while the flags were accepted
    ("kl", ["--quantization", "nvfp4", "--rule", "none", "--activations", "fp8"], "keeps 16-bit activations, not fp8"),
    ("ppl", ["--rule", "mse"], "the 16-bit model (none) has no block-exponent rule"),
    ("ppl", ["--activations", "fp8"], "the 16-bit model (none) has no block-exponent rule"),
    ("kl", ["--quantization", "mxfp4", "--variants", "mxfp4/ocp"],
     "--quantization mxfp4 is left unused beside --variants"),
    ("ppl", ["--rule", "mse", "--variants", "none+fp8kv"], "--rule mse is left unused beside --variants"),
])
def test_eval_counts_a_flag_typed_with_its_default_value_as_given(monkeypatch, capsys, text, mode, flags, message):
    monkeypatch.setattr(quality, "run_eval", lambda *a, **k: pytest.fail("evaluated despite the unused flag"))
    assert main(["eval", mode, "--text", text, *flags]) == 2
    assert message in _error_line(capsys, f"eval {mode}")


def test_eval_defaults_still_apply_when_no_flag_is_typed(monkeypatch, capsys, text):
    seen = []
    monkeypatch.setattr(quality, "run_eval", lambda req, loader, **_: seen.append(req.variants) or {"ppl": 1.0})
    assert main(["eval", "kl", "--text", text, "--json"]) == 0
    assert main(["eval", "kl", "--text", text, "--quantization", "nvfp4", "--rule", "none", "--json"]) == 0
    assert seen == [(Variant("mxfp4", "mse", "fp8"),), (Variant("nvfp4", "none", "fp8"),)]


# ------------------------------------------------------------------------------ 3. --json: what was applied


def test_eval_json_reports_null_for_settings_a_variant_does_not_use(fake_eval, capsys, text):
    assert main(["eval", "ppl", "--text", text, "--chunks", "2", "--chunk-len", "64", "--json", "--variants", "none",
                 "none+fp8kv", "nvfp4/none", "mxfp4/ocp/bf16+head"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["label"]: (r["quantization"], r["rule"], r["activations"], r["lm_head"], r["kv_cache"])
            for r in out["results"]}
    assert rows == {
        "float32": ("none", None, None, None, "auto"),  # was rule "mse", activations "fp8", label "16-bit"
        "float32 +fp8 KV": ("none", None, None, None, "fp8"),
        "nvfp4 as W4A16": ("nvfp4", "none", None, None, "auto"),  # served W4A16 whatever --activations says
        "mxfp4 ocp W4A16 +4-bit head": ("mxfp4", "ocp", "bf16", "mxfp4", "auto"),
    }
    assert Variant.parse("nvfp4/none/bf16").applied()["activations"] == "bf16"  # what it serves, as typed
    assert (out["dtype"], out["device"]) == ("float32", "cpu")
    for key in ("ppl", "chunks", "tokens", "results", "mode", "model", "text", "chunk_len", "first_chunk", "seconds"):
        assert key in out, key


def test_eval_names_the_unquantized_model_by_the_dtype_it_ran_in(fake_eval, capsys, text):
    fake_eval["dtype"] = torch.bfloat16
    assert main(["eval", "kl", "--text", text, "--chunks", "2", "--chunk-len", "64", "--variants", "none+fp8kv",
                 "mxfp4"]) == 0
    table = capsys.readouterr().out
    assert "reference (bfloat16) perplexity" in table and "bfloat16 +fp8 KV" in table and "16-bit" not in table
    assert main(["eval", "kl", "--text", text, "--chunks", "2", "--chunk-len", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "bfloat16" and out["results"][0]["label"] == "mxfp4 mse W4A8"
    for key in ("ppl", "kl", "chunks", "tokens", "kl_p99", "top1_agreement", "reference_ppl", "results"):
        assert key in out, key


@pytest.fixture(scope="module")
def live_ppl():
    """One real run on the embedded model (CPU: float32), tiny."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["eval", "ppl", "--text", WIKITEXT, "--chunks", "2", "--chunk-len", "64", "--json", "--no-progress",
                   "--device", "cpu"])
    assert rc == 0
    return json.loads(out.getvalue())


def test_live_eval_json_says_float32_on_the_cpu(live_ppl):
    row = live_ppl["results"][0]
    # the embedded model's Q4_1 linears dequantized: not its 16-bit model (s57)
    assert (live_ppl["dtype"], live_ppl["device"], row["label"]) == ("float32", "cpu", "float32 (dequantized Q4_1)")
    assert (row["rule"], row["activations"]) == (None, None)
    assert live_ppl["chunks"] == 2 and live_ppl["tokens"] == 2 * 63 and 3 < live_ppl["ppl"] < 1000


# ------------------------------------------------------------------------------ generate: fakes


class _FakeLLM(_GenerateFakeLLM):
    """test_generate_inputs' fake LLM, counting the loads asked of it."""

    def __init__(self):
        super().__init__()
        self.engine.params, self.loads = None, []


@pytest.fixture
def fake(monkeypatch):
    llm = _FakeLLM()
    monkeypatch.setattr(LLM, "from_engine_config", lambda config, **_: llm.loads.append(config) or llm)
    return llm


# ------------------------------------------------------------------------------ 4. --json-schema as JSON


@pytest.mark.parametrize("value, message", [
    ("[1,2]", "--json-schema must be a JSON object (a schema) or true, got an array"),  # was "cannot read [1,2]"
    ("1", "--json-schema must be a JSON object (a schema) or true, got a number"),
    ('"x"', "--json-schema must be a JSON object (a schema) or true, got a string"),
    ("false", "--json-schema false: no value matches it"),
    ("[1,2", "--json-schema is not valid JSON"),
    ("missing.json", "--json-schema: cannot read missing.json: No such file or directory"),
])
def test_a_json_schema_that_names_no_file_is_read_as_json(fake, capsys, value, message):
    assert main(["generate", "hi", "--no-chat", "--json-schema", value]) == 2
    assert message in _error_line(capsys, "generate")
    assert fake.loads == []


def test_the_boolean_schema_true_is_served(fake, capsys):
    fake.engine.steps = [[_Output("[1]", "stop")]]
    assert main(["generate", "hi", "--no-chat", "--json-schema", "true"]) == 0
    assert fake.engine.params.structured_output.json == "true" and capsys.readouterr().out == "[1]\n"


def test_a_schema_file_holding_an_array_is_refused(fake, capsys, tmp_path):
    path = tmp_path / "s.json"
    path.write_text("[1, 2]")
    assert main(["generate", "hi", "--no-chat", "--json-schema", str(path)]) == 2
    assert "must be a JSON object (a schema)" in _error_line(capsys, "generate")


# ------------------------------------------------------------------------------ 5. cut constrained output: exit 1


def test_a_constrained_output_cut_by_max_tokens_exits_1(fake, capsys, caplog):
    with caplog.at_level("WARNING", logger="radiance.engine.cli"):
        assert main(["generate", "hi", "--no-chat", "--json", "--max-tokens", "4"]) == 1  # was 0: invalid JSON
    assert capsys.readouterr().out == '{"a": 1\n'
    assert any("cut the output before the constraint was complete" in r.getMessage() for r in caplog.records)
    fake.engine.steps = [[_Output('{"a": 1}', "stop")]]
    assert main(["generate", "hi", "--no-chat", "--json"]) == 0
    fake.engine.steps = [[_Output("plain", "length")]]  # no constraint: a cut is the usual end
    assert main(["generate", "hi", "--no-chat", "--max-tokens", "4"]) == 0


@pytest.mark.parametrize("flags, text", [(["--regex", "[0-9]+"], "100"), (["--json"], '{"a": 1}'),
                                         (["--choice", "yes", "no"], "yes")])
def test_an_output_already_whole_when_cut_is_valid(fake, capsys, caplog, flags, text):
    """A review's case: `--regex '[0-9]+' --max-tokens 3` printed "100", a full match, then said it was not valid and
    exited 1 (the grammar ends only at the stop token, so a cut alone proves nothing)."""
    fake.engine.steps = [[_Output(text, "length")]]
    with caplog.at_level("WARNING", logger="radiance.engine.cli"):
        assert main(["generate", "hi", "--no-chat", "--max-tokens", "3", *flags]) == 0
    assert capsys.readouterr().out == text + "\n" and "cut the output" not in caplog.text


def test_generate_help_says_a_cut_constrained_output_exits_1(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "exit status 1" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------ 6. --regex '' and --choice ''


def test_an_empty_regex_is_refused_naming_the_flag(fake, capsys):
    assert main(["generate", "hi", "--no-chat", "--regex", ""]) == 2  # was accepted: an empty output, exit 0
    assert "--regex is empty" in _error_line(capsys, "generate")
    assert fake.loads == []


def test_an_empty_choice_names_the_flag(fake, capsys):
    assert main(["generate", "hi", "--no-chat", "--choice", ""]) == 2
    assert _error_line(capsys, "generate").endswith("error: --choice needs at least one non-empty string")
    assert main(["generate", "hi", "--no-chat", "--regex", "a(b"]) == 2
    assert "--regex: invalid regex constraint" in _error_line(capsys, "generate")
    assert fake.loads == []


# ------------------------------------------------------------------------------ 7. convert into /proc


def test_convert_into_proc_says_it_cannot_create_a_directory(capsys):
    assert main(["convert", "embedded", "/proc/out"]) == 2
    err = _error_line(capsys, "convert")
    assert "cannot create a directory in /proc: give a directory" in err
    assert "No such file" not in err  # /proc's errno said the opposite of the cause


@pytest.mark.parametrize("code, words", [(errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied")])
def test_convert_gives_the_errno_text_where_it_says_why(monkeypatch, capsys, tmp_path, code, words):
    import tempfile

    def refuse(*args, **kwargs):
        raise OSError(code, words)

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    assert main(["convert", "embedded", str(tmp_path / "out")]) == 2
    assert f"cannot create a directory in {tmp_path} ({words})" in _error_line(capsys, "convert")


# ------------------------------------------------------------------------------ 8. inspect a file of a model folder


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_inspect_a_file_of_a_model_folder_says_to_give_the_folder(capsys, tmp_path, name):
    folder = tmp_path / "model"
    folder.mkdir()
    for file in ("config.json", name):
        (folder / file).write_text("{}")
    assert main(["inspect", str(folder / name)]) == 2
    assert f"{name} alone is no model: give the directory holding it, {folder}" in _error_line(capsys, "inspect")


def test_inspect_a_json_file_outside_a_model_folder_is_not_a_model(capsys, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["inspect", str(tmp_path / "tokenizer.json")]) == 2
    assert "not a model: expected an HF directory" in _error_line(capsys, "inspect")


def test_top_k_help_says_0_is_off_as_the_sampler_takes_it(capsys):
    from radiance.engine.sampling_params import SamplingParams

    assert SamplingParams(top_k=0).top_k == 0  # accepted, and off
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "0 or -1 = off" in " ".join(capsys.readouterr().out.split())
