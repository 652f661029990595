"""The user's own quality evidence: train a workload under each candidate hook on local Gloo
ranks, measure each candidate's steps factor against the uncompressed run, and write the rows
``gradcomp breakeven --quality FILE`` reads (:func:`gradcomp.analysis.quality.load_table`).

    from gradcomp.emulate.quality import calibrate_quality
    table = calibrate_quality(build_model, batches, heldout, ["fp16", "topk,ratio=0.01", "powersgd,rank=4"],
                              steps=200, seeds=(0, 1), eval_every=20, out="quality.json")

Every candidate, and the uncompressed baseline (``none``, always run), trains the same model
(``build_model()`` after ``torch.manual_seed(seed)``: the same initial weights per seed) on the
same batches (``batches(rank, step, seed)``: rank ``rank``'s inputs and targets at 0-based
``step``) for ``steps`` steps, with the real DDP hook (:func:`gradcomp.hooks.register`) on
``world_size`` Gloo ranks started by :func:`gradcomp.emulate.launch_ranks`. The held-out loss is
evaluated every ``eval_every`` steps and at the last; each candidate's factor per seed is
:func:`~gradcomp.analysis.quality.steps_factor` against the uncompressed run of the same seed
(target: its final held-out loss + 1%, or + the largest final-loss gap of the null runs below where
that is larger: :func:`~gradcomp.analysis.quality.null_tolerance`), its median and spread over seeds
:func:`~gradcomp.analysis.quality.rows_from_runs`.

The ranks are new processes: what they call must be importable there. Functions defined at a
module's top level are (the caller's ``sys.path`` is passed on; a script's own functions too, as
with multiprocessing's spawn: guard its entry point with ``if __name__ == "__main__":``); lambdas
and nested functions are not. ``heldout`` may also be a batch ``(inputs, targets)`` of tensors.

The uncompressed runs also measure every candidate's noise ratio at each evaluation
(:class:`NoiseProbe`); a candidate at or under :data:`NOISE_MODEL_MAX_RATIO` takes the noise
model's factor 1 + ratio instead of its curves' (:func:`noise_model_row`): a near-lossless method's
short-run curves move by more than the 1% target for reasons the full run does not keep (on
gradcomp's GPT fp16's and int8's errors move them up to 4.6% at 100 steps, 0.3% or less at 750;
on its ResNet-20 rounding alone moves them 10-38% in 55 steps: docs/breakeven.md).

Each seed also trains a **null** run: uncompressed again from initial weights one unit in the
last place above the baseline's (``torch.nextafter``), so it differs from the baseline by fp32
rounding alone. Its factor and final-loss gap (the table's ``null``, never a candidate) are what
the calibration says of uncompressed training against itself: a candidate's factor or gap inside
the null's is not resolved by this calibration (:func:`summary` marks each row's gap inside or
beyond the null's largest).

Limits (:data:`LIMIT_NOTE`, stated in the file and by ``gradcomp calibrate --quality``): a
calibration covers ``steps`` steps only. A choice that does not reach the target within them is
"not reached within 1x", which says nothing of a longer run. How far a short calibration's factor
is from the full run's was measured once on each of gradcomp's two workloads (docs/breakeven.md,
"Your model's quality"): it ruled out what the full runs rule out and called fp16 and int8 1.00x,
and missed int4's late cost on the GPT.
"""
from __future__ import annotations

import functools
import math
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.auto import optimizer_family
from ..analysis.quality import (DEFAULT_MAX_FACTOR, NOISE_MODEL_MAX_RATIO, TABLE_FORMAT, TARGET_TOLERANCE, Run,
                                noise_model_row, null_tolerance, rows_from_runs, target_rule, tolerance_text)
from ..methods import METHODS, UNCOMPRESSED, get_method
from ..numfmt import plain

LIMIT_NOTE = ("a calibration measures its own steps only ('not reached within 1x' says nothing of a longer run); "
              "a candidate whose noise ratio is at most the line takes the noise model's 1 + ratio (extra unbiased "
              "gradient noise, error feedback not counted), the others their curves, never below 1 where a ratio was "
              "measured (added noise does not lower the steps); against the full runs, measured once per workload "
              "(docs/breakeven.md: the byte-level GPT, 100 of 750 steps, 2 seeds; ResNet-20, 55 of 110, 3 seeds): "
              "the methods the full runs rule out (sign, top-k 1%, PowerSGD) were ruled out too and fp16 and int8 "
              "read 1.00x, but a cost that grows late in training is not seen (int4 on the GPT: 1.00x here, its "
              "curves 0.93x, 1.08x and one seed of three not reached in full); read each seed's result")
NULL_RUN = -1
"""The candidate index of a seed's null run in the workers' run records (0 is the baseline)."""
NULL_LABEL = "null (uncompressed, initial weights 1 ulp up)"
NO_FEEDBACK = ("fp16", "bf16")
"""Methods without error feedback (a cast): their rows record none (``error_feedback`` null)."""


