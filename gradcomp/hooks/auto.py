"""The "auto" DDP hook: every few steps it measures the link, the methods' costs on this device and
how much of each bucket's communication hides behind backward, asks the cost model which allowed
choice gives the shortest step, and runs each bucket through that choice's scheme hook.

    state = gradcomp.hooks.register(model, "auto")                      # safe methods only
    state = gradcomp.hooks.register(model, "auto", methods=("none", "int8", "sign", "powersgd:rank=8"))
    state = gradcomp.hooks.register(model, "auto", optimizer=optimizer)  # ratios in the update's coordinates
    state.use_optimizer(optimizer)   # the same, before the first step (the framework integrations call it)
    # or: model.register_comm_hook(AutoState(None).bind(model), auto_hook)
    state.stats()["choices"]         # each bucket's current choice, "none" included
    state.stats()["decisions"]       # every evaluation: step, choices, predicted and measured
    state.stats()["quality"]         # each bucket's noise ratio per method, against quality_budget

Steps 0 .. warmup_steps-1 run uncompressed (DDP rebuilds its buckets after step 0; the others give
the first measurements). At the first bucket of step warmup_steps, and then after an interval of
evaluate_every steps that doubles after each later evaluation that keeps every bucket's choice
(up to max_evaluate_every) and falls back to evaluate_every after one that switches, every rank
runs the same evaluation:

- costs: compress and decode-and-sum of each allowed method at the buckets' sizes, measured once
  per device and torch/triton version and cached (gradcomp.analysis.probe.device_costs), then
  averaged over ranks;
- link: a start-up probe (the fastest of 5, or of 2 where the first took 50 ms or more,
  all-reduces and all-gathers of 4 KiB, 64 KiB and 512 KiB) fits each collective's latency and
  seconds per byte; at every evaluation the hook's own
  collectives of the last window_steps steps (launch to arrival, less the predicted decode) give
  the seconds per byte the wire adds to that (gradcomp.analysis.auto.extra_per_byte: the least
  over collectives and ranks, since waiting for a busy core or a late peer only adds);
- compute: what the hook's compress and decode took (its statistics) over what the cached costs
  predict for the same buckets scales every method's costs (learned while compressing);
- overlap: backward's time before each bucket (from the model's forward end, or the previous
  bucket's hook, to this bucket's hook), averaged over ranks: the cost model overlaps each
  bucket's communication with the backward still to come.

- quality (unless ``quality_budget=None``): at the step before each evaluation every rank
  compresses and decodes each bucket's own gradient with every allowed method the measured table
  does not refuse (no error feedback, timed in ``stats()["quality_s"]``) and keeps the squared
  error, its gradient's squared norm and the averaged gradient's; summed over ranks, they give
  each method's noise ratio per bucket (gradcomp.analysis.auto.noise_ratio: the variance its
  error adds to the averaged gradient over the minibatch noise already in it). Given the
  ``optimizer`` (Adam, AdamW), every vector is first multiplied coordinate by coordinate by what
  that optimizer divides the gradient by (gradcomp.analysis.auto.update_weight, its second
  moment as of its last step): the ratio is then of the errors in the update the model takes.
  A bucket takes only methods whose ratio is within the budget; a bucket whose method leaves the
  budget switches away at once.

The plan of one choice per bucket with the lowest predicted step
(gradcomp.analysis.auto.choose_per_bucket over gradcomp.analysis.costmodel.simulate) is taken
unless it beats the current plan by less than ``hysteresis``. All inputs are all-reduced, so every rank
decides the same at the same step. A bucket that leaves a choice flushes its error-feedback
residuals (the worker's, a two-phase chunk owner's, PowerSGD's) into its next gradient: added to
this rank's contribution before the new choice averages it, so nothing owed is dropped.

PowerSGD (``powersgd`` at rank 4, or ``powersgd:rank=R``) runs gradcomp.hooks.powersgd's bucket
reduction (``reduce_lowrank``: P with the uncompressed tensors, then Q, from the same deferred
queue as two-phase) with a LowRankMemory per PowerSGD choice; its warm-start Qs are kept while
a bucket is elsewhere (a return starts from them) and saved by ``state_dict``.
"""
from __future__ import annotations

import logging
import math
import statistics

import torch

