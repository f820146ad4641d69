"""`radiance convert` follow-ups of the fifty-fifth session: the MXFP4 rule recorded in a converted checkpoint's
quantization_config is the one that chose its block exponents. Converting an MXFP4 checkpoint to MXFP4 copies its
linears as they are, so a --rule given then did nothing: it is said, and the source's own record is kept (the new
rule was written before, though no exponent had been chosen by it)."""

from __future__ import annotations

import json
import logging

from radiance.cli import main
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir


def _recorded_rule(path) -> str | None:
    config = json.loads((path / "config.json").read_text())
    return (config["quantization_config"].get("radiance") or {}).get("mxfp4_rule")


def test_the_rule_that_requantized_is_recorded(tmp_path):
    src = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY)
    assert main(["convert", src, str(tmp_path / "ocp"), "--rule", "ocp", "--no-progress"]) == 0
    assert _recorded_rule(tmp_path / "ocp") == "ocp"


def test_an_mxfp4_source_keeps_its_rule_and_a_new_one_is_said_to_do_nothing(tmp_path, caplog):
    src = write_dir(str(tmp_path / "src"), dense_state_dict(), TINY)
    assert main(["convert", src, str(tmp_path / "ocp"), "--rule", "ocp", "--no-progress"]) == 0
    with caplog.at_level(logging.WARNING, logger="radiance.checkpoint.writer"):
        assert main(["convert", str(tmp_path / "ocp"), str(tmp_path / "again"), "--rule", "noclip",
                     "--no-progress"]) == 0
    assert _recorded_rule(tmp_path / "again") == "ocp"
    assert "--rule noclip did nothing" in caplog.text and "converted with rule ocp" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radiance.checkpoint.writer"):  # no --rule given: nothing to say
        assert main(["convert", str(tmp_path / "ocp"), str(tmp_path / "plain"), "--no-progress"]) == 0
    assert _recorded_rule(tmp_path / "plain") == "ocp" and "did nothing" not in caplog.text