@dataclass(frozen=True)
class Candidate:
    """A hook to calibrate: ``method`` (``none``: the uncompressed all-reduce), its ``options``
    (the method's, e.g. topk's ratio), ``scheme`` ("" : the method's first) and
    ``error_feedback`` (None: the method's default)."""

    method: str
    options: dict = field(default_factory=dict)
    scheme: str = ""
    error_feedback: bool | None = None

    def __post_init__(self):
        if self.method != UNCOMPRESSED and self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not isinstance(self.options, dict):
            raise ValueError(f"{self.method}: options must be a dict, got {self.options!r}")
        if self.method == UNCOMPRESSED:
            if self.options or self.scheme or self.error_feedback is not None:
                raise ValueError("the uncompressed baseline 'none' takes no options, scheme or error feedback")
            return
        spec = get_method(self.method, **self.options)  # validates the options
        if self.scheme and self.scheme not in spec.schemes:
            raise ValueError(f"{self.method} has no scheme {self.scheme!r}; it offers {', '.join(spec.schemes)}")
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise ValueError(f"{self.method}: error_feedback must be true or false, got {self.error_feedback!r}")
        if self.method in NO_FEEDBACK and self.error_feedback:
            raise ValueError(f"{self.method} is a cast: it has no error feedback")

    @property
    def resolved_scheme(self) -> str:
        return self.scheme or ("" if self.method == UNCOMPRESSED else get_method(self.method).schemes[0])

    @property
    def feedback(self) -> bool | None:
        """The error feedback the run uses (None: the method has none)."""
        if self.method == UNCOMPRESSED or self.method in NO_FEEDBACK:
            return None
        return get_method(self.method).error_feedback_default if self.error_feedback is None else self.error_feedback

    @property
    def label(self) -> str:
        """``topk ratio=0.001 no-EF``: the method, its scheme when it has several, its options, and
        error feedback when off."""
        words = [self.method if len(get_method(self.method).schemes if self.method != UNCOMPRESSED else ()) < 2
                 else f"{self.method}:{self.resolved_scheme}"]
        words += [f"{k}={v}" for k, v in sorted(self.options.items())]
        if self.feedback is False:
            words.append("no-EF")
        return " ".join(words)

    def to_dict(self) -> dict:
        return {"method": self.method, "options": dict(self.options), "scheme": self.scheme,
                "error_feedback": self.error_feedback}

    @classmethod
    def parse(cls, spec) -> Candidate:
        """A Candidate, a dict of its fields, or text ``method[:scheme][,option=value...]`` with
        ``error_feedback=false`` (or ``ef=false``) among the options: ``topk,ratio=0.001,ef=false``."""
        if isinstance(spec, Candidate):
            return spec
        if isinstance(spec, dict):
            unknown = set(spec) - {"method", "options", "scheme", "error_feedback"}
            if "method" not in spec or unknown:
                raise ValueError(f"a candidate dict has 'method' and optionally 'options', 'scheme', "
                                 f"'error_feedback', got {spec!r}")
            return cls(str(spec["method"]).lower(), dict(spec.get("options") or {}), spec.get("scheme") or "",
                       spec.get("error_feedback"))
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"a candidate is a method name such as 'topk,ratio=0.01', got {spec!r}")
        head, *items = [part.strip() for part in spec.split(",")]
        method, _, scheme = head.lower().partition(":")
        options, feedback = {}, None
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ValueError(f"candidate {spec!r}: options are option=value, got {item!r}")
            if key in ("ef", "error_feedback"):
                if value.strip().lower() not in ("true", "false", "on", "off", "1", "0"):
                    raise ValueError(f"candidate {spec!r}: {key} is true or false, got {value!r}")
                feedback = value.strip().lower() in ("true", "on", "1")
                continue
            options[key] = _number(value.strip())
        return cls(method, options, scheme, feedback)


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def default_optimizer(params):
    """AdamW, lr 1e-3 (torch's defaults otherwise)."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3)


def default_loss(outputs, targets):
    """Cross-entropy, outputs [..., classes] against integer targets [...] (a sequence model's
    too); regression targets (floating point, outputs' shape): mean squared error."""
    import torch.nn.functional as F

    if targets.is_floating_point():
        return F.mse_loss(outputs, targets)
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


# ---- the ranks -----------------------------------------------------------------------------------

def _fix_main(path: str | None) -> None:
    """Make the caller script's functions importable here (``__main__`` as multiprocessing's spawn
    does: the script run under the name ``__mp_main__``, its entry point guarded)."""
    if not path or getattr(sys.modules.get("__mp_main__"), "__file__", None) == path:
        return
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = module
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = module


def _evaluate(model, heldout, loss_fn) -> float:
    import torch

    batches = heldout() if callable(heldout) else heldout
    if isinstance(batches, tuple) and len(batches) == 2 and all(isinstance(b, torch.Tensor) for b in batches):
        batches = [batches]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            n = len(targets)
            total += float(loss_fn(model(inputs), targets)) * n
            count += n
    model.train(was_training)
    if count == 0:
        raise ValueError("heldout gave no examples")
    return total / count


def _train(spec: dict, candidate: Candidate, seed: int, rank: int, probed: tuple = (), nudged: bool = False) -> dict:
    """One run of one candidate and seed on this rank: its held-out curve (rank 0); with
    ``probed`` (the uncompressed run: the candidates' labels and their method specs), each one's
    noise ratio at every evaluation (:class:`NoiseProbe`); ``nudged``: every initial weight moved
    one unit in the last place up (the null run)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .train import attach_hook

    torch.manual_seed(seed)
    module = spec["build_model"]()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"build_model() must return a torch.nn.Module, got {type(module).__name__}")
    if nudged:
        nudge_up(module)
    ddp = DDP(module)
    options = dict(candidate.options)
    if candidate.error_feedback is not None:
        options["error_feedback"] = candidate.error_feedback
    probe = None
    if probed:  # the uncompressed all-reduce (gradcomp's, as attach_hook registers it), observed
        from ..hooks import AllreduceState

        probe = NoiseProbe(probed, AllreduceState(ddp.process_group).bind(ddp))
        ddp.register_comm_hook(probe, probe.hook)
    else:
        attach_hook(ddp, candidate.method, candidate.resolved_scheme, options)
    optimizer = spec["optimizer"](ddp.parameters())
    scheduler = spec["scheduler"](optimizer, spec["steps"]) if spec.get("scheduler") else None
    loss_fn = spec["loss"] or default_loss
    curve, diverged, started = [], None, time.perf_counter()
    ratios = []
    for step in range(spec["steps"]):
        done = step + 1
        evaluates = done % spec["eval_every"] == 0 or done == spec["steps"]
        inputs, targets = spec["batches"](rank, step, seed)
        optimizer.zero_grad(set_to_none=True)
        if probe is not None:
            probe.armed = evaluates
        loss = loss_fn(ddp(inputs), targets)
        loss.backward()
        if probe is not None and evaluates:
            ratios.append({"step": done, **probe.ratios(module)})
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if evaluates:
            value = _evaluate(module, spec["heldout"], loss_fn) if rank == 0 else 0.0
            flag = torch.tensor([0.0 if math.isfinite(value) else 1.0])
            dist.broadcast(flag, 0)  # every rank stops together when rank 0's loss is not finite
            if flag.item():
                diverged = done
                break
            curve.append((done, value))
    return {"curve": curve, "diverged_at": diverged, "seconds": time.perf_counter() - started,
            "optimizer": type(optimizer).__name__, "family": optimizer_family(optimizer), "noise_ratios": ratios}


def nudge_up(module) -> None:
    """Move every parameter of ``module`` one unit in the last place up (in place): the null run's
    initial weights."""
    import torch

    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.nextafter(parameter, torch.full_like(parameter, math.inf)))


class NoiseProbe:
    """Each candidate's noise ratio (:func:`gradcomp.analysis.auto.noise_ratio`: the variance its
    error would add to the averaged gradient over the minibatch noise, no error feedback) on the
    uncompressed run's own gradients, at the steps it is ``armed``. Its :meth:`hook` wraps the
    uncompressed hook: when armed, each bucket's local gradient [n] is compressed and decoded by
    every candidate's method before the all-reduce (the run itself is unchanged), the squared
    norms kept as float64 device scalars; :meth:`ratios` adds them over ranks (one all-reduce of
    1 + k scalars). ``probed``: (label, method spec) pairs; a per-tensor method (PowerSGD) has no
    flat compress and no ratio."""

    def __init__(self, probed, state):
        from ..analysis.auto import compression_error_sq
        from ..hooks import allreduce_hook

        self.labels = [label for label, _ in probed]
        self.methods = [None if getattr(m, "per_tensor", False) else m for _, m in probed]
        self.state = state
        self.armed = False
        self._allreduce, self._error_sq = allreduce_hook, compression_error_sq
        self._sums = None

    def hook(self, _probe, bucket):
        if self.armed:
            import torch

            local = bucket.buffer().detach().float()
            zero = torch.zeros((), dtype=torch.float64, device=local.device)
            sums = torch.stack([local.double().square().sum(),
                                *(zero if m is None else self._error_sq(m, local) for m in self.methods)])
            self._sums = sums if self._sums is None else self._sums + sums
        return self._allreduce(self.state, bucket)

    def ratios(self, module) -> dict:
        """Label -> noise ratio (None: a method without one) of the step just backpropagated (every
        rank calls it at the same step: a collective)."""
        import torch.distributed as dist

        from ..analysis.auto import noise_ratio

        if self._sums is None:
            raise RuntimeError("NoiseProbe.ratios: no bucket was observed since it was armed")
        sums, self._sums, self.armed = self._sums, None, False
        dist.all_reduce(sums)
        sums = sums.tolist()
        mean_sq = sum(float(p.grad.double().square().sum()) for p in module.parameters() if p.grad is not None)
        world = dist.get_world_size()
        return {label: (None if method is None else noise_ratio(sums[0], sums[1 + i], mean_sq, world))
                for i, (label, method) in enumerate(zip(self.labels, self.methods))}


def calibrate_worker(rank: int, world_size: int, config: dict) -> dict:
    """Inside each rank (``launch_ranks("gradcomp.emulate.quality:calibrate_worker")``):
    every seed, every candidate in turn; rank 0 returns the runs."""
    for entry in config.get("path", []):
        if entry not in sys.path:
            sys.path.append(entry)
    _fix_main(config.get("main"))
    spec = pickle.loads(Path(config["spec"]).read_bytes())
    spec.update(steps=config["steps"], eval_every=config["eval_every"])
    candidates = [Candidate.parse(c) for c in config["candidates"]]
    probed = tuple((c.label, get_method(c.method, **c.options)) for c in candidates if c.method != UNCOMPRESSED)
    runs, total = [], len(config["seeds"]) * (len(candidates) + 1)
    for seed in config["seeds"]:
        for i, candidate in [*enumerate(candidates), (NULL_RUN, candidates[0])]:
            run = _train(spec, candidate, seed, rank, probed if i == 0 else (), nudged=i == NULL_RUN)
            runs.append({"candidate": i, "seed": seed, **run})
            if rank == 0 and config.get("progress"):  # the caller shows it (calibrate_quality's progress)
                label = NULL_LABEL if i == NULL_RUN else candidate.label
                Path(config["progress"]).write_text(f"{len(runs)} of {total} runs done (last: {label}, seed {seed})")
    return {"runs": runs} if rank == 0 else {}


# ---- the entry point -----------------------------------------------------------------------------

def _check_count(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def _picklable(name: str, fn):
    if fn is None:
        return
    if not callable(fn):
        raise ValueError(f"{name} must be a callable, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"{name} must be a function defined at a module's top level (the ranks import it; "
                         f"not a lambda or nested function): {exc}") from None


def calibrate_quality(build_model, batches, heldout, candidates, steps: int, seeds=(0, 1), *,
                      world_size: int = 2, eval_every: int | None = None, optimizer=None, scheduler=None,
                      loss=None, workload: str = "user", out: str | Path | None = None,
                      timeout_s: float = 3600.0, progress=None) -> dict:
    """Train ``build_model()`` under the uncompressed baseline and each of ``candidates`` (see
    :class:`Candidate`: ``"fp16"``, ``"topk,ratio=0.001,ef=false"``, dicts) for ``steps`` steps
    per seed of ``seeds`` on ``world_size`` local Gloo ranks; the table of their rows (the format of
    :func:`gradcomp.analysis.quality.load_table`), written to ``out`` when given.

    ``batches(rank, step, seed)``: that rank's (inputs, targets) at 0-based ``step`` (the same for
    every candidate); ``heldout``: a callable returning a batch or a list of batches, or a batch;
    its mean loss (``loss(outputs, targets)``, default :func:`default_loss`) is evaluated every
    ``eval_every`` steps (default steps // 10) and at the last step, on rank 0.
    ``optimizer(params)``: the optimizer (default :func:`default_optimizer`, AdamW); its family
    (adamw, sgd, or none) is recorded in each row. ``scheduler(optimizer, steps)``: an optional
    lr scheduler, stepped after every step. ``workload``: the name the rows carry.
    ``progress(text)``: called with "k of n runs done ..." as runs finish; ``timeout_s``: the
    whole calibration's limit (TimeoutError)."""
    _check_count("steps", steps)
    _check_count("world_size", world_size, 2)
    eval_every = max(steps // 10, 1) if eval_every is None else _check_count("eval_every", eval_every)
    if eval_every > steps:
        raise ValueError(f"eval_every ({eval_every}) must not exceed steps ({steps})")
    if isinstance(seeds, int):
        seeds = [seeds]
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                             and s >= 0 for s in seeds):
        raise ValueError(f"seeds must be distinct integers >= 0, got {seeds!r}")
    if isinstance(candidates, (str, dict, Candidate)):
        candidates = [candidates]
    parsed = [Candidate.parse(c) for c in candidates]
    if not any(c.method != UNCOMPRESSED for c in parsed):
        raise ValueError("give at least one compressed candidate (the uncompressed baseline is always run)")
    chosen = [Candidate(UNCOMPRESSED)] + [c for c in parsed if c.method != UNCOMPRESSED]
    labels = [c.label for c in chosen]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a candidate is given twice: {', '.join(labels)}")
    for name, fn in (("build_model", build_model), ("batches", batches), ("optimizer", optimizer),
                     ("scheduler", scheduler), ("loss", loss)):
        _picklable(name, fn)
    if build_model is None or batches is None:
        raise ValueError("build_model and batches are required")
    if heldout is None:
        raise ValueError("heldout is required: a callable returning held-out batches, or a batch")
    _picklable("heldout", heldout) if callable(heldout) else None
    spec = {"build_model": build_model, "batches": batches, "heldout": heldout,
            "optimizer": optimizer or default_optimizer, "scheduler": scheduler, "loss": loss}
    main = sys.modules.get("__main__")
    uses_main = any(getattr(fn, "__module__", None) == "__main__" for fn in spec.values())
    main_path = os.path.abspath(main.__file__) if uses_main and getattr(main, "__file__", None) else None
    if uses_main and main_path is None:
        raise ValueError("build_model, batches and the rest are defined in an interactive session (python -c, a "
                         "notebook): the ranks cannot import them; define them in a module or a script file")

    with tempfile.TemporaryDirectory(prefix="gradcomp-quality-") as tmp:
        spec_path = Path(tmp, "spec.pkl")
        spec_path.write_bytes(pickle.dumps(spec))
        progress_path = Path(tmp, "progress.txt")
        config = {"spec": str(spec_path), "steps": steps, "eval_every": eval_every, "seeds": seeds,
                  "candidates": [c.to_dict() for c in chosen], "main": main_path,
                  "progress": str(progress_path) if progress else None,
                  "path": [os.path.abspath(p or ".") for p in sys.path]}
        started = time.perf_counter()
        results = _launch_watching(config, world_size, timeout_s, progress, progress_path)
    table = build_table(chosen, results[0]["runs"], workload=workload, steps=steps, eval_every=eval_every,
                        world_size=world_size, seeds=seeds)
    table["calibration"]["seconds"] = round(time.perf_counter() - started, 1)
    if out is not None:
        from ..analysis.quality import table_text

        Path(out).write_text(table_text(table))
    return table


def _launch_watching(config: dict, world_size: int, timeout_s: float, progress, progress_path: Path) -> list:
    """launch_ranks of the worker; meanwhile ``progress`` (when given) sees what rank 0 notes."""
    import threading

    from .launch import launch_ranks

    outcome = {}

    def launch():
        try:
            outcome["results"] = launch_ranks("gradcomp.emulate.quality:calibrate_worker", world_size,
                                              config, timeout_s=timeout_s)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=launch, name="gradcomp-quality-ranks", daemon=True)
    thread.start()
    seen, alive = None, True
    while alive:
        thread.join(0.5)
        alive = thread.is_alive()  # then once more after the ranks end: the last note too
        if progress and progress_path.exists():
            text = progress_path.read_text()
            if text and text != seen:
                seen = text
                progress(text)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


