"""The "auto" hook (gradcomp.hooks.auto) and what it decides with (gradcomp.analysis.auto, and
gradcomp.analysis.probe for what it measures).

Without processes: the policy, option checks, the cost cache (a temp XDG_CACHE_HOME), the link's
extra seconds per byte, the hysteresis, PowerSGD priced by the buckets' tensors and what breakeven
would print. On 2 Gloo ranks, one run: scripted switches through every scheme and PowerSGD in real
DDP training (bit-identical replicas, residuals flushed), mass conservation across switches of
hooks called directly (PowerSGD's in and out), exact resume with a bucket on PowerSGD, a real
measured run (every rank decides the same, the cost cache written), PowerSGD forced within and
over the quality budget, and configuration mismatches.
"""
from __future__ import annotations

import collections
import json
import math
import time

import pytest
import torch
import torch.distributed as dist

from ddp_models import FakeBucket, build_model, flat_params, make_ddp, random_buckets_step, train_steps
from dist_utils import run_ranks
from gradcomp.analysis import Link, Network, make_scenario
from gradcomp.analysis import auto as plan
from gradcomp.analysis import probe
from gradcomp.analysis.costmodel import Choice, simulate
from gradcomp.analysis.quality import Evidence
from gradcomp.hooks import ConfigMismatchError
from gradcomp.hooks.auto import AutoState, auto_hook
from gradcomp.methods import get_method

OPT_IN = ("int8", "sign", "fp16")
SCRIPTED = (*OPT_IN, "powersgd:rank=2")  # MixedNet's fc1 [32, 64] and fc2 [10, 32] compressed
# step -> the choice every bucket takes from that step on (ScriptedAutoState)
SCRIPT = {2: "int8:allgather", 3: "powersgd", 5: "int8:twophase", 6: "none", 7: "sign:allgather",
          8: "powersgd", 9: "fp16", 10: "sign:twophase"}
STEPS = 12
RESUME_AT = 4  # the checkpoint holds a PowerSGD step's residuals and warm-start Qs


# ---- without processes ------------------------------------------------------------------------

def test_default_policy_is_the_harmless_methods_and_powersgd_takes_a_rank():
    assert [c.label for c in plan.policy_choices()] == ["none", "fp16", "bf16", "int8:allgather",
                                                        "int8:twophase"]
    assert [c.label for c in plan.policy_choices(("int8:twophase", "topk"))] == ["none", "int8:twophase", "topk"]
    default, ranked = plan.policy_choices(("powersgd",))[1], plan.policy_choices(("int8", "PowerSGD:rank=8"))[-1]
    assert (default.label, default.scheme, default.options) == ("powersgd", "lowrank", {})
    assert (ranked.label, ranked.options) == ("powersgd", {"rank": 8})
    assert plan.policy_choices(("powersgd:rank=8", "powersgd:lowrank:rank=8")) == [Choice("none"), ranked]
    with pytest.raises(ValueError, match="unknown method"):
        plan.policy_choices(("zip",))


@pytest.mark.parametrize("methods, match", [
    (("powersgd:rank=2", "powersgd:rank=4"), r"powersgd is named with two sets of options \({'rank': 2}"),
    (("powersgd:rank=two",), "rank must be a whole number, got 'two'"),
    (("powersgd:rank=0",), "rank"),
    (("int8:block=128",), "takes no option 'block'; the options it takes: powersgd:rank=..."),
    (("powersgd:seed=1",), "takes no option 'seed'"),
    (("hier:int8",), "no hierarchical choices"),
    (("int8", 8), "a policy entry is a method name")])
