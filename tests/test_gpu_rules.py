"""The GPU's rules for the fronts, held on CPU (docs/kernels.md, "GPU rules held on CPU").

(a) Device discipline: every tensor a front creates takes its device from the data (NCCL takes
only tensors on the group's GPU: a device-less ``torch.tensor([...])`` handed to a collective
fails there with "No backend type associated with device type cpu"). Each front's body runs
here under a meta default device (``with torch.device("meta")``, entered inside the hook or
call: the context reaches neither autograd's threads nor communication callbacks), on 2 Gloo
ranks with CPU data: a tensor made without ``device=`` becomes meta and fails loudly at its
host read, or at its collective: Gloo would pass a meta tensor through ``all_reduce`` or
``all_gather_into_tensor`` silently, so every collective the ranks call is checked
(:func:`collectives_check_devices`: any tensor not on the data's device raises), and a faulty
control front that breaks the rule must fail.

Timings: on CUDA every front times with CUDA events (gradcomp.comm.mark), never host clocks
(an NCCL collective's Future completes at enqueue); HookStats holds a bounded number of them.
The host-synchronisation count of a warm step is tests/interpreted/test_host_syncs.py (it needs
the kernels' path, under the Triton interpreter).
"""
from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_models import batch, build_model, make_ddp
from dist_utils import run_ranks

from gradcomp import comm, consistency, get_method
from gradcomp.fsdp import CompressedReduceScatter, CompressedReplicaAllReduce
from gradcomp.hooks import (AutoState, HierarchicalState, HookStats, allreduce_hook, auto_hook,
                            hierarchical_hook, hook_for)
from gradcomp.hooks import stats as stats_module
from gradcomp.optim import DGC, DiLoCo, ZeroOneAdam
from gradcomp.optim.exchange import Exchange