DIVERGED_LOSS = 1e300
"""The held-out loss a run that diverged records from its divergence on (never at or below a
target): its factor is "not reached"."""


def build_table(candidates: list[Candidate], runs: list[dict], *, workload: str, steps: int, eval_every: int,
                world_size: int, seeds: list[int], command: str | None = None) -> dict:
    """The quality table of a calibration's runs (``runs``: per candidate index and seed, the
    curve; candidate 0 the uncompressed baseline)."""
    def as_run(r) -> Run:
        curve = list(r["curve"])
        if r.get("diverged_at") is not None:
            curve.append((r["diverged_at"], DIVERGED_LOSS))
        return Run(r["seed"], tuple(tuple(p) for p in curve))

    baseline = [r for r in runs if r["candidate"] == 0]
    for r in baseline:
        if r.get("diverged_at") is not None or not r["curve"]:
            raise ValueError(f"the uncompressed run of seed {r['seed']} diverged (held-out loss not finite at step "
                             f"{r['diverged_at']}): no target to measure against; lower the learning rate")
    for r in runs:
        if r["candidate"] == NULL_RUN and r.get("diverged_at") is not None:
            raise ValueError(f"the null run of seed {r['seed']} (uncompressed from weights 1 ulp up) diverged at step "
                             f"{r['diverged_at']} where uncompressed did not: rounding alone decides this "
                             "training; lower the learning rate")
    families = {r["family"] for r in runs}
    family = families.pop() if len(families) == 1 else None
    optimizer = runs[0]["optimizer"]
    describe = (f"calibrated on {workload}, {optimizer}, {world_size} ranks, {steps} steps (held-out loss every "
                f"{eval_every}), {len(seeds)} seed{'s' if len(seeds) > 1 else ''}")
    nulls = [r for r in runs if r["candidate"] == NULL_RUN]
    baseline_runs, null_runs = [as_run(r) for r in baseline], [as_run(r) for r in nulls]
    gaps = [s["final_gap"] for s in rows_from_runs({}, baseline_runs, null_runs)["per_seed"]] if nulls else []
    tolerance = null_tolerance(gaps)  # the target this calibration's own null resolves
    rows = []
    for i, c in enumerate(candidates[1:], start=1):
        mine = [r for r in runs if r["candidate"] == i]
        setting = {"workload": workload, "optimizer": family, "optimizer_class": optimizer, "front": "hook",
                   "method": c.method, "options": dict(c.options), "scheme": c.resolved_scheme,
                   "error_feedback": c.feedback, "config": c.label, "steps": steps, "description": describe,
                   "source": "calibration"}
        if command:
            setting["command"] = command
        row = rows_from_runs(setting, baseline_runs, [as_run(r) for r in mine], tolerance=tolerance)
        row["diverged"] = [r["seed"] for r in mine if r.get("diverged_at") is not None]
        rows.append(noise_model_row(row, [(r["seed"], p["step"], p[c.label]) for r in baseline
                                          for p in r.get("noise_ratios", []) if p.get(c.label) is not None]))
    labelled = [*enumerate(c.label for c in candidates), *([(NULL_RUN, NULL_LABEL)] if nulls else [])]
    table = {"format": TABLE_FORMAT, "target_rule": target_rule(tolerance), "target_tolerance": tolerance,
             "max_factor": DEFAULT_MAX_FACTOR, "limits": LIMIT_NOTE,
             "calibration": {"workload": workload, "optimizer": optimizer, "optimizer_family": family,
                             "world_size": world_size, "steps": steps, "eval_every": eval_every, "seeds": seeds,
                             "candidates": [c.label for c in candidates]},
             "curves": {label: {str(r["seed"]): [list(p) for p in r["curve"]] for r in runs if r["candidate"] == i}
                        for i, label in labelled},
             "rows": rows}
    diverged = {label: {str(r["seed"]): r["diverged_at"] for r in runs if r["candidate"] == i
                        and r.get("diverged_at") is not None} for i, label in labelled}
    if any(diverged.values()):  # the step each diverged at (its curve ends before it): rebuild_table reads it
        table["diverged_at"] = {label: steps for label, steps in diverged.items() if steps}
    if nulls:  # what the calibration says of uncompressed training against itself: never a candidate
        null = rows_from_runs({"config": NULL_LABEL}, baseline_runs, null_runs, tolerance=tolerance)
        table["null"] = {k: null[k] for k in ("config", "seeds", "steps_factor", "spread", "final_gap", "per_seed")}
    return table