def test_bad_policies_are_refused_naming_the_entry(methods, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AutoState(None, methods=methods)


@pytest.mark.parametrize("options, match", [({"warmup_steps": 1}, "warmup_steps"),
                                            ({"evaluate_every": 0}, "evaluate_every"),
                                            ({"hysteresis": 1.0}, "hysteresis")])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        AutoState(None, **options)
    with pytest.raises(ValueError, match="not allowed"):
        AutoState(None).switch("sign:allgather")


def test_costs_are_cached_per_device_and_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = probe.cost_cache_path(torch.device("cpu"))
    assert path.parent == tmp_path / "gradcomp" and f"torch{torch.__version__}" in path.name
    assert path.name.startswith(f"costs{probe.COST_FORMAT}-cpu-") and "-triton" in path.name
    first = probe.device_costs(["fp16", "int8"], [1024, 4096], 2, torch.device("cpu"), repeats=1)
    assert set(json.loads(path.read_text())["methods"]) == {"fp16", "int8"}

    def measured(*args, **kwargs):
        raise AssertionError("a cached cost was measured again")
    monkeypatch.setattr(probe, "measure_method_cost", measured)
    again = probe.device_costs(["int8", "fp16"], [1024, 4096], 2, torch.device("cpu"))
    assert again.methods == first.methods and again.average == first.average


def test_a_per_tensor_method_is_timed_on_matrices(monkeypatch):
    """PowerSGD's costs come from compressing square-ish matrices (its low-rank path), not flat
    tensors it would send whole; a flat method is timed flat."""
    from gradcomp.methods.powersgd import PowerSGD
    assert probe.timing_shape(4099, True) == (64, 64) and probe.timing_shape(4099, False) == (4099,)
    parts = set()
    compress = PowerSGD.compress

    def recorded(self, x, *args, **kwargs):
        payload = compress(self, x, *args, **kwargs)
        parts.add((tuple(x.shape), tuple(payload.parts)))
        return payload
    monkeypatch.setattr(PowerSGD, "compress", recorded)
    probe.measure_method_cost("powersgd", [4099, 16384], 2, torch.device("cpu"), repeats=1)
    assert parts == {((64, 64), ("p", "q")), ((128, 128), ("p", "q"))}


def _probe_timings(rank, world):
    from gradcomp import comm
    timed = []
    real = comm.seconds_of

    def seen(fn, device):  # rank 1 sees every probe collective slow, rank 0 none
        real(fn, device)
        timed.append(1)
        return 0.2 if rank == 1 else 0.001
    comm.seconds_of = seen
    probe.probe_network(torch.device("cpu"))
    return len(timed)


def test_the_link_probe_times_a_slow_collective_twice_on_every_rank():
    """A collective one rank saw take PROBE_SLOW_S or more is timed twice on every rank (the
    decision is all-reduced: ranks that ran different counts of collectives would hang)."""
    assert run_ranks(_probe_timings, 2, timeout_s=20) == [2 * 2 * len(probe.PROBE_BYTES)] * 2


def test_extra_seconds_per_byte_come_back_from_observed_collectives():
    probed = Network(2, Link("probe", 10.0, 50.0), allgather_link=Link("gather", 8.0, 40.0), algorithm="ring")
    slowed = plan.with_extra_per_byte(probed, 8e-8)  # 100 Mbit/s more on the wire
    observations = [(scheme, nbytes, plan.collective_s(slowed, scheme, nbytes))
                    for scheme, nbytes in (("allreduce", 4_000_000), ("allgather", 1_000_000), ("twophase", 900_000))]
    assert plan.extra_per_byte(probed, observations) == pytest.approx(8e-8, rel=1e-6)
    assert plan.extra_per_byte(probed, [("allreduce", 64_000, 1.0)]) is None  # too small to say
    busier = [(s, n, t * 3) for s, n, t in observations]  # a busy core only adds: the least counts
    assert plan.extra_per_byte(probed, observations + busier) == pytest.approx(8e-8, rel=1e-6)
    restored = [(s, n, plan.collective_s(probed, s, n)) for s, n, _ in observations]
    assert plan.extra_per_byte(probed, restored) == pytest.approx(0.0, abs=1e-15)


def test_per_bucket_plan_mixes_choices_and_hysteresis_keeps_the_current_plan():
    """A 4K-element bucket is latency-bound (compressing it only adds work), a 50M one pays for
    int8: the plan mixes them, and beats every uniform choice."""
    network, profile = (lambda s: (s.network, s.profile))(make_scenario("gpt2-124m", 8, "h100", bandwidth_gbps=10.0))
    scenario, buckets = plan.step_scenario([4096, 50_000_000], [0.5, 0.5], 0.05, network, profile)
    choices = plan.policy_choices()
    chosen, planned_s = plan.choose_per_bucket(scenario, choices, buckets, [Choice("none")] * 2, 0.0)
    assert [c.label for c in chosen] == ["none", "int8:twophase"]
    assert planned_s == simulate(scenario, chosen, buckets).step_s
    assert planned_s <= min(plan.predict(scenario, choices, buckets).values())
    # the mixed plan is ~0.03% faster than int8:twophase everywhere: not enough to switch
    current = [Choice("int8", {}, "twophase")] * 2
    kept, kept_s = plan.choose_per_bucket(scenario, choices, buckets, current, 0.1)
    assert kept == current and kept_s == simulate(scenario, current, buckets).step_s


def test_powersgd_is_priced_by_the_buckets_tensors():
    """A bucket given by its tensors' shapes is priced as PowerSGD's hook runs it (P and the 1-D
    tensors, then Q: 4 (4096 + 4096) 4 bytes for a 4096 x 4096 matrix at rank 4); on a 1 Gbit/s
    link the plan takes PowerSGD for that bucket and not for a bucket of 1-D tensors, where it
    would compress nothing."""
    network, profile = (lambda s: (s.network, s.profile))(make_scenario("gpt2-124m", 8, "h100", bandwidth_gbps=1.0))
    scenario, buckets = plan.step_scenario([((4096, 4096), (4096,)), ((4096,), (4096,))], [0.5, 0.5], 0.05,
                                           network, profile)
    powersgd = plan.policy_choices(("powersgd",))[1]
    assert simulate(scenario, powersgd, buckets).wire_bytes == 4 * (4096 + 4096) * 4 + 4 * 4096 + 4 * 8192
    chosen, _ = plan.choose_per_bucket(scenario, plan.policy_choices(("int8", "powersgd")), buckets,
                                       [Choice("none")] * 2, 0.0)
    assert chosen[0] == powersgd and chosen[1] != powersgd
    by_shape, flat = (plan.hook_compute_s(profile, powersgd, tensors, 8) for tensors in (((4096, 4096),), 4096 ** 2))
    assert by_shape > flat  # a flat bucket has no matrix: no Q pass, no per-tensor cost


def test_the_quality_budget_decides_which_methods_a_bucket_may_take():
    """On a 1 Gbit/s link sign is the fastest choice for a 50M bucket: taken when its noise ratio
    is within the budget (admitted), refused when not (int8 next), and a current plan that uses a
    method its bucket no longer admits is replaced whatever the hysteresis."""
    network, profile = (lambda s: (s.network, s.profile))(make_scenario("gpt2-124m", 8, "h100", bandwidth_gbps=1.0))
    scenario, buckets = plan.step_scenario([4096, 50_000_000], [0.5, 0.5], 0.05, network, profile)
    choices = plan.policy_choices(("int8", "sign"))
    none = [Choice("none")] * 2
    fastest, _ = plan.choose_per_bucket(scenario, choices, buckets, none, 0.0, [{"int8", "sign"}] * 2)
    assert fastest[1].method == "sign"
    refused, _ = plan.choose_per_bucket(scenario, choices, buckets, none, 0.0, [{"int8", "sign"}, {"int8"}])
    assert refused[1].method == "int8" and all(c.method != "sign" for c in refused)
    nothing, _ = plan.choose_per_bucket(scenario, choices, buckets, none, 0.0, [set(), set()])
    assert nothing == none
    left, _ = plan.choose_per_bucket(scenario, choices, buckets, fastest, 0.99, [{"int8"}, {"int8"}])
    assert all(c.method != "sign" for c in left)


def test_the_measured_table_refuses_methods_that_missed_the_target():
    """sign, top-k and PowerSGD at rank 4 missed the uncompressed run's target in gradcomp's hook
    runs under AdamW (the GPT) and SGD (ResNet-20): refused for either family and for an unknown
    one; int4 reached it under AdamW and missed it under SGD by less than ResNet-20's null does
    (unresolved: not refused, its noise ratio decides); int8 and fp16 reached it; PowerSGD at
    rank 3 has no hook runs: not refused (its noise ratio decides)."""
    choices = plan.policy_choices(("fp16", "int8", "int4", "sign", "topk", "powersgd"))
    assert "inside the null" in Evidence.load("sgd").lookup("hook", "int4").unresolved
    for family in ("adamw", "sgd", None):
        refused = plan.refused_by_evidence(choices, family)
        assert set(refused) == {"sign", "topk", "powersgd"}, refused
        assert all("not reached" in why for why in refused.values())
        assert plan.refused_by_evidence(plan.policy_choices(("powersgd:rank=3",)), family) == {}
    assert "AdamW" in plan.refused_by_evidence(choices, "adamw")["sign"]
    with pytest.raises(ValueError, match="unknown optimizer family 'adam'"):
        AutoState(None, optimizer_family="adam")
    assert AutoState(None, methods=("sign",), quality_budget=None).refused == {}


def test_a_checkpoint_from_before_the_quality_budget_resumes_on_speed_alone():
    """Its options lack quality_budget and optimizer_family: it loads into a state that chooses on
    speed alone, and a state with a budget refuses it naming the option."""
    saved = AutoState(None, quality_budget=None).state_dict()
    for key in ("quality_budget", "optimizer_family"):
        del saved["options"][key]
    AutoState(None, quality_budget=None).load_state_dict(saved)
    with pytest.raises(ValueError, match="'quality_budget': None.*'quality_budget': 0.01"):
        AutoState(None).load_state_dict(saved)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("steps_before", [0, 3])
def test_update_weight_is_what_adam_divides_the_gradient_by(steps_before, amsgrad):
    """With beta1 = 0, no weight decay and lr 1, Adam(W) moves each coordinate by g / (sqrt(v_hat)
    + eps): the step taken equals -g * update_weight(average=g) (first step and later ones, two
    groups, amsgrad's running maximum); after the step, update_weight without the average reads
    the same weight from the optimizer's state."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    kind = torch.optim.Adam if amsgrad else torch.optim.AdamW
    optimizer = kind([{"params": [a], "eps": 1e-3}, {"params": [b], "betas": (0.0, 0.9)}],
                     lr=1.0, betas=(0.0, 0.95), weight_decay=0.0, amsgrad=amsgrad)
    params = [a, b]
    assert plan.update_weight(optimizer, params) is None  # no second moment yet
    for step in range(steps_before + 1):
        scale = torch.logspace(-3, 1, 17)[torch.randperm(17)] if step % 2 else torch.logspace(1, -3, 17)
        average = torch.randn(17) * scale
        weight = plan.update_weight(optimizer, params, average)
        before = torch.cat([p.detach().reshape(-1).clone() for p in params])
        for p, g in zip(params, average.split([12, 5])):
            p.grad = g.view_as(p).clone()
        optimizer.step()
        moved = torch.cat([p.detach().reshape(-1) for p in params]) - before
    torch.testing.assert_close(moved, -average * weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plan.update_weight(optimizer, params), weight, rtol=1e-5, atol=0)
    assert plan.update_weight(torch.optim.SGD(params, lr=0.1), params) is None  # every coordinate alike
    assert plan.update_weight(optimizer, [torch.nn.Parameter(torch.ones(2))]) is None  # not the optimizer's
    with pytest.raises(ValueError, match="not for RMSprop: measure in the gradient's instead"):
        AutoState(None, optimizer=torch.optim.RMSprop(params))


def test_given_the_optimizer_auto_measures_in_its_coordinates_with_its_own_default_budget():
    """optimizer= sets the coordinates ("update"), the family and the default budget (0.04;
    0.01 without); a family that contradicts the optimizer is refused; a checkpoint from before
    the option resumes in the gradient's coordinates."""
    params = [torch.nn.Parameter(torch.ones(3))]
    adamw, sgd = torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)
    options = AutoState(None, optimizer=adamw).options
    assert (options["coordinates"], options["optimizer_family"], options["quality_budget"]) == \
        ("update", "adamw", plan.UPDATE_QUALITY_BUDGET) and plan.UPDATE_QUALITY_BUDGET == 0.04
    assert AutoState(None, optimizer=sgd, quality_budget=0.02).options["quality_budget"] == 0.02
    assert AutoState(None, optimizer=sgd, quality_budget=None).options["quality_budget"] is None
    assert (AutoState(None).options["coordinates"], AutoState(None).options["quality_budget"]) == \
        ("gradient", plan.DEFAULT_QUALITY_BUDGET)
    # the policy: every method given the optimizer and a budget, the harmless ones otherwise (or as named)
    assert AutoState(None, optimizer=adamw).options["methods"] == list(plan.EVERY_METHOD)
    assert set(plan.EVERY_METHOD) == {"none", "fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd"}
    for state in (AutoState(None), AutoState(None, optimizer=sgd, quality_budget=None)):
        assert state.options["methods"] == list(plan.DEFAULT_POLICY)
    assert AutoState(None, optimizer=adamw, methods=("none", "int8")).options["methods"] == ["none", "int8"]
    # under AdamW the measured table refuses sign, top-k and PowerSGD at rank 4; int4 is left to its ratio
    assert set(AutoState(None, optimizer=adamw).refused) == {"sign", "topk", "powersgd"}
    # a checkpoint saved under the former default policy is refused, naming the option; named, it resumes
    former = AutoState(None, optimizer=adamw, methods=plan.DEFAULT_POLICY).state_dict()
    with pytest.raises(ValueError, match="saved with other methods: checkpoint options"):
        AutoState(None, optimizer=adamw).load_state_dict(former)
    AutoState(None, optimizer=adamw, methods=plan.DEFAULT_POLICY).load_state_dict(former)
    with pytest.raises(ValueError, match="optimizer_family='adamw' but the optimizer is SGD"):
        AutoState(None, optimizer=sgd, optimizer_family="adamw")
    saved = AutoState(None).state_dict()
    del saved["options"]["coordinates"]
    AutoState(None).load_state_dict(saved)
    with pytest.raises(ValueError, match="'coordinates': 'gradient'.*'coordinates': 'update'"):
        AutoState(None, optimizer=adamw, quality_budget=0.01).load_state_dict(saved)