STEPS = 4
DDP_FRONTS = [
    # (label, hook method or "hierarchical" / "auto", state options)
    ("allreduce", "none", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int8_twophase", "int8", {"scheme": "twophase"}),
    ("int4", "int4", {}),
    ("sign", "sign", {}),
    ("sign_twophase", "sign", {"scheme": "twophase", "chunk": 64}),
    ("topk", "topk", {"ratio": 0.05}),
    ("topk_threshold", "topk", {"ratio": 0.05, "selector": "threshold", "sample": 64}),
    ("powersgd", "powersgd", {"matrix_rank": 2}),
    ("hierarchical_inter", "hierarchical", {"method": "int8", "node_size": 1}),
    ("hierarchical_intra", "hierarchical", {"method": "int8", "node_size": 2}),
    ("hierarchical_twophase", "hierarchical", {"method": "sign", "scheme": "twophase", "node_size": 1}),
    ("auto", "auto", {"methods": ("none", "int8"), "warmup_steps": 2, "evaluate_every": 1,
                      "window_steps": 1}),
]


def under_meta(fn):
    """``fn`` with its body run under a meta default device (a device-less tensor becomes meta)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.device("meta"):
            return fn(*args, **kwargs)
    return wrapped


COLLECTIVES = ("all_reduce", "all_to_all_single", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single")
"""The torch.distributed collectives checked (every one gradcomp calls, under either spelling);
gradcomp.comm's and gradcomp.consistency's own names for them are checked too."""


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


@contextlib.contextmanager
def collectives_check_devices(device="cpu"):
    """Inside the block every collective raises if handed a tensor off ``device`` (the data's):
    what NCCL does with a tensor off the group's GPU, and Gloo does not do with a meta one."""
    saved = []

    def checked(name, collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            for t in _tensors((args, kwargs)):
                if t.device != torch.device(device):
                    raise RuntimeError(f"{name} was handed a tensor on {t.device}, not the data's "
                                       f"device {device}")
            return collective(*args, **kwargs)
        return call

    targets = [(dist, name) for name in COLLECTIVES if hasattr(dist, name)]
    targets += [(comm, "all_gather_into"), (comm, "reduce_scatter_into"), (consistency, "all_gather_into")]
    for module, name in targets:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, checked(name, getattr(module, name)))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _faulty_hook(state, bucket):
    """A control front that breaks the rule: a device-less tensor that only feeds a collective."""
    count = torch.ones(1)  # no device=: meta under the test's default device
    dist.all_reduce(count)
    return allreduce_hook(state, bucket)


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def ddp_front_state(method, options, rank):
    """(state, hook) of one of DDP_FRONTS on this rank (auto's cost cache in a fresh folder)."""
    if method == "hierarchical":
        return HierarchicalState(None, **options), hierarchical_hook
    if method == "auto":
        cache = Path(tempfile.mkdtemp(prefix="gradcomp-costs-")) / f"rank{rank}.json"
        return AutoState(None, cache=cache, **options), auto_hook
    hook, state_cls = hook_for(method)
    return state_cls(None, **options), hook


def _train_under_meta(rank, state, hook) -> str | None:
    """None when STEPS steps ran with ``hook`` under a meta default device, else the error."""
    ddp = make_ddp(build_model())
    state.bind(ddp)
    ddp.register_comm_hook(state, under_meta(hook))
    try:
        for step in range(STEPS):
            x, y = batch(step, rank)
            F.cross_entropy(ddp(x), y).backward()
        return None
    except Exception as exc:  # the same failure on every rank at the same collective
        return _failure(exc)


def _every_ddp_hook_under_meta(rank, world):
    """Per DDP front: None when STEPS training steps ran with its hook under a meta default
    device and checked collectives, else the error; the auto hook's decisions (it must have
    evaluated); and the faulty control front, with and without the collectives' check."""
    out = {}
    with collectives_check_devices():
        for label, method, options in DDP_FRONTS:
            state, hook = ddp_front_state(method, options, rank)
            out[label] = _train_under_meta(rank, state, hook)
            if method == "auto":
                out["auto_decisions"] = len(state.stats()["decisions"])
        out["faulty"] = _train_under_meta(rank, ddp_front_state("none", {}, rank)[0], _faulty_hook)
    out["faulty_unchecked"] = _train_under_meta(rank, ddp_front_state("none", {}, rank)[0], _faulty_hook)
    return out


def test_every_ddp_hook_creates_its_tensors_on_the_bucket_device():
    results = run_ranks(_every_ddp_hook_under_meta, 2, timeout_s=120)
    for rank, result in enumerate(results):
        failures = {label: result[label] for label, _, _ in DDP_FRONTS if result[label] is not None}
        assert failures == {}, f"rank {rank}: fronts that made a tensor without the bucket's device"
        assert result["auto_decisions"] >= 1  # the evaluation (link probe, agreed costs) ran
        # the control: its meta tensor reaches a collective; only the check sees it (Gloo does not)
        assert "all_reduce was handed a tensor on meta" in result["faulty"], result["faulty"]
        assert result["faulty_unchecked"] is None, result["faulty_unchecked"]


def _fsdp_comms_under_meta(rank, world):
    """Per method: None when two calls of each FSDP collective (the configuration check, then a
    warm call) ran under a meta default device and checked collectives, else the error."""
    group, out = dist.group.WORLD, {}
    for name in ("int8", "sign", "topk", "fp16"):
        with collectives_check_devices():
            out[name] = _fsdp_comm_calls(name, group, rank, world)
    return out


def _fsdp_comm_calls(name, group, rank, world) -> str | None:
    """None when two calls of each FSDP collective of method ``name`` ran under a meta default
    device, else the error."""
    method = get_method(name)
    scatter = CompressedReduceScatter(method, True, HookStats(), "layer")
    replica = CompressedReplicaAllReduce(method, True, HookStats(), "layer", group)
    rows = torch.randn(world, 300, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(2):
            shard = torch.empty(300)
            under_meta(scatter)(shard, rows, group, dist.ReduceOp.AVG)
            under_meta(replica)(shard)
        return None
    except Exception as exc:
        return _failure(exc)


def test_fsdp_collectives_create_their_tensors_on_the_data_device():
    for rank, result in enumerate(run_ranks(_fsdp_comms_under_meta, 2, timeout_s=120)):
        assert {k: v for k, v in result.items() if v is not None} == {}, f"rank {rank}"


EXCHANGES = [(None, ""), ("fp16", "allreduce"), ("int8", "allgather"), ("int8", "twophase"),
             ("sign", "twophase"), ("topk", "allgather")]


def _optimizers_under_meta(rank, world):
    """Per exchange (each scheme of Exchange.mean) and optimizer: None when its steps ran under a
    meta default device (ZeroOneAdam through warm-up, compressed and local steps, both update
    modes; DGC with clipping), else the error."""
    with collectives_check_devices():
        return _optimizer_steps(rank)


def _optimizer_steps(rank):
    out = {}
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    for method, scheme in EXCHANGES:
        label = f"exchange {method}:{scheme}"
        try:
            for _ in range(2):
                under_meta(Exchange().mean)(x, method, scheme, "v")
            out[label] = None
        except Exception as exc:
            out[label] = _failure(exc)
    makers = {
        "ZeroOneAdam shared": lambda ps, m: ZeroOneAdam(ps, m, warmup_steps=1, sync_every=2),
        "ZeroOneAdam own": lambda ps, m: ZeroOneAdam(ps, m, warmup_steps=1, sync_every=2,
                                                     local_updates="own", var_refresh_interval=1),
        "DGC": lambda ps, m: DGC(ps, m, density=0.05, clip_norm=0.1),
        "DiLoCo": lambda ps, m: DiLoCo(ps, m, sync_every=2, method="int4"),
        "DiLoCo streaming": lambda ps, m: DiLoCo(ps, m, sync_every=2, fragments=2, method="sign", scheme="twophase"),
    }
    for label, make in makers.items():
        model = build_model()
        optimizer = make(list(model.parameters()), model)
        try:
            for step in range(STEPS):
                x, y = batch(step, rank)
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                under_meta(optimizer.step)()
            out[label] = None
        except Exception as exc:
            out[label] = _failure(exc)
    return out


def test_optimizer_exchanges_create_their_tensors_on_the_parameters_device():
    for rank, result in enumerate(run_ranks(_optimizers_under_meta, 2, timeout_s=120)):
        assert {k: v for k, v in result.items() if v is not None} == {}, f"rank {rank}"


# ---- timings: device time on CUDA, bounded statistics ------------------------------------------

class FakeEvent:
    """Stands in for torch.cuda.Event on one stream: events are recorded at ticks 1, 2, ... of a
    fake device clock; the device has finished every event up to ``reached`` (``query``);
    ``synchronize`` waits until the device reaches the event (counted when it had not yet)."""

    clock = reached = 0.0
    waits = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def query(self):
        return self.at <= FakeEvent.reached

    def synchronize(self):
        FakeEvent.waits += not self.query()  # a wait that blocks the host
        FakeEvent.reached = max(FakeEvent.reached, self.at)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time of an unfinished event"
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


@pytest.fixture
def fake_cuda_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.clock = FakeEvent.reached = 0.0
    FakeEvent.waits = 0
    return FakeEvent


@pytest.mark.parametrize("device", [torch.device("cuda", 0), "cuda", torch.device("cuda")])
def test_cuda_devices_are_timed_with_events(device, fake_cuda_events):
    assert comm.times_with_cuda_events(device)
    start = comm.mark(device)
    assert isinstance(start, FakeEvent) and start.at is not None  # recorded, not a host clock
    end = comm.mark(device)
    assert comm.elapsed_s(start, end) == 1.0  # 1 fake second apart; read after waiting
    assert fake_cuda_events.waits == 1


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), torch.device("meta")])
def test_other_devices_are_timed_with_the_host_clock(device, fake_cuda_events):
    assert not comm.times_with_cuda_events(device)
    start = comm.mark(device)
    assert isinstance(start, float)
    assert comm.elapsed_s(start, comm.mark(device)) >= 0.0