def rebuild_table(table: dict) -> dict:
    """:func:`build_table` again from what a calibration file keeps (each run's curve, the step a
    diverged run stopped at, the noise ratios of the uncompressed runs, the candidates and the
    setting): a calibration under the current rule without training again. The calibration's
    ``seconds`` is kept."""
    cal, rows = table["calibration"], table["rows"]
    candidates = [Candidate(UNCOMPRESSED)] + [Candidate(r["method"], dict(r.get("options") or {}), r["scheme"],
                                                        r.get("error_feedback")) for r in rows]
    labels = [c.label for c in candidates]
    if labels != cal["candidates"]:
        raise ValueError(f"the file's rows ({', '.join(labels)}) are not its candidates "
                         f"({', '.join(cal['candidates'])})")
    ratios = {}  # seed -> step -> label -> ratio, as the uncompressed runs measured them
    for row, label in zip(rows, labels[1:]):
        for seed, step, ratio in (row.get("noise_ratio") or {}).get("per_step", []):
            ratios.setdefault(seed, {}).setdefault(step, {})[label] = ratio
    diverged = table.get("diverged_at", {})
    runs = []
    for index, label in [*enumerate(labels), *([(NULL_RUN, NULL_LABEL)] if table.get("null") else [])]:
        for seed in cal["seeds"]:
            curve = table["curves"][label][str(seed)]
            run = {"candidate": index, "seed": seed, "curve": [tuple(p) for p in curve],
                   "diverged_at": diverged.get(label, {}).get(str(seed)),
                   "family": cal["optimizer_family"], "optimizer": cal["optimizer"]}
            if index == 0:
                run["noise_ratios"] = [{"step": step, **by_label}
                                       for step, by_label in sorted(ratios.get(seed, {}).items())]
            runs.append(run)
    commands = {r.get("command") for r in rows}
    rebuilt = build_table(candidates, runs, workload=cal["workload"], steps=cal["steps"], eval_every=cal["eval_every"],
                          world_size=cal["world_size"], seeds=cal["seeds"],
                          command=commands.pop() if len(commands) == 1 else None)
    if "seconds" in cal:
        rebuilt["calibration"]["seconds"] = cal["seconds"]
    return rebuilt