def test_an_optimizer_given_before_the_first_step_counts_as_given_at_construction():
    """use_optimizer (what the Trainer's and Lightning's callbacks call): the options, candidates
    and refusals of AutoState(optimizer=...), the defaults left to it following the optimizer and
    the named ones kept; a framework's wrapper is seen through; after a step, or of another family
    than the one given, refused; another optimizer of the same family replaces it."""
    params = [torch.nn.Parameter(torch.ones(3))]
    adamw, sgd = torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1)

    class Wrapper:  # as Accelerate's AcceleratedOptimizer keeps it (Lightning's: ._optimizer)
        def __init__(self, optimizer):
            self.optimizer = optimizer

    for kwargs in ({}, {"methods": ("none", "int8", "sign")}, {"quality_budget": 0.02}, {"quality_budget": None}):
        late = AutoState(None, **kwargs).use_optimizer(Wrapper(adamw))
        early = AutoState(None, optimizer=adamw, **kwargs)
        assert late.optimizer is adamw
        assert (late.options, late.candidates, late.refused) == (early.options, early.candidates, early.refused), kwargs
    assert AutoState(None).use_optimizer(adamw).options["methods"] == list(plan.EVERY_METHOD)
    assert AutoState(None).options["methods"] == list(plan.DEFAULT_POLICY)
    # a checkpoint saved after it resumes into a state given it the same way, not into one without
    saved = AutoState(None).use_optimizer(adamw).state_dict()
    AutoState(None).use_optimizer(adamw).load_state_dict(saved)
    with pytest.raises(ValueError, match="'coordinates': 'update'"):
        AutoState(None).load_state_dict(saved)
    stepped = AutoState(None)
    stepped.step = 1
    with pytest.raises(RuntimeError, match="has run 1 step.*before the first step"):
        stepped.use_optimizer(adamw)
    given = AutoState(None, optimizer=adamw)
    with pytest.raises(ValueError, match="coordinates of AdamW \\(adamw\\), not of SGD \\(sgd\\)"):
        given.use_optimizer(sgd)
    other = torch.optim.Adam(params)
    options = dict(given.options)
    assert given.use_optimizer(other).optimizer is other and given.options == options


