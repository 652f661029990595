"""benchmarks/noise_ratios.py's command line (its adam:* columns' weight,
gradcomp.analysis.auto.update_weight, is tested in test_auto.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import noise_ratios  # noqa: E402


def test_digits_distortion_off_the_digits_is_refused(capsys):
    with pytest.raises(SystemExit):
        noise_ratios.main(["--model", "gpt", "--digits-distort", "2"])
    assert "--digits-distort is resnet20's" in capsys.readouterr().err
