"""benchmarks/time_to_target_validation.py: the measured side against a hand computation on
synthetic runs, the prediction's arithmetic, and "not reached" carried through as a result on both
sides (the calibration's own smoke run is in tests/test_scripts.py's SMOKE)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import time_to_target_validation as ttt  # noqa: E402

BASE = [(10, 3.0), (20, 2.0), (30, 1.5)]  # target 1.5 x 1.01 = 1.515: first at or below at step 30
LINK = [0.5, 0.1, 0.2, 0.3]  # the link run's 4 steps, one block: each at its median, 0.25 s; later
# steps at the median of the last 2, 0.25 s


def test_measured_side_is_the_hand_computation(tmp_path):
    """3 seeds: the method reaches 1.515 at step 20, never, and at step 30; each priced at the link
    run's block median (0.25 s a step); the median counts "never" as the largest."""
    for seed, curve in ((0, [(10, 2.5), (20, 1.51), (30, 1.5)]), (1, [(10, 2.5), (20, 1.9), (30, 1.6)]),
                        (2, [(10, 2.5), (20, 1.6), (30, 1.515)])):
        ttt.write_synthetic_runs(tmp_path, "gpt", {"none": BASE, "int8": curve}, {"none": LINK, "int8": LINK},
                                 seed=seed)
    m = ttt.measured_side(tmp_path / "results", tmp_path / "links", "gpt", "none", "int8")
    assert [(s["seed"], s["steps"], s["reached"]) for s in m["per_seed"]] == [(0, 20, True), (1, None, False),
                                                                             (2, 30, True)]
    by_hand = {0: 20 * 0.25, 2: 30 * 0.25}  # 5 s and 7.5 s
    assert [s["seconds"] for s in m["per_seed"]] == [pytest.approx(by_hand[0]), None, pytest.approx(by_hand[2])]
    assert m["status"] == "reached" and m["steps"] == 30 and m["baseline_steps"] == 30
    assert m["steps_factor"]["value"] == pytest.approx(1.0)  # median of 20/30, never, 30/30
    assert m["time_s"] == pytest.approx(7.5) and m["step_s"] == pytest.approx(0.25)
    assert m["per_seed"][0]["target"] == pytest.approx(1.515)

    # the target 10% above (a calibration whose null ends that far away): 1.65, which seed 1 reaches at 30
    m = ttt.measured_side(tmp_path / "results", tmp_path / "links", "gpt", "none", "int8", tolerance=0.1)
    assert [(s["steps"], s["baseline_steps"]) for s in m["per_seed"]] == [(20, 30), (30, 30), (20, 30)]
    assert m["per_seed"][0]["target"] == pytest.approx(1.65)
    ttt.write_quality_file(tmp_path / "q.json", {"int8": ([(5, 3.0), (10, 2.0)], [(5, 3.0), (10, 2.0)])})
    assert ttt.target_of([tmp_path / "absent.json", tmp_path / "q.json"]) == (0.01, ttt.TARGET_RULE)
    table = json.loads((tmp_path / "q.json").read_text())
    (tmp_path / "q.json").write_text(json.dumps({**table, "target_tolerance": 0.1, "target_rule": "+ 10%"}))
    assert ttt.target_of([tmp_path / "q.json"]) == (0.1, "+ 10%")

    # two seeds of three never reach it: the median is "not reached", with no time
    ttt.write_synthetic_runs(tmp_path, "gpt", {"int8": [(10, 2.5), (20, 1.9), (30, 1.6)]}, {}, seed=2)
    m = ttt.measured_side(tmp_path / "results", tmp_path / "links", "gpt", "none", "int8")
    assert m["status"] == "not reached" and m["time_s"] is None and m["steps"] is None
    assert m["steps_factor"] == {"value": None, "reached": False, "within": 1.0, "steps": None,
                                 "baseline_steps": None, "target": None}


def _folder(tmp_path):
    """One seed: none reaches the target at 30, int8 at 20, top-k never; the calibration file says
    int8 1.0x, top-k not reached, fp16 not reached; PowerSGD rank 1 has no row."""
    never = [(10, 2.9), (20, 2.8), (30, 2.7)]
    curves = {"none": BASE, "int8": [(10, 2.5), (20, 1.5), (30, 1.5)], "topk-1pct": never, "fp16": BASE,
              "powersgd-r1": BASE}
    ttt.write_synthetic_runs(tmp_path, "gpt", curves, {c: LINK for c in curves})
    short = [(5, 3.0), (10, 2.0)]
    ttt.write_quality_file(tmp_path / "quality.json", {"int8": (short, [(5, 3.0), (10, 2.0)]),
                                                       "topk-1pct": (short, [(5, 3.0), (10, 2.9)]),
                                                       "fp16": (short, [(5, 3.0), (10, 2.5)])})
    return SimpleNamespace(models=["gpt"], links=["none"], calibrations=tmp_path / "none-here",
                           results=tmp_path / "results", link_runs=tmp_path / "links",
                           quality=[tmp_path / "quality.json"], configs=list(curves))