def test_powersgd_error_weighted_coordinate_by_coordinate():
    """LowRankMemory.local_error_sq with a weight: a constant c scales it by c^2; weights that
    split the bucket's two matrices add up to the unweighted error (the bias, sent whole, adds 0)."""
    state = AutoState(None, methods=("powersgd:rank=2",))
    params = [torch.empty(24, 40), torch.empty(24), torch.empty(16, 30)]
    gradient = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(0))
    bucket = MatrixBucket(gradient, 0, True, params)
    memory, layout = state.lowrank(state.candidates[1]), state.bucket_layout(bucket)
    error = float(memory.local_error_sq(bucket, layout, 0))
    assert error > 0
    assert float(memory.local_error_sq(bucket, layout, 0, torch.full_like(gradient, 3.0))) == \
        pytest.approx(9 * error, rel=1e-6)
    first = (torch.arange(gradient.numel()) < 24 * 40).float()
    parts = [float(memory.local_error_sq(bucket, layout, 0, w)) for w in (first, 1 - first)]
    assert min(parts) > 0 and sum(parts) == pytest.approx(error, rel=1e-6)


def test_evaluations_back_off_while_nothing_switches_and_resume_where_they_were():
    """The interval doubles after an evaluation that keeps every choice (10, 20, 40, 80, 80),
    falls back to evaluate_every after a switch, and after one that could not measure; a
    checkpoint resumes the schedule; one from before max_evaluate_every resumes the fixed one
    (every evaluate_every steps) into a state that asks for it and is refused by one that does not."""
    state, schedule = AutoState(None), []
    outcomes = iter([False, False, False, False, False, True, None, False])  # switched? None: no window
    state.evaluate = lambda device: (schedule.append(state.step), time.sleep(0.002), next(outcomes))[2]
    for step in range(260):
        state.step = step
        state._begin_step(torch.device("cpu"))
    assert state.options["max_evaluate_every"] == 80
    assert schedule == [3, 13, 33, 73, 153, 233, 243, 253]
    assert state.stats.totals["evaluate_s"] >= 8 * 0.002  # auto's own cost, counted in stats()
    resumed = AutoState(None)
    resumed.load_state_dict(state.state_dict())
    assert (resumed._next_evaluation, resumed._interval) == (273, 20)
    saved = state.state_dict()
    for key in ("next_evaluation", "interval"):
        del saved["auto"][key]
    del saved["options"]["max_evaluate_every"]
    del saved["stats"]["totals"]["evaluate_s"]  # counted since: an older checkpoint counted none
    with pytest.raises(ValueError, match="'max_evaluate_every': 10.*'max_evaluate_every': 80"):
        AutoState(None).load_state_dict(saved)
    legacy = AutoState(None, max_evaluate_every=10)
    legacy.load_state_dict(saved)
    assert (legacy._next_evaluation, legacy._interval) == (263, 10) and legacy.stats.totals["evaluate_s"] == 0
    with pytest.raises(ValueError, match="max_evaluate_every"):
        AutoState(None, evaluate_every=10, max_evaluate_every=5)