from .. import comm
from ..analysis import auto as plan
from ..analysis import probe
from ..analysis.costmodel import UNCOMPRESSED, Choice
from ..checks import check_number
from ..methods import get_method, on_rank
from ..schemes import SCHEMES
from .base import HookState, resumable
from .compressed import allreduce_hook, scheme_hook
from .powersgd import LowRankMemory, reduce_lowrank
from .stats import HookStats

log = logging.getLogger(__name__)
HOOK_NAME = "auto_hook"
HOOK_FIELDS = ("compress_s", "decompress_s")  # the statistics that time the hook's own work
LEGACY_OPTIONS = {"quality_budget": None, "optimizer_family": None, "coordinates": "gradient"}
"""What a checkpoint saved before an option existed ran under: before the quality budget, speed
alone (resuming it exactly needs ``AutoState(..., quality_budget=None)``; with a budget the
options check refuses it); before ``optimizer=``, ratios in the gradient's coordinates."""
DEFAULT_METHODS = "default"
"""``methods``' default: every method (EVERY_METHOD) given the optimizer and a quality budget, else
DEFAULT_POLICY (gradcomp.analysis.auto)."""
DEFAULT_BUDGET = "default"
"""``quality_budget``'s default: UPDATE_QUALITY_BUDGET (0.04) given the optimizer, else
DEFAULT_QUALITY_BUDGET (0.01) (gradcomp.analysis.auto)."""


class AutoStats(HookStats):
    """HookStats plus auto's own cost, ``quality_s`` (seconds of the quality samples) and
    ``evaluate_s`` (seconds of the evaluations: the first one's cost measurement and link probe,
    each one's collectives and plan), ``decisions``: one record per evaluation (step, choice per
    bucket, predicted step seconds per candidate, measured step seconds, link, noise ratios),
    ``choices`` and ``quality``: each bucket's current choice and its latest noise ratios."""

    FIELDS = (*HookStats.FIELDS, "quality_s", "evaluate_s")

    def reset(self) -> None:
        super().reset()
        self.decisions: list[dict] = []
        self.choices: dict[int, str] = {}  # bucket index -> the label it ran under last ("none" included)
        self.quality: dict[int, dict[str, float]] = {}  # bucket index -> method -> noise ratio

    def summary(self) -> dict:
        """HookStats' summary, ``decisions``, and ``choices``: each bucket's current choice, by
        bucket index, "none" for a bucket left uncompressed."""
        return {**super().summary(), "decisions": list(self.decisions), "choices": dict(sorted(self.choices.items())),
                "quality": dict(sorted(self.quality.items()))}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "decisions": list(self.decisions)}

    def load_state_dict(self, state: dict) -> None:
        # a checkpoint from before evaluate_s was counted: none counted then
        super().load_state_dict({**state, "totals": {"evaluate_s": 0.0, **state["totals"]}})
        self.decisions = list(state.get("decisions", []))