def _factor_text(f: dict) -> str:
    return f"{f['value']:.2f}x" if f["reached"] else f"not reached within {plain(f['within'])}x"


def summary(table: dict) -> str:
    """The rows as lines: each candidate's steps factor and what decided it (the noise model or the
    curves, with the other's figure), the curves' spread over seeds and the final-loss gap, set
    beside the null's (:func:`inside_null`); then the null's line."""
    cal = table["calibration"]
    tolerance = table.get("target_tolerance", TARGET_TOLERANCE)
    lines = [f"steps to the uncompressed run's held-out loss {tolerance_text(tolerance)}, "
             f"{cal['workload']}, {cal['optimizer']}, {cal['world_size']} ranks, {cal['steps']} steps, "
             f"seeds {', '.join(map(str, cal['seeds']))}:"]
    width = max(len(r["config"]) for r in table["rows"])
    floor = null_floor(table.get("null"))
    for row in table["rows"]:
        s = row["spread"]
        ratio = (row.get("noise_ratio") or {}).get("median")
        curves = _factor_text(row.get("curve_factor") or row["steps_factor"])
        if row.get("basis") == "noise model":
            basis = f"noise model: ratio {ratio:.3g} <= {plain(NOISE_MODEL_MAX_RATIO)}; curves {curves}"
        elif row.get("basis") == "noise model's floor":
            basis = f"noise model's floor of 1: ratio {ratio:.3g}; curves {curves}"
        else:
            basis = "curves" + (f"; ratio {ratio:.3g}" if ratio is not None else "")
        spread = (f"seeds {s['min']:.2f}-{s['max']:.2f}x, reached {s['reached']} of {s['of']}" if s["reached"]
                  else f"reached 0 of {s['of']}")
        against_null = ""
        if floor is not None:
            inside = inside_null(row, floor)
            against_null = (f" ({'inside' if inside else 'beyond'} the null's +-{floor:.2%} on "
                            f"{'every' if inside else 'some'} seed)")
        lines.append(f"  {row['config']:<{width}}  {_factor_text(row['steps_factor'])} ({basis}; {spread}), "
                     f"final loss {row['final_gap']:+.1%}{against_null}"
                     + (f", diverged: seeds {row['diverged']}" if row["diverged"] else ""))
    if table.get("null"):
        lines.append(f"  {null_text(table['null'])}")
    lines.append(f"limit: {table['limits']}")
    return "\n".join(lines)


