"""Test-session setup: tests/ on the import path, and the scheduling marks for pytest-xdist.

scripts/test.sh runs the suite in two phases: every test not marked ``serial`` on 2 xdist
workers (``--dist loadgroup``), then the ``serial`` ones alone, because they time real work
against a prediction or a bound and a second worker's load would move their clocks. A test
that uses a module- or class-scoped fixture (one multi-rank launch shared by its tests) is
grouped with its module, so that the launch runs once, on one worker.
"""
import faulthandler
import os
import signal
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
LONG_TESTS = {
    "test_modules_under_interpreter": 85, "test_one_inductor_cache_serves_avx512_and_avx2_processes_correctly": 45,
    "test_bash_lines_run_here": 38, "test_benchmark_smoke_run": 30,
    "test_the_prepared_gpu_call_runs_dry_without_a_gpu": 20,
    "test_experiment_run_report_and_curves": 18, "test_calibrate_quality_cli_writes_a_file_breakeven_reads": 11,
    "test_each_integration_is_an_attribute_after_import_gradcomp_and_loads_its_framework_only_then": 11,
    "test_the_torchrun_example_trains_and_reports": 10,
    "test_launch_is_bounded_and_reports_failures": 9, "test_train_worker_times_every_hook_with_its_calibration": 9,
    "test_multi_bucket_steps_compile_each_function_once": 9,
    "test_lightning_checkpoint_restores_every_ranks_hook_state": 9,
    "test_a_run_over_an_emulated_link_trains_the_same_slower": 8,
}
"""Tests of the parallel phase that take 8 s or more (seconds of its slowest parametrization on 2
busy cores; module-grouped tests aside): under xdist they are collected first, longest first, so
that the workers finish together instead of one running a 30 s test from the end of the
collection (tests/test_scripts.py) while the other waits. A scheduling hint only: a name that
is gone or a new long test not named here changes nothing but the order."""


def pytest_configure(config):
    """Remember the environment before any test changes it: the test ranks' forkserver starts
    under it (dist_utils.remember_environment). A SIGTERM (scripts/test.sh's wall limit) prints
    every thread's stack before the process ends, so a phase that hangs says where."""
    import dist_utils
    dist_utils.remember_environment()
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    _refuse_gloo_groups_in_this_process()


def _refuse_gloo_groups_in_this_process() -> None:
    """Gloo process groups live in rank processes (dist_utils.run_ranks), never in a pytest
    process: a group whose last reference goes on one of its own worker threads (a Future
    callback's closure, a cycle collected there) joins that thread from itself and aborts the
    whole process ("Resource deadlock avoided"), which killed an xdist worker mid-suite. The CUDA
    modules' one-rank NCCL group (kernel_utils.nccl_group_on_cuda0) is allowed."""
    import torch.distributed as dist

    pytest_pid, real = os.getpid(), dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if os.getpid() == pytest_pid and backend != "nccl":
            raise RuntimeError("a test created a process group in the pytest process: run it on ranks "
                               "(tests/dist_utils.run_ranks, world_size=1 for one rank)")
        return real(backend, *args, **kwargs)
    dist.init_process_group = init_process_group


def pytest_ignore_collect(collection_path, config):
    """The serial phase (``-m serial``) imports only the test modules that can hold a serial
    test: those in SERIAL_MODULES, and those whose source names a SERIAL_TESTS test or says
    "serial" (a mark of its own); importing the other 60-odd to deselect all their tests took 5 s
    of that phase's 13 s of collection. Likewise ``-m cuda`` (benchmarks/gpu_call.sh, and its dry
    run in tests/test_scripts.py) imports only the modules whose source says "cuda" (the mark is
    given in the module only; nothing here adds it): the same CUDA tests, collected in 3 s
    instead of 10."""
    markexpr = config.getoption("markexpr", "")
    if markexpr not in ("serial", "cuda") or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    text = collection_path.read_text()
    if markexpr == "cuda":
        return None if "cuda" in text else True
    if collection_path.stem in SERIAL_MODULES:
        return None
    return None if "serial" in text or any(name in text for name in SERIAL_TESTS) else True


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
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order
        _long_tests_first(items)


def _long_tests_first(items) -> None:
    """LONG_TESTS to the front of ``items``, longest first (the others keep their order). xdist's
    loadgroup scheduler hands out the module groups first (largest first), then single tests in
    collection order, a few at a time per worker. Grouped tests stay where they are: moving one
    would split its module's run of a module-scoped fixture."""
    def seconds(item):
        return 0 if item.get_closest_marker("xdist_group") else LONG_TESTS.get(item.originalname, 0)

    items[:] = sorted(items, key=lambda item: -seconds(item))  # stable: the rest keep their order