class AutoState(HookState):
    """State of :func:`auto_hook`.

    methods: the policy, names or ``method:scheme``. Default: every method
        (gradcomp.analysis.auto.EVERY_METHOD) when given ``optimizer`` and a quality budget, the
        budget admitting each by its noise ratio in the optimizer's coordinates; otherwise none,
        fp16, bf16, int8 (DEFAULT_POLICY: the ones docs/convergence.md shows harmless), and
        ``sign``, ``topk``, ``int4``, ``powersgd`` only when named. PowerSGD at rank 4 or
        ``powersgd:rank=R`` (gradcomp.hooks.powersgd's bucket reduction with its default options:
        error feedback, warm start).
    warmup_steps: uncompressed steps before the first evaluation (>= 2: DDP rebuilds after 1).
    evaluate_every: steps between evaluations, while they switch.
    max_evaluate_every: the most steps between evaluations (default 8 x evaluate_every): the
        interval doubles after each evaluation that keeps every choice, up to this. A link that
        changes is noticed at the next evaluation.
    window_steps: the last steps whose timings an evaluation uses.
    hysteresis: a new choice must be predicted this fraction faster than the current one.
    quality_budget: the largest noise ratio a bucket's method may have; None: choose on speed
        alone. Default: 0.04 given ``optimizer`` (gradcomp.analysis.auto.UPDATE_QUALITY_BUDGET),
        else 0.01 (DEFAULT_QUALITY_BUDGET: its error adds at most a hundredth to the gradient noise).
    optimizer: the torch optimizer that steps the model (SGD, Adam or AdamW, or a framework's
        wrapper of one; not an option, so not saved): the noise ratios are measured in its update's
        coordinates (options' ``coordinates``: "update", else "gradient") and ``optimizer_family``
        follows from it. A framework that builds it later: :meth:`use_optimizer`.
    optimizer_family: "adamw", "sgd" or None (unknown): with a quality budget, a method whose
        measured hook runs under that family (any family when unknown) missed the uncompressed
        run's target (gradcomp/analysis/quality_table.json) is refused whatever its noise ratio.
    cache: the cost cache file (default: gradcomp.analysis.probe.cost_cache_path); not an option
        (it may differ per machine).
    """

    def __init__(self, process_group=None, *, methods=DEFAULT_METHODS, warmup_steps: int = 3,
                 evaluate_every: int = 10, max_evaluate_every: int | None = None, window_steps: int = 4,
                 hysteresis: float = plan.DEFAULT_HYSTERESIS,
                 quality_budget: float | str | None = DEFAULT_BUDGET, optimizer=None,
                 optimizer_family: str | None = None, cache=None):
        for name, value, low in (("warmup_steps", warmup_steps, 2), ("evaluate_every", evaluate_every, 1),
                                 ("window_steps", window_steps, 1)):
            check_number("AutoState", name, value, low, integer=True)
        if max_evaluate_every is None:
            max_evaluate_every = 8 * evaluate_every
        check_number("AutoState", "max_evaluate_every", max_evaluate_every, evaluate_every, integer=True)
        check_number("AutoState", "hysteresis", hysteresis, 0, 1, high_open=True)
        self._given = dict(methods=methods, quality_budget=quality_budget, optimizer_family=optimizer_family)
        optimizer, policy, candidates, refused = _policy(optimizer=optimizer, **self._given)
        super().__init__(process_group, methods=policy["methods"], warmup_steps=warmup_steps,
                         evaluate_every=evaluate_every, max_evaluate_every=max_evaluate_every,
                         window_steps=window_steps, hysteresis=float(hysteresis),
                         quality_budget=policy["quality_budget"], optimizer_family=policy["optimizer_family"],
                         coordinates=policy["coordinates"])
        self.optimizer = optimizer
        self.refused = refused  # method -> why the measured table refuses it
        self.stats = AutoStats()
        self.candidates = candidates
        self.cache = cache
        self.choices: dict[int, Choice] = {}  # bucket index -> its choice (absent: uncompressed)
        self._flush_from: dict[int, Choice] = {}  # bucket index -> the choice it just left
        self._methods: dict[str, object] = {}  # choice label -> this rank's Method
        self._lowrank: dict[str, LowRankMemory] = {}  # PowerSGD choice label -> its plans and warm-start Qs
        self._error_feedback = False
        self._costs = self._network = None
        self._extra_s_per_byte = 0.0  # what collectives took per byte beyond the probed link
        self._compute_factor = 1.0  # the hook's compress + decode seconds over the cached costs'
        self._timeline: list[dict] = []  # per step: forward end, per bucket timings
        self._shapes: dict[tuple, tuple] = {}  # a bucket's parameters (ids) -> their shapes
        self._forward_end = None
        self._next_evaluation = warmup_steps  # the step of the next evaluation
        self._interval = None  # steps from the last evaluation to the next (None before the first)

    def use_optimizer(self, optimizer) -> AutoState:
        """Measure in ``optimizer``'s update's coordinates, as if it had been given at construction:
        the options left to their defaults (the policy, the budget) take its defaults, and the
        measured table refuses what it measured missing under its family. For frameworks that
        build the optimizer after the hook is registered (the Hugging Face Trainer, Lightning: their
        gradcomp callbacks call it when training starts). ``optimizer``: torch's SGD, Adam or AdamW,
        or a framework's wrapper of one (:func:`gradcomp.analysis.auto.torch_optimizer`). Before
        the first step only (auto's options, checked on every rank at the first step and saved
        with its checkpoints, change); afterwards, or where one was given, only another optimizer
        of the same family, which changes no option (a framework's new optimizer for the same
        model). Returns the state."""
        inner = plan.torch_optimizer(optimizer)
        if self.optimizer is not None:
            family = plan.update_family(inner)
            if family != self.options["optimizer_family"]:
                raise ValueError(f"AutoState.use_optimizer: auto measures in the update's coordinates of "
                                 f"{type(self.optimizer).__name__} ({self.options['optimizer_family']}), "
                                 f"not of {type(inner).__name__} ({family})")
            self.optimizer = inner
            return self
        if self.step > 0 or self._timeline:
            raise RuntimeError(f"AutoState.use_optimizer: auto has run {max(self.step, 1)} step(s) measuring "
                               "in the gradient's coordinates; give the optimizer before the first step "
                               "(or at construction: AutoState(..., optimizer=...))")
        self.optimizer, policy, self.candidates, self.refused = _policy(optimizer=inner, **self._given)
        self.options.update(policy)
        return self

    # ---- what the scheme hooks read ----------------------------------------------------------
    @property
    def error_feedback(self) -> bool:
        """Whether the bucket being reduced keeps residuals (its method's hook default)."""
        return self._error_feedback

    def config(self, hook_name: str) -> dict:
        return super().config(HOOK_NAME)

    def method(self, choice: Choice):
        """The Method of ``choice`` on this rank (a ``seed`` option offset by the rank, as
        CompressedState does, so that ranks draw independent numbers)."""
        if choice.label not in self._methods:
            self._methods[choice.label] = on_rank(choice.method, self.rank, **choice.options)
        return self._methods[choice.label]

    def lowrank(self, choice: Choice) -> LowRankMemory:
        """The plans and warm-start Qs of a per-tensor (PowerSGD) choice, its options as
        PowerSGDState's defaults and the same seed on every rank (their initial Qs must agree)."""
        if choice.label not in self._lowrank:
            self._lowrank[choice.label] = _lowrank_memory(choice)
        return self._lowrank[choice.label]

    def bind(self, model) -> AutoState:
        """Also time the end of each forward (the start of backward) for the overlap measurement."""
        super().bind(model)
        getattr(model, "module", model).register_forward_hook(self._forward_done)
        return self

    def _forward_done(self, *_) -> None:
        self._forward_end = comm.mark(self._device())

    # ---- one bucket --------------------------------------------------------------------------
    def reduce(self, bucket) -> torch.futures.Future:
        """Evaluate at the step's first bucket when due, flush a switched bucket's residuals, run
        the bucket's choice, and time it (:func:`gradcomp.comm.mark`: CUDA events on CUDA, read
        only at an evaluation)."""
        device = bucket.buffer().device
        entered = comm.mark(device)
        if not self._timeline or self._timeline[-1]["step"] != self.step:
            self._begin_step(device)
        index = bucket.index()
        choice = self.choices.get(index, Choice(UNCOMPRESSED))
        self.stats.choices[index] = choice.label
        sample = self._quality_sample(bucket) if self._samples_quality() else None
        if index in self._flush_from:
            self._flush(bucket, self._flush_from.pop(index))
        wire_before = self.stats.totals["wire_bytes"]
        if choice.method == UNCOMPRESSED:
            future = allreduce_hook(self, bucket)
        elif SCHEMES[choice.scheme].per_tensor:
            self.begin_bucket(bucket, HOOK_NAME)
            future = reduce_lowrank(self, bucket, self.lowrank(choice))
            self.end_bucket(bucket)
        else:
            method = self.method(choice)
            self._error_feedback = method.error_feedback_default
            future = scheme_hook(self, bucket, method, HOOK_NAME, choice.scheme)
        record = {"index": index, "numel": bucket.buffer().numel(), "choice": choice,
                  "shapes": self._bucket_shapes(bucket),
                  "entered": entered, "returned": comm.mark(device),
                  "wire_bytes": self.stats.totals["wire_bytes"] - wire_before, "done": None,
                  "quality": sample}
        self._timeline[-1]["buckets"].append(record)

        def arrived(fut):
            record["done"] = comm.mark(device)
            averaged = fut.value()
            if sample is not None:  # ||w mean_i g_i||^2, on the device (read at the evaluation)
                weight = sample.pop("weight")
                sample["mean_sq"] = plan.squared_norm(averaged, weight)
            return averaged
        return future.then(arrived)

    def _bucket_shapes(self, bucket) -> tuple:
        """The shapes of the bucket's gradients (its parameters'), looked up by the parameters'
        identities: a step pays about 0.05 us a parameter, not the 1.2 us of DDP's gradient views."""
        parameters = bucket.parameters()
        key = tuple(map(id, parameters))
        shapes = self._shapes.get(key)
        if shapes is None:
            shapes = self._shapes[key] = tuple(tuple(p.shape) for p in parameters)
        return shapes

    def _samples_quality(self) -> bool:
        """Whether this step measures the noise ratios: the step before each evaluation."""
        return (self.options["quality_budget"] is not None and self.world_size >= 2
                and self.step + 1 == self._next_evaluation)

    def _quality_sample(self, bucket) -> dict:
        """This rank's gradient of a bucket (before any scheme touches it): its squared norm and,
        per allowed method not refused by the measured table, the squared error of compressing
        and decoding it (no error feedback; PowerSGD tensor by tensor, one power step from the Q
        its hook would start from: LowRankMemory.local_error_sq), as float64 device scalars (no
        host synchronisation; timed as ``quality_s``); each vector times the optimizer's
        ``weight`` first when there is one (kept for the averaged gradient's norm)."""
        gradient = bucket.buffer()
        start = self.stats.mark(gradient.device)
        g = gradient.detach().reshape(-1).float()
        weight = None
        if self.optimizer is not None:
            weight = plan.update_weight(self.optimizer, bucket.parameters())
            weight = None if weight is None else weight.to(g.device)
        errors = {}
        for choice in self.candidates:
            if choice.method in (UNCOMPRESSED, *errors, *self.refused):  # a refused ratio would change nothing
                continue
            if SCHEMES[choice.scheme].per_tensor:
                errors[choice.method] = self.lowrank(choice).local_error_sq(bucket, self.bucket_layout(bucket),
                                                                            self.step, weight)
            else:
                errors[choice.method] = plan.compression_error_sq(self.method(choice), g, weight)
        self.stats.add_interval("quality_s", start)
        return {"local_sq": plan.squared_norm(g, weight), "errors": errors, "mean_sq": None, "weight": weight}

    def _begin_step(self, device: torch.device) -> None:
        forward_end, self._forward_end = self._forward_end, None  # this step's forward, if bound
        tally = self.stats.tally()  # the hook's compress + decode seconds so far (read at evaluation)
        if self._timeline:
            self._timeline[-1]["end_tally"] = tally
        self._timeline.append({"step": self.step, "forward_end": forward_end, "buckets": [], "tally": tally})
        del self._timeline[:-(self.options["window_steps"] + 1)]
        if self.step >= self._next_evaluation:
            start = self.stats.mark(device)
            switched = self.evaluate(device)
            self.stats.add_interval("evaluate_s", start)
            base = self.options["evaluate_every"]
            self._interval = base if switched is not False or self._interval is None else \
                min(2 * self._interval, self.options["max_evaluate_every"])
            self._next_evaluation = self.step + self._interval

    def _flush(self, bucket, left: Choice) -> None:
        """Add the residuals ``left`` kept for this bucket to this rank's gradient and forget them:
        a flat scheme's times the world size (it compressed 1/world of the gradient: the next
        choice averages it back), PowerSGD's as they are (M - P Q^T of this rank's own
        gradient, laid out per parameter: its uncompressed tensors owe nothing); a two-phase
        chunk owner's residual goes to the elements of its chunk. PowerSGD's warm-start Qs are
        kept for a return."""
        buffer, name, world = bucket.buffer(), f"bucket{bucket.index()}", self.world_size
        if name in self.residuals.names():
            residual, _ = self.residuals.get(name, buffer.numel(), self.bucket_layout(bucket), buffer.device)
            buffer.add_(residual.to(buffer.dtype), alpha=1 if SCHEMES[left.scheme].per_tensor else world)
            self.residuals.reset(name)
        server = f"{name}/server"
        if server in self.residuals.names():
            owed = self.residuals.residual(server).reshape(-1)
            start, _ = comm.chunk_bounds(buffer.numel(), world, self.method(left).granule)[self.rank]
            end = min(start + owed.numel(), buffer.numel())
            if end > start:
                buffer[start:end].add_(owed[:end - start].to(buffer.dtype), alpha=world)
            self.residuals.reset(server)

    def switch(self, choice: Choice | str, indices=None) -> Choice:
        """Reduce the buckets ``indices`` (default: every bucket seen so far) with ``choice`` (a
        Choice or its label, e.g. ``"int8:twophase"``) from their next step on; a bucket that
        leaves a choice flushes its residuals into that step (see the module doc). The Choice."""
        if isinstance(choice, str):
            labels = {c.label: c for c in self.candidates}
            if choice not in labels:
                raise ValueError(f"auto: {choice!r} is not allowed by the policy; allowed: {', '.join(labels)}")
            choice = labels[choice]
        for index in (sorted(self.layouts) if indices is None else indices):
            previous = self.choices.get(index, Choice(UNCOMPRESSED))
            if choice != previous:
                self._flush_from.setdefault(index, previous)
                self.choices[index] = choice
        return choice

    # ---- evaluation --------------------------------------------------------------------------
    def _window(self) -> list[dict]:
        """The completed steps of the window, each with one record per bucket (arrival order)."""
        steps = [s for s in self._timeline[:-1]  # step 0 ran in DDP's initial bucket layout
                 if s["step"] >= 1 and s["buckets"] and all(b["done"] is not None for b in s["buckets"])]
        count = len(steps[-1]["buckets"]) if steps else 0
        return [s for s in steps if len(s["buckets"]) == count]

    def _measure(self, steps: list[dict]) -> dict:
        """This rank's numbers from ``steps``: backward seconds before each bucket (from the
        forward's end, or the previous bucket's hook, to this bucket's hook), the step span
        (forward end to last arrival), the hook's measured and predicted compress + decode
        seconds, and the collectives' observations (scheme, wire bytes, seconds from launch or
        the previous arrival to arrival, less the predicted decode; not two-phase buckets but
        the last, not PowerSGD buckets)."""
        gaps, spans, observations, hook_s, predicted_hook_s = [], [], [], 0.0, 0.0
        for s in steps:
            buckets = s["buckets"]
            start = s["forward_end"] if s["forward_end"] is not None else buckets[0]["entered"]
            step_gaps, previous_end = [], start
            for b in buckets:
                step_gaps.append(max(comm.elapsed_s(previous_end, b["entered"]), 0.0))
                previous_end = b["returned"]
                predicted_hook_s += plan.hook_compute_s(self._costs, b["choice"], b["shapes"], self.world_size)
                scheme = SCHEMES[b["choice"].scheme]
                # a deferred phase waits for the next bucket; PowerSGD's Q all-reduce always
                # does (the last bucket's then starts after its P arrived): neither is the wire's
                if not scheme.per_tensor and (not scheme.deferred or b is buckets[-1]):
                    decode_s = self._compute_factor * plan.decode_s(self._costs, b["choice"], b["numel"],
                                                                    self.world_size)  # for the next bucket
                    observations.append((b["choice"].scheme, b["wire_bytes"],
                                         comm.elapsed_s(b["returned"], b["done"]) - decode_s))
            gaps.append(step_gaps)
            spans.append(comm.elapsed_s(start, buckets[-1]["done"]))
            hook_s += s["end_tally"].seconds(*HOOK_FIELDS) - s["tally"].seconds(*HOOK_FIELDS)
        return {"gaps": [statistics.fmean(g[i] for g in gaps) for i in range(len(gaps[0]))],
                "span_s": statistics.median(spans), "hook_s": hook_s, "predicted_hook_s": predicted_hook_s,
                "observations": observations}

    def evaluate(self, device: torch.device) -> bool | None:
        """Measure, agree over ranks, predict every allowed choice, switch when it pays (see the
        module doc). Every rank calls it at the same step; ``device``: the buckets' (the
        collectives' tensors go there). Reads the window's timings and the agreed numbers on the
        host: the hook's only host synchronisations, once per evaluation. Whether a bucket
        switched; None without a window to measure (or with one rank)."""
        import torch.distributed as dist

        steps = self._window()
        if not steps or self.world_size < 2:  # one rank exchanges nothing: no link to price
            return None
        numels = [b["numel"] for b in steps[-1]["buckets"]]
        shapes = [b["shapes"] for b in steps[-1]["buckets"]]
        indices = [b["index"] for b in steps[-1]["buckets"]]
        if self._costs is None:  # the first evaluation: device costs and the link probe
            sizes = sorted({max(min(numels) // 4, 1024), *numels})
            methods = sorted({c.method for c in self.candidates if c.method != UNCOMPRESSED})
            costs = probe.device_costs(methods, sizes, self.world_size, self._device(), self.cache)
            self._costs = probe.agreed_costs(costs, device, self.group)
            self._network = probe.probe_network(device, self.group)
        mine = self._measure(steps)
        extra = plan.extra_per_byte(self._network, mine["observations"])
        # sums over ranks: backward gaps, hook seconds measured and predicted
        summed = torch.tensor([*mine["gaps"], mine["hook_s"], mine["predicted_hook_s"]], dtype=torch.float64,
                              device=device)
        dist.all_reduce(summed, group=self.group)
        # maxima: the slowest rank's step; the smallest extra per byte (a late peer is not link)
        unknown = -math.inf
        extremes = torch.tensor([mine["span_s"], unknown if extra is None else -extra], dtype=torch.float64,
                                device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        *gaps, hook_s, predicted_hook_s = (summed / self.world_size).tolist()
        measured_s = float(extremes[0])
        if float(extremes[1]) > unknown:
            self._extra_s_per_byte = -float(extremes[1])
        if predicted_hook_s > 0:
            self._compute_factor = hook_s / predicted_hook_s
        network = plan.with_extra_per_byte(self._network, self._extra_s_per_byte)
        backward_s = sum(gaps)
        shares = [g / backward_s for g in gaps] if backward_s > 0 else [1.0 / len(gaps)] * len(gaps)
        scenario, buckets = plan.step_scenario(shapes, shares, backward_s, network,
                                               plan.scaled_costs(self._costs, self._compute_factor))
        predicted = plan.predict(scenario, self.candidates, buckets)  # each choice for all buckets
        current = [self.choices.get(i, Choice(UNCOMPRESSED)) for i in indices]
        quality = self._noise_ratios(steps, device)
        budget = self.options["quality_budget"]
        admitted = None if quality is None else [plan.admitted_methods(quality[i], budget, self.refused)
                                                 for i in indices]
        chosen, planned_s = plan.choose_per_bucket(scenario, self.candidates, buckets, current,
                                                   self.options["hysteresis"], admitted)
        for index, choice in zip(indices, chosen):
            self.switch(choice, [index])
        record = {"step": self.step, "choices": {i: c.label for i, c in zip(indices, chosen)},
                  "previous": {i: c.label for i, c in zip(indices, current)},
                  "predicted_s": predicted, "planned_s": planned_s, "measured_s": measured_s,
                  "link_gbps": plan.gbps(network.link), "latency_us": network.link.latency_us,
                  "backward_s": backward_s, "compute_factor": self._compute_factor,
                  "quality": quality, "quality_budget": budget, "refused": dict(self.refused)}
        self.stats.decisions.append(record)
        if self.rank == 0 and chosen != current:
            refused = sorted({m for i in indices for m in set((quality or {}).get(i, {}))
                              - plan.admitted_methods((quality or {}).get(i, {}), budget, self.refused)})
            log.info("auto step %d: %s -> %s (planned %.1f ms; measured %.1f ms under the previous "
                     "plan; link %.3g Gbit/s, %.0f us; compute x%.2f; refused by the quality budget %s or the measured table: %s)",
                     self.step, _runs(c.label for c in current), _runs(c.label for c in chosen),
                     1e3 * planned_s, 1e3 * measured_s, record["link_gbps"], network.link.latency_us,
                     self._compute_factor, budget, ", ".join(refused) or "none")
        return chosen != current

    def _noise_ratios(self, steps: list[dict], device: torch.device) -> dict[int, dict[str, float]] | None:
        """Per bucket index, each allowed method's noise ratio (gradcomp.analysis.auto.noise_ratio)
        from the latest step of the window that sampled every bucket, its sums taken over ranks
        (one all-reduce); None when no such step (or no budget)."""
        import torch.distributed as dist

        sampled = [s for s in steps if all(b["quality"] is not None and b["quality"]["mean_sq"] is not None
                                           for b in s["buckets"])]
        if self.options["quality_budget"] is None or not sampled:
            return None
        buckets = sampled[-1]["buckets"]
        methods = sorted(buckets[0]["quality"]["errors"])
        local = torch.stack([torch.stack([b["quality"]["local_sq"], *(b["quality"]["errors"][m] for m in methods)])
                             for b in buckets]).to(device=device, dtype=torch.float64)
        dist.all_reduce(local, group=self.group)
        mean_sq = torch.stack([b["quality"]["mean_sq"] for b in buckets]).tolist()
        out = {}
        for b, row, averaged in zip(buckets, local.tolist(), mean_sq):
            out[b["index"]] = {m: plan.noise_ratio(row[0], error, averaged, self.world_size)
                               for m, error in zip(methods, row[1:])}
        self.stats.quality = dict(out)
        return out

    def _device(self) -> torch.device:
        for parameter in self._params.values():
            return parameter.device
        return torch.device("cpu")

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """HookState's, plus each bucket's choice, the choices whose residuals are still to flush
        and each PowerSGD choice's warm-start Qs (timings are not kept: a resumed run measures
        again)."""
        out = super().state_dict()
        out["auto"] = {"next_evaluation": self._next_evaluation, "interval": self._interval,
                       "choices": {i: [c.method, c.scheme] for i, c in self.choices.items()},
                       "flush_from": {i: [c.method, c.scheme] for i, c in self._flush_from.items()},
                       "warm_start_q": {label: m.warm_start_q.state_dict() for label, m in self._lowrank.items()}}
        return out

    def _loaded(self, state: dict) -> dict:
        # a checkpoint from before the quality budget chose on speed alone: its options say so
        options = state.get("options")
        if isinstance(options, dict):  # before max_evaluate_every: every evaluate_every steps
            state = {**state, "options": {**LEGACY_OPTIONS, "max_evaluate_every": options.get("evaluate_every"),
                                          **options}}
        loaded = super()._loaded(state)  # the options checked: the saved choices are this policy's
        candidates = {c.label: c for c in self.candidates}
        saved = state.get("auto", {})
        warmup, every = self.options["warmup_steps"], self.options["evaluate_every"]
        fixed_next = warmup + max(-(-(loaded["step"] - warmup) // every), 0) * every  # the fixed schedule's

        def choice(method: str, scheme: str) -> Choice:  # with the policy's options (powersgd's rank)
            return candidates[Choice(method, {}, scheme).label]
        return {**loaded, "_next_evaluation": int(saved.get("next_evaluation", fixed_next)),
                "_interval": saved.get("interval", every),
                "choices": {int(i): choice(m, s) for i, (m, s) in saved.get("choices", {}).items()},
                "_flush_from": {int(i): choice(m, s) for i, (m, s) in saved.get("flush_from", {}).items()},
                "_lowrank": {label: _lowrank_memory(candidates[label]).loaded(qs)
                             for label, qs in saved.get("warm_start_q", {}).items()}}

    def __getstate__(self):
        out = super().__getstate__()
        out["_methods"], out["_timeline"], out["_forward_end"], out["optimizer"] = {}, [], None, None
        return out


@resumable
def auto_hook(state, bucket):
    """DDP comm hook: the bucket averaged over ranks through the choice ``state`` made for it."""
    if not isinstance(state, AutoState):
        raise TypeError(f"auto_hook: state must be an AutoState, got {type(state).__name__}")
    return state.reduce(bucket)


def _policy(methods, quality_budget, optimizer_family, optimizer):
    """What AutoState's arguments resolve to (see its docstring): the torch optimizer (or None),
    the options ``methods``, ``quality_budget``, ``optimizer_family`` and ``coordinates``, the
    candidates, and the methods the measured table refuses (method -> why)."""
    if optimizer is not None:
        optimizer = plan.torch_optimizer(optimizer)
        family = plan.update_family(optimizer)
        if optimizer_family not in (None, family):
            raise ValueError(f"AutoState: optimizer_family={optimizer_family!r} but the optimizer is "
                             f"{type(optimizer).__name__} ({family}); give one of them")
        optimizer_family = family
    if isinstance(quality_budget, str) and quality_budget == DEFAULT_BUDGET:
        quality_budget = plan.DEFAULT_QUALITY_BUDGET if optimizer is None else plan.UPDATE_QUALITY_BUDGET
    if quality_budget is not None:
        check_number("AutoState", "quality_budget", quality_budget, 0, low_open=True, finite=True)
        quality_budget = float(quality_budget)
    if isinstance(methods, str) and methods == DEFAULT_METHODS:
        methods = plan.EVERY_METHOD if optimizer is not None and quality_budget is not None else plan.DEFAULT_POLICY
    candidates = plan.policy_choices(methods)  # raises a ValueError naming a bad entry
    refused = {} if quality_budget is None else plan.refused_by_evidence(candidates, optimizer_family)
    return optimizer, {"methods": list(methods), "quality_budget": quality_budget, "optimizer_family": optimizer_family,
                       "coordinates": "gradient" if optimizer is None else "update"}, candidates, refused


def _lowrank_memory(choice: Choice) -> LowRankMemory:
    """A fresh LowRankMemory of a PowerSGD choice (PowerSGDState's defaults, the choice's rank)."""
    method = get_method(choice.method, **choice.options)
    return LowRankMemory(method, method.error_feedback_default)


def _runs(labels) -> str:
    """Bucket labels as runs: ``int8:allgather x3, none x2``."""
    out = []
    for label in labels:
        if out and out[-1][0] == label:
            out[-1][1] += 1
        else:
            out.append([label, 1])
    return ", ".join(f"{label} x{count}" for label, count in out)
