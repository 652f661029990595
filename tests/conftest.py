"""Test-session setup: tests/ on the import path, and the scheduling marks for pytest-xdist.

scripts/test.sh runs the suite in two phases: every test not marked ``serial`` on 2 xdist
workers (``--dist loadgroup``), then the ``serial`` ones alone, because they time real work
against a prediction or a bound and a second worker's load would move their clocks. A test
that uses a module- or class-scoped fixture (one multi-rank launch shared by its tests) is
grouped with its module, so that the launch runs once, on one worker.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SERIAL_MODULES = {"test_calibration_drift", "test_auto"}
"""Modules whose every test times work (calibration against training, the auto hook's measured
choices)."""
SERIAL_TESTS = {"test_measure_latency_averages_calls_issued_after_compute",
                "test_a_live_sweep_measures_each_collectives_latency",
                "test_measure_compute_prices_the_gradient_zeroing_as_the_optimizer_phase",
                "test_calibrate_then_breakeven", "test_calibrate_in_a_live_process_group",
                "test_shaped_link_limits_a_real_allreduce", "test_shaped_nodes_shape_only_the_link_between_nodes"}
"""Tests elsewhere that time work against a bound (shaped links, measured latencies). Tests that
only wait (a wall limit, a launch's timeout) run in the parallel phase, where the wait overlaps
other work."""


def pytest_configure(config):
    """Remember the environment before any test changes it: the test ranks' forkserver starts
    under it (dist_utils.remember_environment)."""
    import dist_utils
    dist_utils.remember_environment()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it appends them to node ids)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in SERIAL_MODULES or item.originalname in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)
        info = getattr(item, "_fixtureinfo", None)
        # session fixtures (tmp_path_factory, ...) are per worker anyway: no reason to group
        if info is not None and any(defs[-1].scope in ("module", "class", "package")
                                    for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(module))