def test_stats_fold_finished_cuda_intervals_past_the_bound(fake_cuda_events, monkeypatch):
    """Intervals whose events the device has passed are folded into the totals once the bound
    is reached (query, no wait); unfinished ones stay pending; none is lost."""
    monkeypatch.setattr(stats_module, "MAX_PENDING_INTERVALS", 8)
    stats = HookStats()
    fake_cuda_events.reached = 24.0  # the device has finished the first 12 intervals' events
    for _ in range(20):
        stats.add_interval("comm_s", comm.mark("cuda"), comm.mark("cuda"))
        assert len(stats._pending) <= 8
    assert fake_cuda_events.waits == 0  # folding finished intervals never waited
    assert stats.totals["comm_s"] == 12.0
    assert stats.summary()["comm_s"] == 20.0  # reading waits for the rest


def test_stats_wait_for_the_oldest_when_the_device_lags_past_the_bound(fake_cuda_events, monkeypatch):
    """A device that finishes nothing: the pending intervals never exceed the bound (the oldest
    half are waited for), and the totals stay exact."""
    monkeypatch.setattr(stats_module, "MAX_PENDING_INTERVALS", 8)
    stats = HookStats()
    for _ in range(100):
        stats.add_interval("compress_s", comm.mark("cuda"), comm.mark("cuda"))
        assert len(stats._pending) <= 8
    assert 0 < fake_cuda_events.waits <= 100
    assert stats.summary()["compress_s"] == 100.0