def null_floor(null: dict | None) -> float | None:
    """The largest final-loss gap, either way, of the null's seeds (None: no null run)."""
    return None if not null else max(abs(s["final_gap"]) for s in null["per_seed"])


def inside_null(row: dict, floor: float) -> bool:
    """Whether every seed of a candidate's row ends within ``floor`` of uncompressed's final loss
    (either way): a gap rounding alone produces, not one the calibration resolves."""
    return all(abs(s["final_gap"]) <= floor for s in row["per_seed"])


def null_text(null: dict) -> str:
    """The null run's line: its factor and final-loss gap per seed, and what they mean."""
    per_seed = ", ".join(f"seed {s['seed']} " + (f"{s['value']:.2f}x" if s["reached"] else "not reached")
                         + f" ({s['final_gap']:+.1%})" for s in null["per_seed"])
    return (f"{null['config']}: {per_seed}; uncompressed against itself, fp32 rounding alone: a factor or "
            f"final-loss gap inside these is not resolved by this calibration")


# ---- built-in workloads (gradcomp calibrate --quality --model NAME) ------------------------------

MLP_WIDTH, MLP_INPUTS, MLP_CLASSES = 64, 32, 10


def mlp_model(width: int = MLP_WIDTH):
    """A 2-hidden-layer MLP (``MLP_INPUTS`` -> width -> width -> ``MLP_CLASSES``)."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(MLP_INPUTS, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, MLP_CLASSES))


def _teacher_labels(x):
    """Classes of a fixed random teacher network (seed 1234: the same task for every seed)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(MLP_INPUTS, 64, generator=gen)
    w2 = torch.randn(64, MLP_CLASSES, generator=gen)
    return (torch.tanh(x @ w1) @ w2).argmax(-1)


