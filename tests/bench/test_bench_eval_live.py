"""`radiance eval` on the embedded SmolLM2, a few short chunks (CPU)."""

import json

import pytest

from radiance.cli import main

@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A fixed English paragraph, here as in CI (which has no copy of WikiText-2)."""
    path = tmp_path_factory.mktemp("eval") / "text.txt"
    path.write_text(("The city was founded in the twelfth century on the banks of the river . It grew as a "
                     "market town , and by 1500 it was one of the largest towns in the region . ") * 40)
    return str(path)


def _run_json(capsys, argv) -> tuple[dict, str]:
    """The JSON on stdout and what went to stderr."""
    assert main(argv) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_eval_kl_and_ppl_on_embedded_model(text_file, capsys):
    kl, kl_err = _run_json(capsys, ["eval", "kl", "--text", text_file, "--chunks", "2", "--chunk-len", "48",
                            "--quantization", "mxfp4", "--rule", "noclip", "--activations", "bf16", "--device", "cpu", "--json"])
    assert (kl["chunks"], kl["tokens"]) == (2, 2 * 47)
    # a working 135M model predicts English far better than chance (ppl 49152) and worse than perfect
    assert 3.0 < kl["reference_ppl"] < 300.0
    assert 0.0 < kl["kl"] < 3.0  # 4-bit weights move the distributions, but not to noise
    assert 0.3 < kl["top1_agreement"] < 1.0
    assert kl["results"][0]["label"] == "Q4_1->mxfp4 noclip W4A16"  # the embedded model is Q4_1 GGUF
    ppl, ppl_err = _run_json(capsys, ["eval", "ppl", "--text", text_file, "--chunks", "2", "--chunk-len", "48",
                                      "--device", "cpu", "--json", "--no-progress"])
    assert "tensor/s" in kl_err and "tensor/s" not in ppl_err  # the loading bars, drawn unless --no-progress
    assert "kl" not in ppl and ppl["tokens"] == kl["tokens"]
    # the same 16-bit model on the same chunks: the KL run's reference perplexity
    assert ppl["ppl"] == pytest.approx(kl["reference_ppl"], rel=1e-6)
