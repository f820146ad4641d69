"""`radiance eval` and `radiance bench kernels` as a new user meets them on a CPU: progress while a model loads,
numbers from the whole text's tokens, options that do what their help says, exit codes scripts can read."""

import pytest
import torch

from radiance.bench import kernels, quality
from radiance.bench.kernels import Checked
from radiance.bench.quality import Variant
from radiance.cli import main
from radiance.errors import ConfigError


# ------------------------------------------------------------------------------ eval


def test_eval_models_load_with_a_progress_bar(monkeypatch):
    """Quantizing the embedded model to MXFP4 at load took minutes on this 2-core CPU without any progress shown."""
    import radiance.engine.loader as loader
    from radiance.bench.loading import load_eval_model

    seen = {}

    class Stop(Exception):
        pass

    def fake_load_model(config, kernel_config=None, checkpoint=None, progress=True):
        seen["progress"] = progress
        raise Stop

    monkeypatch.setattr(loader, "load_model", fake_load_model)
    with pytest.raises(Stop):
        load_eval_model(None, Variant("mxfp4"), "cpu", None)
    assert seen == {"progress": True}


class _WordLengthTokenizer:
    """One token per space-separated word, its id the word's length: a word cut at the prefix's end is a new id."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(word) for word in text.split(" ") if word]}


def test_tokens_are_the_whole_texts_where_the_prefix_is_cut():
    """Only a prefix of 8 characters per needed token is tokenized; when it ended inside a word, that word's
    fragment was scored as if the text held it."""
    text = "abcdefgh " * 100  # 9 characters a word: 4 tokens need 32 characters, which end inside the 4th word
    ids = quality.tokenize_text(_WordLengthTokenizer(), text, 4)
    assert len(ids) >= 4 and ids[:4] == [8, 8, 8, 8]


def test_a_short_text_is_tokenized_whole():
    assert quality.tokenize_text(_WordLengthTokenizer(), "ab cde", 10) == [2, 3]


def test_a_directory_as_text_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        quality.read_text(str(tmp_path))


# ------------------------------------------------------------------------------ bench kernels


def test_activation_error_on_the_cpu_writes_out(monkeypatch, tmp_path, capsys):
    """--out was ignored on the one path that runs on a CPU (--activation-error --no-table); --no-progress did not
    reach its model load (the bar showed)."""
    asked = []
    monkeypatch.setattr(kernels, "run_activation_error",
                        lambda progress: asked.append(progress) or ["| layer | err |", "| l0 | 0.07 |"])
    out = tmp_path / "ae.txt"
    assert main(["bench", "kernels", "--activation-error", "--no-table", "--out", str(out)]) == 0
    assert out.read_text() == "| layer | err |\n| l0 | 0.07 |\n"
    assert "| l0 | 0.07 |" in capsys.readouterr().out
    assert main(["--no-progress", "bench", "kernels", "--activation-error", "--no-table"]) == 0
    assert asked == [True, False]


def test_without_a_gpu_the_error_names_what_runs_on_a_cpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "kernels", "--activation-error"]) == 2
    assert "--activation-error --no-table" in capsys.readouterr().err


@pytest.fixture
def fake_gpu_checks(monkeypatch):
    """`bench kernels --check` without a GPU: each check section returns what `results` gives."""
    results = {"convert": Checked(["convert prmt == arithmetic bytes: True; equals exact weight: True; "
                                   "underflow blocks 0"], 0),
               "ptx": Checked(["ptx M=16: fp8 e4m3 wgmma present; prmt present"], 0),
               "check": Checked(["check N=48 K=96 M=1 bias=False: rel=1.00e-04 ok",
                                 "check worst rel error 1.00e-04 (PASS, gate 2e-3)"], 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(kernels, "run_convert_check", lambda device: results["convert"])
    monkeypatch.setattr(kernels, "run_ptx_check", lambda device: results["ptx"])
    monkeypatch.setattr(kernels, "run_check", lambda device, config=None: results["check"])
    return results


def test_checks_that_pass_exit_0(fake_gpu_checks):
    assert main(["bench", "kernels", "--check", "--no-table"]) == 0


@pytest.mark.parametrize("section, line", [
    ("check", "check worst rel error 3.10e-02 (FAIL, gate 2e-3)"),
    ("convert", "convert prmt == arithmetic bytes: False; equals exact weight: True; underflow blocks 0"),
    ("ptx", "ptx M=16: fp8 e4m3 wgmma ABSENT; prmt present"),
])
def test_a_failed_check_exits_1(fake_gpu_checks, tmp_path, capsys, section, line):
    """`--check` printed FAIL and exited 0, so CI and scripts took a broken kernel for a good one."""
    fake_gpu_checks[section] = Checked([line], 1)
    out = tmp_path / "check.txt"
    assert main(["bench", "kernels", "--check", "--no-table", "--out", str(out)]) == 1
    assert "1 check(s) or section(s) failed" in capsys.readouterr().out
    assert line in out.read_text() and "failed" in out.read_text().splitlines()[-1]


def test_a_section_that_raises_exits_1(fake_gpu_checks, monkeypatch):
    def broken(device):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(kernels, "run_ptx_check", broken)
    assert main(["bench", "kernels", "--check", "--no-table"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--m", "0"], "expected a positive integer, got 0"),
    (["--m", "-4"], "expected a positive integer, got -4"),
    (["--shapes", "0x4096"], "K a positive multiple of 32"),
    (["--shapes", "4096x100"], "K a positive multiple of 32"),
    (["--shapes", "4096x-32"], "K a positive multiple of 32"),
])
def test_kernel_sizes_that_cannot_run_are_refused_by_the_parser(capsys, argv, message):
    """M = 0 or a K that is no whole number of MXFP4 blocks failed deep in a GPU run, after the others' timings."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "kernels", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("factor, failures", [(1.0, 0), (1.01, 2)])
def test_run_check_counts_the_rows_past_the_gate(monkeypatch, factor, failures):
    """The exit code reads run_check's count (it used to grep the report for "FAIL"): a kernel 1% off fails each
    M it runs at, the exact answer none."""
    from radiance.kernels import reference
    from radiance.kernels.prepare import dequantize_prepared

    def fake_gemm(x_q, x_scale, pw, bias, out, config=None):
        out.copy_(reference.w4a8_matmul_reference(x_q, x_scale, dequantize_prepared(pw), bias, out.dtype) * factor)

    monkeypatch.setattr(kernels, "w4a8_gemm", fake_gemm)
    result = kernels.run_check(torch.device("cpu"), m_list=(1, 3), shapes=((48, 96),))
    assert result.failures == failures
    assert ("FAIL" in result.lines[-1]) == bool(failures)