def test_noise_ratio_is_the_error_over_the_minibatch_noise():
    """Two ranks with gradients (1, 0) and (0, 1): each rank's noise sigma^2 = 2 (1 - 1/2) = 1,
    so an error of 0.25 on each rank is a ratio of 0.25; identical gradients (no noise) floor the
    noise at NOISE_FLOOR of the gradient's energy; bad sizes are refused."""
    assert plan.noise_ratio(local_sq=2.0, error_sq=0.5, mean_sq=0.5, world_size=2) == 0.25
    assert plan.noise_ratio(2.0, 0.0, 1.0, 2) == 0.0
    assert plan.noise_ratio(2.0, 2.0 * 2.0 ** -21, 1.0, 2) == 0.5
    with pytest.raises(ValueError, match="at least 2 ranks"):
        plan.noise_ratio(1.0, 0.0, 1.0, 1)


def test_breakeven_plan_per_bucket_follows_the_link():
    slow = make_scenario("gpt2-124m", 8, "h100", bandwidth_gbps=1.0)
    fast = make_scenario("gpt2-124m", 8, "h100", link="nvlink4")
    slow_plan, fast_plan = plan.auto_plan(slow), plan.auto_plan(fast)
    assert len(slow_plan) > 1 and sum(r["elements"] for r in slow_plan) == slow.model.numel
    assert all(r["choice"] != "none" and r["step_s"] < r["none_step_s"] for r in slow_plan)
    assert all(r["choice"] == "none" for r in fast_plan)
    text = plan.format_auto_plan(slow)
    head, *runs = text.splitlines()
    assert head.startswith("auto (none,fp16,bf16,int8)") and runs[0].startswith(f"  buckets 0-{len(slow_plan) - 1} (")


# ---- on 2 ranks -------------------------------------------------------------------------------

class ScriptedAutoState(AutoState):
    """Decides by SCRIPT instead of by measurements, so that runs are repeatable."""

    def evaluate(self, device):
        if self.step in SCRIPT:
            self.switch(SCRIPT[self.step])


def _scripted(folder, rank):
    return ScriptedAutoState(None, methods=SCRIPTED, warmup_steps=2, evaluate_every=1, cache=f"{folder}/costs.json")


def _train(state, steps, rank, start=0, model=None, optimizer=None):
    model = model or make_ddp(build_model())
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.register_comm_hook(state, auto_hook)
    params, residual_names = [], []

    def on_step(step):
        params.append(flat_params(model.module))
        residual_names.append(sorted(state.residuals.names()))
    train_steps(model, optimizer, steps, rank, start=start, on_step=on_step)
    return model, optimizer, params, residual_names


class MatrixBucket(FakeBucket):
    """A FakeBucket whose gradients are views of its buffer in its parameters' shapes (PowerSGD
    compresses the matrices among them)."""

    def gradients(self):
        starts = [0]
        for p in self._params:
            starts.append(starts[-1] + p.numel())
        return [self._buffer[a:b].view(p.shape) for a, b, p in zip(starts, starts[1:], self._params)]