def mlp_batches(rank: int, step: int, seed: int, batch_size: int = 32):
    """Synthetic inputs (normal) with the teacher's classes: rank ``rank``'s batch at ``step``."""
    import torch

    gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + rank) % (2 ** 62))
    x = torch.randn(batch_size, MLP_INPUTS, generator=gen)
    return x, _teacher_labels(x)


def mlp_heldout(count: int = 1024):
    """A fixed held-out set of the teacher task (its own generator: never a training batch)."""
    import torch

    x = torch.randn(count, MLP_INPUTS, generator=torch.Generator().manual_seed(2 ** 40 + 7))
    return [(x, _teacher_labels(x))]


def mlp_workload(batch_size: int | None = None) -> dict:
    """The synthetic teacher task: an MLP of 7K parameters, AdamW lr 1e-3 (seconds a run)."""
    return {"build_model": mlp_model, "heldout": mlp_heldout,
            "batches": functools.partial(mlp_batches, batch_size=batch_size or 32),
            "description": f"a 7K-parameter MLP on a synthetic teacher task, batch {batch_size or 32} per rank"}


def _examples():
    """gradcomp's examples (examples/models.py, examples/data.py): present in a source checkout."""
    try:
        from examples import data, models
    except ImportError:
        raise ValueError("the gpt and resnet20 workloads are gradcomp's examples (examples/models.py, "
                         "examples/data.py): run from a gradcomp source checkout, or give package.module:factory"
                         ) from None
    return data, models


GPT_CORPUS_BYTES, GPT_CONTEXT, GPT_EVAL_WINDOWS = 8_000_000, 128, 256
"""The byte-level GPT's data as docs/convergence.md's runs have it (examples/experiment.py's
defaults): 8 MB of the standard library's Python source, context 128, 256 held-out windows."""


@functools.lru_cache(maxsize=1)
def _gpt_text():
    data, _ = _examples()
    return data.split_text(data.stdlib_corpus(GPT_CORPUS_BYTES), GPT_CONTEXT)


