"""The runs of the emulated break-even validation: every registered method with each of the schemes
it offers is a run the training worker takes, its label names it back, and the benchmark's runs
are such runs (a renamed scheme fails here, not in a user's hour-long validation)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import gradcomp
from gradcomp.analysis import Choice
from gradcomp.analysis.costmodel import schemes
from gradcomp.emulate import train_worker

EVERY_RUN = [(method, scheme) for method in ("none", *gradcomp.METHODS) for scheme in schemes(method)]


@pytest.mark.parametrize("method, scheme", EVERY_RUN)
def test_every_method_and_scheme_is_a_choice_its_label_names(method, scheme):
    choice = Choice(method, {}, scheme)
    assert (choice.method, choice.scheme) == (method, scheme)
    assert Choice.parse(choice.label) == choice


def test_the_training_worker_takes_every_run():
    """rounds 0: the worker builds each run's Choice and label, and trains none of them."""
    runs = [[method, scheme, {}] for method, scheme in EVERY_RUN]
    assert train_worker(0, 1, {"runs": runs, "rounds": 0})["steps"] == {}
    with pytest.raises(ValueError, match="powersgd has no scheme 'powersgd'; it offers lowrank"):
        train_worker(0, 1, {"runs": [["powersgd", "powersgd", {}]], "rounds": 0})


def _validation_benchmark():
    path = Path(__file__).parent.parent / "benchmarks" / "breakeven_validation.py"
    spec = importlib.util.spec_from_file_location("breakeven_validation", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # builds RUNS: a scheme a method does not offer raises here
    return bench


def test_the_validation_benchmark_runs_are_offered_schemes():
    bench = _validation_benchmark()
    labels = [choice.label for choice in bench.RUNS]
    assert labels == ["none", "fp16", "int8:allgather", "int8:twophase", "sign:allgather", "topk", "powersgd"]
    node_labels = [choice.label for choice in bench.NODE_RUNS]
    assert node_labels == ["none", "int8:allgather", "hier:int8:allgather", "hier:int8:twophase", "hier:fp16",
                           "hier:sign:allgather"]


def test_the_training_worker_takes_hierarchical_runs():
    """A run's fourth field asks for the hierarchical hook: its label says so (rounds 0)."""
    runs = [["int8", "twophase", {}, True], ["int8", "allgather", {}]]
    assert train_worker(0, 1, {"runs": runs, "rounds": 0, "node_size": 1})["steps"] == {}
    with pytest.raises(ValueError, match="none has no hierarchical form"):
        train_worker(0, 1, {"runs": [["none", "allreduce", {}, True]], "rounds": 0})


def test_a_runs_profile_is_the_median_ranks():
    """The ranks run the same work; a collective's wait for the slowest of them is sync_wait, so
    each calibrated number is the median over the ranks, not the slowest rank's."""
    bench = _validation_benchmark()

    def rank(forward_s, per_element_s):
        line = {"fixed_s": 0.0, "per_element_s": per_element_s}
        return {"calibration": {"int8:allgather": [{
            "compute": {"forward_s": forward_s, "backward_s": 2 * forward_s, "optimizer_s": 0.001},
            "average": line, "method": {"compress": line, "decompress": line}}]}}

    profile = bench.run_profile([rank(0.010, 1e-9), rank(0.030, 5e-9), rank(0.012, 2e-9)], 3, "int8:allgather", 0)
    assert (profile.compute.forward_s, profile.compute.backward_s) == (0.012, 0.024)
    assert profile.methods["int8"].compress.per_element_s == 2e-9
    assert profile.average.per_element_s == 2e-9


def test_fitted_links_refuse_launches_no_slower_at_lower_rates():
    """Equal seconds per byte at 1 and 2 Gbit/s (the same Link object: exactly equal, on every
    CPU) are refused by comparing the lowest and the highest rate's seconds per byte, whatever
    sign the least-squares slope of ~1e-24 rounds to on a CPU; a slower lower rate is fitted."""
    bench = _validation_benchmark()
    from gradcomp.analysis.collectives import Link

    same = Link("same", 2.1622, 250.0)
    launch = {"network": {kind: same for kind in ("allreduce", "allgather", "reduce_scatter")}}
    with pytest.raises(ValueError, match="network allreduce link is no slower at lower rates"):
        bench.fitted_links([1.0, 2.0], [launch, launch], None)
    slower = {"network": {kind: Link("slower", 1.0, 250.0) for kind in launch["network"]}}
    fitted = bench.fitted_links([1.0, 2.0], [slower, launch], None)["network"]["allreduce"]
    # the line through (1/rate, beta) = (1, 8e-9) and (0.5, same.beta_s): its slope per 1/rate is
    # the wire's seconds per byte at 1 Gbit/s; its intercept (negative here) clipped to 0
    assert fitted.per_byte_s == 0.0
    assert fitted.beta_s == pytest.approx(2 * (8e-9 - same.beta_s), rel=1e-9)