def test_not_reached_propagates_on_both_sides(tmp_path):
    """A factor the calibration gives as not reached is a predicted "not reached" (no time), with
    or without a step-time calibration; it agrees only with a measured not reached; a
    configuration without a calibration row is "quality unmeasured": every row counted."""
    result = ttt.report(_folder(tmp_path))
    link = result["models"]["gpt"]["links"]["none"]
    rows = {r["config"]: r for r in link["rows"]}
    assert rows["topk-1pct"]["predicted"]["status"] == "not reached"
    assert "time_s" not in rows["topk-1pct"]["predicted"] and rows["topk-1pct"]["measured"]["status"] == "not reached"
    assert rows["topk-1pct"]["agreement"] == "both not reached" and rows["topk-1pct"]["ratio"] is None
    assert rows["fp16"]["agreement"] == "predicted not reached, measured reached"
    assert rows["powersgd-r1"]["agreement"] == "no prediction (quality unmeasured)"
    assert rows["powersgd-r1"]["predicted"]["source"] is None
    # no step-time calibration here: a reached factor has no time
    assert rows["int8"]["agreement"] == "no prediction (no calibration)"
    assert link["score"]["rows"] == 5 and link["score"]["agree"] == 1 and not link["score"]["met"]
    assert sum(link["score"]["counts"].values()) == 5


def test_prediction_arithmetic_and_best(tmp_path, monkeypatch):
    """Predicted time = analyser step x calibration factor x the uncompressed run's steps to
    target; the ratio, the 25% band and the best method; the references scored on the same rows."""
    args = _folder(tmp_path)
    steps = {"none": 0.3, "int8": 0.2, "topk-1pct": 0.05, "fp16": 0.25, "powersgd-r1": 0.1}
    monkeypatch.setattr(ttt, "load_calibration", lambda folder, model, rate: {"stub": True})
    monkeypatch.setattr(ttt, "calibration_path", lambda folder, model, rate: ROOT / "stub.json")
    monkeypatch.setattr(ttt, "predicted_steps", lambda calibration, host: steps)
    link = ttt.report(args)["models"]["gpt"]["links"]["none"]
    rows = {r["config"]: r for r in link["rows"]}
    measured_none = 30 * 0.25  # 30 steps over the link: 7.5 s
    assert rows["none"]["predicted"]["time_s"] == pytest.approx(0.3 * 1.0 * 30)
    assert rows["none"]["ratio"] == pytest.approx(9.0 / measured_none) and rows["none"]["agreement"] == "within"
    # int8: 0.2 s x 1.0 x 30 = 6 s predicted; measured 20 steps: 20 x 0.25 = 5 s
    assert rows["int8"]["predicted"]["time_s"] == pytest.approx(6.0)
    assert rows["int8"]["ratio"] == pytest.approx(6.0 / 5.0) and rows["int8"]["within_25pct"]
    # top-k: the fastest step, but not reached: never the predicted best
    best = link["score"]["best"]
    assert best["predicted_best"] == "int8" and best["measured_best"] == "int8" and best["met"]
    assert link["score"]["agree"] == 3  # none, int8 within; top-k both not reached
    refs = link["references"]
    assert refs["always uncompressed"]["best"]["predicted_best"] == "none"
    assert refs["always uncompressed"]["best"]["over_measured_best"] == pytest.approx(measured_none / 5.0)
    assert not refs["always uncompressed"]["best"]["met"]  # 49% slower than int8
    # step time alone (every factor 1): top-k's 0.05 s step makes it the pick; it never reaches
    assert refs["step time only"]["best"]["predicted_best"] == "topk-1pct"
    assert refs["step time only"]["best"]["met"] is False


@pytest.mark.parametrize("ratio, kind", [(1.25, "within"), (0.75, "within"), (1.26, "outside"), (0.74, "outside")])
def test_agreement_band(ratio, kind):
    predicted = {"status": "reached", "time_s": ratio * 10.0}
    assert ttt.agreement(predicted, {"status": "reached", "time_s": 10.0}) == (kind, pytest.approx(ratio))


def test_choice_of_runner_configurations():
    assert ttt.choice_of("topk-1pct").options == {"ratio": 0.01}
    assert ttt.choice_of("powersgd-r2").options == {"rank": 2}
    assert ttt.choice_of("int8").label == "int8:allgather"
    with pytest.raises(ValueError, match="error feedback"):
        ttt.choice_of("sign-noef")


def test_the_compute_is_pooled_over_configurations():
    """Every configuration's compute and averaging pass is a sample of the same work: the median
    over all configurations and ranks (here 1, 3 and 2 ms of forward: 2), not each its own."""
    def measured(forward_s):
        return [{"compute": {"forward_s": forward_s, "backward_s": 2 * forward_s, "optimizer_s": 0.001},
                 "average": {"fixed_s": forward_s / 10, "per_element_s": 1e-9}}]

    calibration = {"configs": ["none", "int8"],
                   "ranks": [{"calibration": {"none": measured(0.001), "int8": measured(0.003)}},
                             {"calibration": {"none": measured(0.002), "int8": measured(0.002)}}]}
    compute, average = ttt.pooled_work(calibration)
    assert (compute.forward_s, compute.backward_s, compute.optimizer_s) == (0.002, 0.004, 0.001)
    assert (average.fixed_s, average.per_element_s) == (0.0002, 1e-9)