def _matrix_buckets_step(state, step, rank, world, params, sent, owed) -> None:
    """random_buckets_step over MatrixBuckets of ``params`` (a list of parameter lists)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    futures = []
    for index, bucket_params in enumerate(params):
        grad = torch.randn(sum(p.numel() for p in bucket_params), generator=gen) * (1 + rank)
        mean = grad / world
        dist.all_reduce(mean)
        owed[index] += mean
        futures.append(auto_hook(state, MatrixBucket(grad, index, index == len(params) - 1, bucket_params)))
    for index, future in enumerate(futures):
        sent[index] += future.wait()


def _lowrank_conservation(rank, world, folder):
    """As _conservation, with buckets of matrices and a bias switched into PowerSGD (rank 2)
    and out of it through every kind of residual: what came back plus the residuals left equals
    the sum of the true averages. Also the residuals' names after each step, and the largest
    residual PowerSGD left after its first step (something was owed)."""
    state = AutoState(None, methods=SCRIPTED, warmup_steps=10 ** 6, cache=f"{folder}/costs.json")
    params = [[torch.empty(24, 40), torch.empty(24)], [torch.empty(16, 30), torch.empty(30, 8)]]
    order = ["none", "int8:allgather", "powersgd", "powersgd", "int8:twophase", "powersgd", "sign:allgather",
             "none", "powersgd", "int8:allgather"]
    sent = [torch.zeros(sum(p.numel() for p in ps)) for ps in params]
    owed = [torch.zeros_like(s) for s in sent]
    names, powersgd_owed = [], None
    for step, label in enumerate(order):
        state.switch(label)
        _matrix_buckets_step(state, step, rank, world, params, sent, owed)
        names.append(sorted(state.residuals.names()))
        if step == 2:
            powersgd_owed = max(float(state.residuals.residual(f"bucket{i}").abs().max()) for i in range(2))
    left = []
    for index, s in enumerate(sent):
        residual = state.residuals.residual(f"bucket{index}")[:s.numel()].clone()
        dist.all_reduce(residual)
        left.append(residual)
    return sent, left, owed, names, powersgd_owed


def _conservation(rank, world, folder):
    """Hooks called directly, the choice switched between steps: what came back plus the
    residuals left equals the sum of the true averages."""
    state = AutoState(None, methods=OPT_IN, warmup_steps=10 ** 6, cache=f"{folder}/costs.json")
    sizes, order = (600, 401), ["none", "int8:allgather", "int8:twophase", "sign:allgather", "none",
                                "int8:twophase", "sign:twophase", "int8:allgather"]
    params = [[torch.empty(n)] for n in sizes]
    sent, owed, after_none = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes], None
    for step, label in enumerate(order):
        state.switch(label)
        random_buckets_step(auto_hook, state, step, rank, world, sizes, params, sent, owed)
        if step == 4:
            after_none = sorted(state.residuals.names())
    left = []
    for index, n in enumerate(sizes):
        residual = state.residuals.residual(f"bucket{index}")[:n].clone()
        dist.all_reduce(residual)
        left.append(residual)
    return sent, left, owed, after_none


def _measured(rank, folder):
    """A real AutoState deciding from measurements every 2 steps (no back-off)."""
    state = AutoState(None, methods=OPT_IN, warmup_steps=2, evaluate_every=2, max_evaluate_every=2,
                      cache=f"{folder}/costs.json")
    model = make_ddp(build_model())
    state.bind(model)
    _, _, params, _ = _train(state, 7, rank, model=model)
    stats = state.stats()
    # each bucket's recorded shapes are its gradients' (after DDP's rebuild of its layout too)
    shapes = collections.Counter(tuple(p.shape) for p in model.parameters())
    for step in state._timeline:
        assert collections.Counter(s for b in step["buckets"] for s in b["shapes"]) <= shapes
        assert all(b["numel"] == sum(math.prod(s) for s in b["shapes"]) for b in step["buckets"])
    # stats() names every bucket's current choice, the uncompressed ones too
    assert stats["choices"] == {i: state.choices[i].label if i in state.choices else "none"
                                for i in sorted(state.layouts)}, stats["choices"]
    return params[-1], stats["decisions"], {i: c.label for i, c in state.choices.items()}, stats


class OverBudget(AutoState):
    """Every method's noise ratio forced over the budget."""

    def _noise_ratios(self, steps, device):
        ratios = super()._noise_ratios(steps, device)
        return {i: {m: 2 * self.options["quality_budget"] for m in r} for i, r in ratios.items()}


def _over_budget(rank, folder):
    state = OverBudget(None, methods=OPT_IN, warmup_steps=2, evaluate_every=2, cache=f"{folder}/costs.json")
    _train(state, 9, rank)
    return state.stats()


class SlowForcedPowerSGD(AutoState):
    """Every collective priced over a 1 Mbit/s wire (8e-6 s per byte beyond the probed link,
    whatever the hook observes), every noise ratio forced to ``factor`` x the budget."""

    factor = 0.5

    @property
    def _extra_s_per_byte(self) -> float:
        return 8e-6

    @_extra_s_per_byte.setter
    def _extra_s_per_byte(self, value) -> None:
        pass

    def _noise_ratios(self, steps, device):
        measured = super()._noise_ratios(steps, device)
        return {i: {m: self.factor * self.options["quality_budget"] for m in r} for i, r in measured.items()}


def _forced_powersgd(rank, folder, factor):
    """PowerSGD at rank 3 (no measured runs: the table refuses nothing) on a slow link, its noise
    ratio forced to ``factor`` x the budget: parameters, stats, each bucket's compressed
    matrices (those of PowerSGD's plan)."""
    state = type("Forced", (SlowForcedPowerSGD,), {"factor": factor})(
        None, methods=("powersgd:rank=3",), warmup_steps=2, evaluate_every=2, cache=f"{folder}/lowrank.json")
    model = make_ddp(build_model())
    state.bind(model)
    _, _, params, _ = _train(state, 5, rank, model=model)
    memory = state.lowrank(state.candidates[1])
    compressing = sorted(i for i, plan in memory.plans.items() if plan.chunks)
    return params[-1], state.stats(), compressing


class RecordedSamples(AutoState):
    """Keeps what each quality sample saw: (step, bucket index, this rank's gradient, the weight
    computed by hand from the optimizer's state: 1 / (sqrt(v / (1 - beta2^t)) + eps))."""

    def _quality_sample(self, bucket):
        weights = []
        for p in bucket.parameters():
            kept, group = self.optimizer.state[p], self.optimizer.param_groups[0]
            v_hat = kept["exp_avg_sq"] / (1 - group["betas"][1] ** int(kept["step"]))
            weights.append((1 / (v_hat.sqrt() + group["eps"])).reshape(-1))
        self.samples.append((self.step, bucket.index(), bucket.buffer().detach().clone(), torch.cat(weights)))
        return super()._quality_sample(bucket)