def test_a_tally_counts_unread_intervals_once(fake_cuda_events, monkeypatch):
    """auto's per-step snapshot: taken without waiting, read later; folding in between neither
    loses nor double-counts an interval."""
    monkeypatch.setattr(stats_module, "MAX_PENDING_INTERVALS", 2)
    stats = HookStats()
    stats.add(decompress_s=0.5)
    for _ in range(2):
        stats.add_interval("compress_s", comm.mark("cuda"), comm.mark("cuda"))
    before = stats.tally()
    assert fake_cuda_events.waits == 0
    for _ in range(3):  # the bound forces folding
        stats.add_interval("compress_s", comm.mark("cuda"), comm.mark("cuda"))
    after = stats.tally()
    assert before.seconds("compress_s", "decompress_s") == 2.5
    assert after.seconds("compress_s") - before.seconds("compress_s") == 3.0


def test_fsdp_and_hierarchical_time_with_the_helper():
    """No front keeps a host clock of its own: every timing goes through gradcomp.comm.mark."""
    root = Path(__file__).parent.parent / "gradcomp"
    fronts = [root / "fsdp.py", *sorted((root / "hooks").glob("*.py")), *sorted((root / "optim").glob("*.py"))]
    clocks = {path.name: path.read_text().count("perf_counter") for path in fronts}
    assert {name: n for name, n in clocks.items() if n and name != "stats.py"} == {}


TIMED_FRONTS = ["allreduce", "int8", "int8_twophase", "powersgd", "hierarchical_inter",
                "hierarchical_intra", "hierarchical_twophase", "auto"]
TIME_FIELDS = ("compress_s", "decompress_s", "comm_s")


def _time_fields(stats) -> dict:
    """(seconds added before reading, pending intervals, seconds once read) of a HookStats."""
    before, pending = {f: stats.totals[f] for f in TIME_FIELDS}, len(stats._pending)
    read = stats.summary()
    return {"host_clock_s": before, "pending": pending, "read": {f: read[f] for f in TIME_FIELDS}}


def _fronts_timed_as_on_cuda(rank, world):
    """Every front run with its data taken for CUDA data (gradcomp.comm.times_with_cuda_events
    true for every device, torch.cuda.Event faked by FakeEvent): its statistics' time fields,
    and auto's decisions."""
    comm.times_with_cuda_events = lambda device: True
    torch.cuda.Event = FakeEvent
    out = {}
    for label, method, options in DDP_FRONTS:
        if label not in TIMED_FRONTS:
            continue
        ddp = make_ddp(build_model())
        state, hook = ddp_front_state(method, options, rank)
        ddp.register_comm_hook(state.bind(ddp), hook)
        for step in range(STEPS):
            x, y = batch(step, rank)
            F.cross_entropy(ddp(x), y).backward()
        out[label] = _time_fields(state.stats)
        if method == "auto":
            out["auto decisions"] = state.stats.decisions
    group = dist.group.WORLD
    stats, replica_stats = HookStats(), HookStats()
    scatter = CompressedReduceScatter(get_method("int8"), True, stats, "layer")
    replica = CompressedReplicaAllReduce(get_method("int8"), True, replica_stats, "layer", group)
    shard = torch.empty(300)
    for _ in range(2):
        scatter(shard, torch.randn(world, 300), group, dist.ReduceOp.AVG)
        replica(shard)
    out["fsdp reduce-scatter"], out["fsdp replica"] = _time_fields(stats), _time_fields(replica_stats)
    for method, scheme in EXCHANGES:
        exchange = Exchange()
        exchange.mean(torch.randn(300), method, scheme, "v")
        out[f"exchange {method}:{scheme}"] = _time_fields(exchange.stats)
    return out


def test_every_front_times_cuda_work_with_events():
    """No front times CUDA work with the host's clock: with every device taken for CUDA, every
    interval a front records is a pair of (fake) CUDA events, read only when statistics are;
    auto's step and backward measurements are in the events' time too (whole fake seconds)."""
    result = run_ranks(_fronts_timed_as_on_cuda, 2, timeout_s=120)[0]
    for label, fields in result.items():
        if label == "auto decisions":
            continue
        assert fields["host_clock_s"] == dict.fromkeys(TIME_FIELDS, 0.0), label
        assert fields["pending"] > 0 and fields["read"]["comm_s"] >= 1.0, label
    decisions = result["auto decisions"]
    assert decisions
    for record in decisions:  # fake events are whole seconds apart: host clocks are not
        assert record["measured_s"] >= 1.0 and float(record["measured_s"]).is_integer()
        # backward_s: each rank's whole fake seconds, averaged over the 2 ranks (a multiple of 1/2)
        assert float(2 * record["backward_s"]).is_integer()
