"""examples/experiment.py --fsdp: the GPT under FSDP2 with gradcomp.fsdp compressing its
reduce-scatter (a tiny 2-rank run), and the options it refuses."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import data, experiment  # noqa: E402

TINY = ["run", "--model", "gpt", "--n-layer", "1", "--d-model", "32", "--context", "16", "--batch-size", "4",
        "--world-size", "2", "--steps", "6", "--eval-every", "3", "--eval-windows", "8", "--quiet", "--fsdp"]


def test_gpt_trains_under_fsdp_with_int4_reduce_scatter(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(data.stdlib_corpus(60_000))
    experiment.main([*TINY, "--text", str(text), "--hook", "int4", "--out", str(tmp_path / "int4")])
    summary = json.loads((tmp_path / "int4" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_heldout_loss"] < 5.4  # from ln(256) = 5.55
    assert 7.5 < summary["compression_ratio"] < 7.8  # int4 rows: n / 2 + 4 n / 256 bytes
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["fsdp"] is True


@pytest.mark.parametrize("extra", [["--hook", "powersgd"], ["--optimizer", "dgc"], ["--resume"]])
def test_fsdp_refuses_what_it_cannot_run(tmp_path, extra):
    args = experiment.build_parser().parse_args([*TINY, "--out", str(tmp_path), *extra])
    with pytest.raises(ValueError, match="--fsdp takes"):
        experiment.resolve_defaults(args)