def _update_coordinates(rank, folder):
    """auto given its AdamW: the samples it saw and its decisions."""
    model = make_ddp(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = RecordedSamples(None, methods=("int8", "int4"), warmup_steps=2, evaluate_every=2, optimizer=optimizer,
                            cache=f"{folder}/update.json")
    state.samples = []
    state.bind(model)
    _train(state, 4, rank, model=model, optimizer=optimizer)
    return state.samples, state.stats()["decisions"], state.options


def _mismatch(rank, policies=(("int8",), ("int8", "sign"))):
    state = AutoState(None, methods=policies[rank])
    try:
        _train(state, 1, rank)
    except ConfigMismatchError as exc:
        return str(exc)
    return None


def _suite(rank, world, folder):
    out = {}
    state = _scripted(folder, rank)
    _, _, out["params"], out["residual_names"] = _train(state, STEPS, rank)
    out["decisions"] = state.stats()["decisions"]
    out["warm_start_q"] = sorted(state.state_dict()["auto"]["warm_start_q"])
    # resume: RESUME_AT steps, checkpoint, a fresh DDP (its initial bucket layout, as a new
    # process has) and a fresh state loaded from the checkpoint, the rest
    first = _scripted(folder, rank)
    model, optimizer, _, _ = _train(first, RESUME_AT, rank)
    saved = (model.module.state_dict(), optimizer.state_dict(), first.state_dict())
    out["saved_powersgd"] = (saved[2]["auto"]["choices"], sorted(saved[2]["auto"]["warm_start_q"]))
    resumed_model = make_ddp(build_model())
    resumed_model.module.load_state_dict(saved[0])
    resumed_optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9)
    resumed_optimizer.load_state_dict(saved[1])
    second = _scripted(folder, rank)
    second.load_state_dict(saved[2])
    _, _, out["resumed"], _ = _train(second, STEPS - RESUME_AT, rank, RESUME_AT, resumed_model, resumed_optimizer)
    out["conservation"] = _conservation(rank, world, folder)
    out["lowrank_conservation"] = _lowrank_conservation(rank, world, folder)
    out["measured"] = _measured(rank, folder)
    out["over_budget"] = _over_budget(rank, folder)
    out["mismatch"] = _mismatch(rank)
    out["powersgd_mismatch"] = _mismatch(rank, (("powersgd:rank=2",), ("powersgd",)))
    out["powersgd_under"] = _forced_powersgd(rank, folder, 0.5)
    out["powersgd_over"] = _forced_powersgd(rank, folder, 2.0)
    out["update_coordinates"] = _update_coordinates(rank, folder)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auto")
    return folder, run_ranks(_suite, 2, str(folder))


def test_scripted_switches_keep_replicas_identical_and_flush_residuals(two_ranks):
    _, (zero, one) = two_ranks
    for a, b in zip(zero["params"], one["params"]):
        assert torch.equal(a, b)
    names = zero["residual_names"]  # after each step
    assert names[1] == [] and names[2] == ["bucket0", "bucket1"]  # int8 keeps residuals
    # PowerSGD: residuals of the buckets with compressed matrices only (int8's flushed)
    assert names[3] == names[4] and names[3] and set(names[3]) <= {"bucket0", "bucket1"}
    assert "bucket0/server" in names[5]  # two-phase: the chunk owner's too
    assert names[6] == []  # none: everything owed was flushed into step 6's gradient
    assert names[8] and names[9] == []  # fp16 (no error feedback): PowerSGD's residuals flushed
    assert zero["warm_start_q"] == ["powersgd"]  # kept after leaving PowerSGD
    assert not torch.equal(zero["params"][-1], zero["params"][1])


def test_switching_never_drops_what_is_owed(two_ranks):
    _, results = two_ranks
    for rank, result in enumerate(results):
        sent, left, owed, after_none = result["conservation"]
        assert after_none == []
        for s, l, o in zip(sent, left, owed):
            torch.testing.assert_close(s + l, o, rtol=0, atol=1e-4)
            assert l.abs().max() > 1e-3, "nothing was owed: the test proves nothing"
        for s, s0 in zip(sent, results[0]["conservation"][0]):
            assert torch.equal(s, s0), f"rank {rank} got another average"


def test_switching_into_and_out_of_powersgd_never_drops_what_is_owed(two_ranks):
    """PowerSGD's residual (M - P Q^T of the rank's own gradient) is flushed as it is, the flat
    schemes' times the world size: with either wrong the sums below are off by the owed amount."""
    _, results = two_ranks
    for rank, result in enumerate(results):
        sent, left, owed, names, powersgd_owed = result["lowrank_conservation"]
        assert names[2] == ["bucket0", "bucket1"] and powersgd_owed > 1e-2, "nothing was owed"
        assert names[4] == ["bucket0", "bucket0/server", "bucket1", "bucket1/server"]
        assert names[7] == []  # none after sign: everything flushed
        for s, l, o in zip(sent, left, owed):
            torch.testing.assert_close(s + l, o, rtol=0, atol=1e-4)
        for s, s0 in zip(sent, results[0]["lowrank_conservation"][0]):
            assert torch.equal(s, s0), f"rank {rank} got another average"


def test_resume_after_a_switch_is_exact(two_ranks):
    """The checkpoint is taken with every bucket on PowerSGD (its residuals and warm-start Qs
    saved); the resumed run continues on PowerSGD, then leaves it, bit-identical."""
    _, results = two_ranks
    for result in results:
        choices, warm = result["saved_powersgd"]
        assert set(label for label, _ in choices.values()) == {"powersgd"} and warm == ["powersgd"]
        assert len(result["resumed"]) == STEPS - RESUME_AT
        for a, b in zip(result["resumed"], result["params"][RESUME_AT:]):
            assert torch.equal(a, b)


def test_measured_decisions_agree_on_every_rank_and_costs_are_cached(two_ranks):
    folder, (zero, one) = two_ranks
    params, decisions, choices, _ = zero["measured"]
    assert torch.equal(params, one["measured"][0])
    assert [d["choices"] for d in decisions] == [d["choices"] for d in one["measured"][1]]
    assert choices == one["measured"][2]
    assert [d["step"] for d in decisions] == [2, 4, 6]
    for d in decisions:
        assert set(d["predicted_s"]) == {c.label for c in plan.policy_choices(OPT_IN)}
        assert d["measured_s"] > 0 and d["backward_s"] > 0 and d["link_gbps"] > 0
    assert set(json.loads((folder / "costs.json").read_text())["methods"]) == {"int8", "sign", "fp16"}


