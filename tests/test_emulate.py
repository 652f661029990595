"""The emulated-link harness: clear skips where shaping is not permitted, namespaces always removed,
bounded launches, and (as root) one real shaped-link measurement."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gradcomp import emulate
from gradcomp.analysis.calibrate import fit_network
from gradcomp.emulate import EmulationUnavailable, ShapedLink, ShapedNodes, launch_ranks, unavailable_reason

HERE = str(Path(__file__).parent)
shaping = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_not_root_is_a_clear_skip(monkeypatch):
    monkeypatch.setattr(emulate.links.os, "geteuid", lambda: 1000)
    assert "root" in unavailable_reason()
    with pytest.raises(EmulationUnavailable, match="root"):
        ShapedLink(1.0).open()


def test_missing_tools_are_named(monkeypatch):
    monkeypatch.setattr(emulate.links.os, "geteuid", lambda: 0)
    monkeypatch.setattr(emulate.links.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert "tc" in unavailable_reason() and "ip " not in unavailable_reason()


def test_benchmark_skips_cleanly(monkeypatch, capsys):
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "breakeven_validation.py"
    spec = importlib.util.spec_from_file_location("breakeven_validation", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "unavailable_reason", lambda: "emulated links need root")
    assert bench.main(["--quick"]) == 0
    assert "skipped: emulated links need root" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(ValueError, match="rate_gbps"):
        ShapedLink(0.0)
    with pytest.raises(ValueError, match="mtu"):
        ShapedLink(1.0, mtu=100)
    with pytest.raises(ValueError, match="unknown workload 'resnet9000'"):
        emulate.workload("resnet9000", 4)
    with pytest.raises(ValueError, match="cannot import"):
        emulate.workload("no.such.module:factory", 4)


def test_burst_covers_loopback_packets_and_the_timer():
    link = ShapedLink(1.0)
    assert link.burst(0.25) == 4 * 65536                       # never below 4 loopback packets
    assert link.burst(16.0) == int(16e9 / 8 * 0.002)           # 2 ms at the rate


def sleeper(rank, world_size, config):
    import time
    time.sleep(config["seconds"])
    return rank


def failer(rank, world_size, config):
    raise RuntimeError(f"boom on rank {rank}")


def resident_after_free_then_heaps(rank, world_size, config):
    """[MiB this rank holds resident before and after it frees a 64 MiB tensor it wrote, glibc's
    heaps (arenas) in this process after a second thread then allocated a tensor
    (``malloc_info``'s ``<heap nr=...>`` entries)]: the two checks of one launch."""
    import ctypes
    import resource
    import tempfile
    import threading

    import torch

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20

    x = torch.ones(16 * 2 ** 20)  # 64 MiB of fp32, every page written
    held = resident_mib()
    del x
    after = resident_mib()
    thread = threading.Thread(target=lambda: torch.ones(1 << 20))
    thread.start()
    thread.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        stream = ctypes.c_void_p(libc.fopen(f.name.encode(), b"w"))
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        return [held, after, Path(f.name).read_text().count("<heap nr=")]


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_keep_freed_memory_reaches_the_ranks_allocator():
    """glibc maps a 64 MiB tensor on its own and unmaps it when freed (resident memory drops by
    64 MiB); with KEEP_FREED_MEMORY in the ranks' environment the same tensor comes from the
    heap and stays resident, and every thread allocates from that heap (what the break-even
    validation relies on: calibration and training allocating alike). One launch per
    environment measures both (the heaps are counted after the main thread's tensor is freed,
    which allocates from the main arena only)."""
    env = {"PYTHONPATH": HERE}
    (held, after, heaps), = launch_ranks("test_emulate:resident_after_free_then_heaps", 1, {}, timeout_s=120,
                                         env=env)
    assert held - after > 48, "glibc's default should give the tensor back when freed"
    # a second thread (Gloo's, where a collective's callback decodes) gets an arena of its own,
    # unmapped once empty; with the setting every thread shares the one arena that keeps memory
    assert heaps > 1
    (held, after, heaps), = launch_ranks("test_emulate:resident_after_free_then_heaps", 1, {}, timeout_s=120,
                                         env={**env, **emulate.KEEP_FREED_MEMORY})
    assert held - after < 16
    assert heaps == 1


@pytest.mark.slow
def test_launch_is_bounded_and_reports_failures():
    env = {"PYTHONPATH": HERE}
    with pytest.raises(TimeoutError, match="did not finish"):
        launch_ranks("test_emulate:sleeper", 2, {"seconds": 60}, timeout_s=5, env=env)
    with pytest.raises(RuntimeError, match="boom on rank"):
        launch_ranks("test_emulate:failer", 2, {}, timeout_s=60, env=env)


@shaping
def test_namespace_removed_even_on_failure():
    with pytest.raises(KeyError):
        with ShapedLink(1.0) as link:
            assert link.name in namespaces()
            raise KeyError("fail inside")
    assert link.name not in namespaces()


@shaping
@pytest.mark.slow
def test_shaped_link_limits_a_real_allreduce():
    """Two Gloo ranks inside a namespace shaped to 0.5 Gbit/s: an all-reduce between them moves
    both directions through the one loopback queue, so the fitted all-reduce bandwidth is about
    half the rate; unshaped it is far above the rate."""
    sizes = [1 << 14, 1 << 18, 1 << 20]
    config = {"sizes": sizes, "repeats": 2}
    with ShapedLink(0.5) as link:
        shaped = launch_ranks("gradcomp.analysis.calibrate:network_worker", 2, config, link=link, timeout_s=60)[0]
    assert link.name not in namespaces()
    links = fit_network(2, sizes, shaped["allreduce_s"], shaped["allgather_s"])
    assert 0.15 < links["allreduce"].bandwidth_gbps < 0.35
    # the largest all-reduce cannot beat the wire: 2 ranks x 1 MiB through 0.5 Gbit/s
    assert shaped["allreduce_s"][-1] > 0.8 * 2 * (1 << 20) * 8 / 0.5e9


def node_worker(rank: int, world_size: int, config: dict) -> dict:
    """Seconds of an all-reduce of ``config["bytes"]`` inside this rank's node and across nodes:
    the least of REPEATS (load from elsewhere only adds time)."""
    import time

    import torch
    import torch.distributed as dist

    x = torch.ones(config["bytes"] // 4)
    out = {}
    for key, group in zip(("intra", "inter"), emulate.node_groups(world_size // 2)):
        dist.all_reduce(x, group=group)
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            dist.all_reduce(x, group=group)
            seconds.append(time.perf_counter() - start)
        out[key] = min(seconds)
    return out


REPEATS = 3


@shaping
@pytest.mark.slow
def test_shaped_nodes_shape_only_the_link_between_nodes():
    """4 ranks as 2 nodes x 2 joined at 0.2 Gbit/s: a node's two ranks all-reduce over their own
    loopback, far faster than the link; a cross-node all-reduce of 2 MiB between 2 ranks sends
    2 MiB each way through the pair (more time when the two cross-node groups overlap)."""
    nbytes = 2 << 20
    with ShapedNodes(0.2) as link:
        assert all(node in namespaces() for node in link.nodes)
        times = launch_ranks("test_emulate:node_worker", 4, {"bytes": nbytes}, link=link, timeout_s=120,
                             env={"PYTHONPATH": HERE})
    assert not any(node in namespaces() for node in link.nodes)
    wire_s = nbytes * 8 / 0.2e9
    for rank_times in times:
        assert rank_times["inter"] > 0.8 * wire_s
        assert rank_times["intra"] < wire_s / 4
    with pytest.raises(ValueError, match="do not split into 2 equal nodes"):
        link.node_of(0, 3)


def test_hook_options_use_the_hook_states_names():
    assert emulate.hook_options("powersgd", {"rank": 2, "seed": 1}) == {"matrix_rank": 2, "seed": 1}
    assert emulate.hook_options("int8", {"block": 128}) == {"block": 128}
    assert emulate.hook_options("none", {}) == {}


@pytest.mark.slow
def test_train_worker_times_every_hook_with_its_calibration():
    """Unshaped, no namespace: the harness trains under each run and calibrates right before it."""
    config = {"workload": "mlp-small", "batch_size": 4, "bucket_cap_mb": 25, "warmup": 1, "steps": 2,
              "rounds": 1, "calibrate": {"repeats": 1, "network_sizes": [4096, 65536], "sizes": [4096, 65536]},
              "runs": [["none", "allreduce", {}], ["int8", "twophase", {}], ["powersgd", "lowrank", {"rank": 2}]]}
    results = launch_ranks("gradcomp.emulate:train_worker", 2, config, timeout_s=120,
                           env={"GRADCOMP_CPU_COMPILE": "0"})
    for r in results:
        assert [len(times) for times in r["steps"]["int8:twophase"]] == [2]
        assert set(r["calibration"]) == {"none", "int8:twophase", "powersgd"}
        # PowerSGD's hook is timed on the model's own buckets: a cost per parameter element
        psgd = r["calibration"]["powersgd"][0]["method"]
        assert psgd["compress"]["fixed_s"] == 0 and psgd["compress"]["per_element_s"] > 0
        assert "method" in r["calibration"]["int8:twophase"][0] and "method" not in r["calibration"]["none"][0]
        assert r["calibration"]["none"][0]["compute"]["backward_s"] > 0
        # the launch's collective sweep times each collective the hooks issue, at every size
        assert [len(r["network"][k]) for k in ("allreduce_s", "allgather_s", "reduce_scatter_s")] == [2, 2, 2]
        assert min(r["network"]["reduce_scatter_s"]) > 0
    assert emulate.median_step_s(results, "none") > 0