def gpt_model():
    """The byte-level GPT of docs/convergence.md (0.88M parameters)."""
    _, models = _examples()
    return models.GPT(models.GPTConfig(context=GPT_CONTEXT))


def gpt_batches(rank: int, step: int, seed: int, batch_size: int = 16):
    data, _ = _examples()
    return data.text_batch(_gpt_text().train, GPT_CONTEXT, batch_size, data.batch_generator(seed, step, rank))


def gpt_heldout():
    data, _ = _examples()
    x, y = data.heldout_windows(_gpt_text().heldout, GPT_CONTEXT, GPT_EVAL_WINDOWS)
    return [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64)]


def decoupled_adamw(params, lr: float = 2e-3, weight_decay: float = 0.1):
    """AdamW (betas 0.9, 0.95), decay on matrices only: the GPT runs' optimizer."""
    import torch

    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def momentum_sgd(params, lr: float = 0.1, weight_decay: float = 5e-4):
    """SGD, momentum 0.9: the ResNet-20 runs' optimizer."""
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def warmup_cosine(optimizer, steps: int, warmup: float = 0.0):
    """Linear warm-up over ``warmup`` of the steps, then cosine decay to 0 (the runs' schedule)."""
    import torch

    warmup_steps = int(warmup * steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def gpt_workload(batch_size: int | None = None) -> dict:
    _examples()
    return {"build_model": gpt_model, "heldout": gpt_heldout, "optimizer": decoupled_adamw,
            "batches": functools.partial(gpt_batches, batch_size=batch_size or 16),
            "scheduler": functools.partial(warmup_cosine, warmup=0.05),
            "description": f"gradcomp's byte-level GPT (0.88M parameters, Python source), batch {batch_size or 16} "
                           "per rank, AdamW 2e-3 with 5% warm-up and cosine decay over the calibration's steps"}


@functools.lru_cache(maxsize=2)
def _digits(distort_copies: int = 0):
    """examples/data.py's 16x16 digits (``distort_copies``: its randomly distorted variant)."""
    data, _ = _examples()
    return data.load_digits(16, distort_copies=distort_copies)


def resnet20_model():
    _, models = _examples()
    images = _digits()
    return models.resnet20(images.num_classes, in_channels=images.train_x.shape[1])


def resnet20_batches(rank: int, step: int, seed: int, batch_size: int = 32, world_size: int = 2,
                     distort_copies: int = 0):
    data, _ = _examples()
    images = _digits(distort_copies)
    per_epoch = data.steps_per_epoch(len(images.train_y), batch_size, world_size)
    epoch, within = divmod(step, per_epoch)
    return data.image_batch(images, seed, epoch, within, rank, world_size, batch_size)


def resnet20_heldout(distort_copies: int = 0):
    images = _digits(distort_copies)
    return [(images.test_x, images.test_y)]


def resnet20_workload(batch_size: int | None = None, world_size: int = 2, distort_copies: int = 0) -> dict:
    """ResNet-20 on the digits as examples/experiment.py trains it (``distort_copies`` = C: its
    ``--digits-distort C``, distorted training batches and C distortions of each held-out digit)."""
    _examples()
    held_out = "" if not distort_copies else f", distorted ({distort_copies} held-out copies of each digit)"
    return {"build_model": resnet20_model, "heldout": functools.partial(resnet20_heldout, distort_copies),
            "optimizer": momentum_sgd,
            "batches": functools.partial(resnet20_batches, batch_size=batch_size or 32, world_size=world_size,
                                         distort_copies=distort_copies),
            "scheduler": warmup_cosine,
            "description": f"gradcomp's ResNet-20 (0.27M parameters, 16x16 digits{held_out}), batch "
                           f"{batch_size or 32} per rank, SGD 0.1 momentum 0.9 with cosine decay over the "
                           "calibration's steps"}


WORKLOADS = {"mlp": mlp_workload, "gpt": gpt_workload, "resnet20": resnet20_workload}
"""``gradcomp calibrate --quality --model NAME``: each a function of the batch size per rank
returning calibrate_quality's keywords (and a ``description``)."""


def workload(name: str, batch_size: int | None = None, world_size: int = 2) -> dict:
    """calibrate_quality's keywords for a name in :data:`WORKLOADS`, or for
    ``package.module:factory``: ``factory()`` returns a dict with ``build_model``, ``batches``,
    ``heldout`` and optionally ``optimizer``, ``scheduler``, ``loss``, ``description``."""
    if name in WORKLOADS:
        if name == "resnet20":
            return resnet20_workload(batch_size, world_size)
        return WORKLOADS[name](batch_size)
    if ":" not in name:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} or give "
                         "package.module:factory")
    from .launch import _import

    made = _import(name)()
    allowed = {"build_model", "batches", "heldout", "optimizer", "scheduler", "loss", "description"}
    if not isinstance(made, dict) or not {"build_model", "batches", "heldout"} <= set(made) or set(made) - allowed:
        raise ValueError(f"{name}() must return a dict with build_model, batches, heldout and optionally "
                         f"optimizer, scheduler, loss, description")
    return made