def test_every_decision_keeps_within_the_measured_quality_budget(two_ranks):
    """The noise ratios are measured at the step before each evaluation, agree on both ranks,
    order the methods by their error (fp16 < int8 in every bucket; sign, refused by the measured
    table, is not measured), cost time counted in quality_s, and no decision gives a bucket a
    method over the budget; with every ratio forced over it, every bucket stays uncompressed, and
    the evaluations that keep every choice back off (steps 2, 4, then 4 + 4)."""
    _, (zero, one) = two_ranks
    decisions, stats = zero["measured"][1], zero["measured"][3]
    assert [d["quality"] for d in decisions] == [d["quality"] for d in one["measured"][1]]
    for d in decisions:
        assert d["quality_budget"] == plan.DEFAULT_QUALITY_BUDGET and d["quality"]
        for index, ratios in d["quality"].items():
            assert ratios["fp16"] < ratios["int8"] and set(ratios) == {"fp16", "int8"}
            method = d["choices"][index].split(":")[0]
            assert method == "none" or (ratios[method] <= d["quality_budget"] and method not in d["refused"]), d
        assert set(d["refused"]) == {"sign"}  # OPT_IN under an unknown optimizer family
    assert stats["quality"] == decisions[-1]["quality"] and stats["quality_s"] > 0
    assert stats["evaluate_s"] > 0 and stats["evaluate_s_per_step"] == stats["evaluate_s"] / stats["steps"]
    for result in (zero, one):
        forced = result["over_budget"]
        assert [d["step"] for d in forced["decisions"]] == [2, 4, 8]
        assert all(label == "none" for d in forced["decisions"] for label in d["choices"].values())


def test_ranks_with_different_policies_fail_naming_it(two_ranks):
    _, results = two_ranks
    for result in results:
        assert "methods: rank 0 has ['int8'], rank 1 has ['int8', 'sign']" in result["mismatch"]
        assert "methods: rank 0 has ['powersgd:rank=2'], rank 1 has ['powersgd']" in result["powersgd_mismatch"]


def test_powersgd_is_taken_within_the_budget_and_refused_over_it(two_ranks):
    """On a slow link PowerSGD pays for the buckets with compressed matrices: with its noise
    ratio forced within the budget the plan takes it there (a bucket it would send whole costs
    the same either way), replicas stay identical; forced over the budget, every bucket stays
    uncompressed. The ratios measured before forcing agree on both ranks, are 0 for buckets
    PowerSGD sends whole and positive for the others."""
    _, (zero, one) = two_ranks
    params, stats, compressing = zero["powersgd_under"]
    assert torch.equal(params, one["powersgd_under"][0]) and compressing
    assert [d["step"] for d in stats["decisions"]] == [2, 4]
    assert len(stats["choices"]) > len(compressing)  # a bucket PowerSGD sends whole: its ratio is 0
    assert all(stats["choices"][i] == "powersgd" for i in compressing)
    assert stats["quality"] == one["powersgd_under"][1]["quality"]
    assert all((ratios["powersgd"] > 0) == (i in compressing) for i, ratios in stats["quality"].items())
    assert stats["wire_bytes"] < stats["raw_bytes"]
    for result in (zero, one):
        over = result["powersgd_over"][1]
        assert [d["step"] for d in over["decisions"]] == [2, 4]
        assert all(label == "none" for d in over["decisions"] for label in d["choices"].values())


def test_given_adamw_the_ratios_are_of_the_errors_in_its_update(two_ranks):
    """Each bucket's int8 and int4 ratios at the first evaluation (step 2, sampled at step 1,
    every bucket uncompressed) equal noise_ratio over both ranks' gradients, their errors and
    their average, each times AdamW's 1 / (sqrt(v_hat) + eps) computed by hand; and differ from
    the ratios in the gradient's coordinates (the weight is not uniform)."""
    _, (zero, one) = two_ranks
    samples, decisions, options = zero["update_coordinates"]
    assert options["coordinates"] == "update" and decisions[0]["quality_budget"] == plan.UPDATE_QUALITY_BUDGET
    first = [s for s in samples if s[0] == 1]
    assert decisions[0]["step"] == 2 and first and len(first) == len(decisions[0]["quality"])
    for (_, index, g0, w), (_, index1, g1, w1) in zip(first, [s for s in one["update_coordinates"][0] if s[0] == 1]):
        assert index == index1 and torch.equal(w, w1)
        for method in ("int8", "int4"):
            compressor = get_method(method)

            def ratio(weight):
                errors = [(compressor.decompress(compressor.compress(g)).reshape(-1) - g) * weight for g in (g0, g1)]
                return plan.noise_ratio(sum(float((g * weight).double().square().sum()) for g in (g0, g1)),
                                        sum(float(e.double().square().sum()) for e in errors),
                                        float(((g0 + g1) / 2 * weight).double().square().sum()), 2)
            measured = decisions[0]["quality"][index][method]
            assert measured == pytest.approx(ratio(w), rel=1e-4)
            assert measured != pytest.approx(ratio(torch.ones_like(w)), rel=0.05)


def _one_rank(rank, world, folder):
    state = AutoState(None, methods=OPT_IN, warmup_steps=2, evaluate_every=2, cache=f"{folder}/costs.json")
    model = make_ddp(build_model())
    state.bind(model)
    _, _, params, _ = _train(state, 5, rank, model=model)
    return params, state.stats()


def test_one_rank_trains_uncompressed_without_deciding(tmp_path):
    """A world of one exchanges nothing: no link to probe, every bucket stays "none"."""
    (params, stats), = run_ranks(_one_rank, 1, str(tmp_path))
    assert stats["decisions"] == [] and stats["steps"] == 5
    assert len(stats["choices"]) > 1 and set(stats["choices"].values()) == {"none"}
    assert stats["wire_bytes"] == stats["raw_bytes"] > 0
    assert not torch.equal(params[0], params[-1])
