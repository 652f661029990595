"""Quality evidence: how many more (or fewer) steps a compressed run needs to reach the model an
uncompressed run reaches, from recorded held-out evaluation curves. The one home of it: the
break-even verdict (gradcomp.analysis.breakeven, ``gradcomp breakeven``) reads it, and so can
the auto hook and a calibration of the user's own workload.

**Steps factor.** From held-out curves [(step, loss)] of an uncompressed run and of a run with
one choice: the target is the uncompressed run's final held-out loss plus 1% (unless given:
seeds of one configuration end about that far apart, :data:`TARGET_TOLERANCE`; a calibration
whose null ends further apart takes that spread instead, :func:`null_tolerance`); each run's
steps to target are the step of its *first evaluation at or below the target*; the factor is the
choice's steps over the uncompressed run's. No interpolation between evaluations: the factor
moves in steps of the evaluation interval (50 of the GPT's 750 steps, an epoch of ResNet-20's
10), which is what the runs measured. A run that has no evaluation at or below the target within
``max_factor`` times the uncompressed steps (or before its curve ends) gives an explicit result,
``StepsFactor(value=None, reached=False, within=W)``: "not reached within W times the steps",
W the factor its curve covers (at most ``max_factor``). A curve as long as the baseline's covers
1x: "not reached within 1x" only says the run did not reach the baseline's loss within the
baseline's steps, not that it never would.

**The table.** :func:`generate_table` builds gradcomp's own table from the recorded runs under
docs/results (:data:`GROUPS`: each group of runs with the uncompressed runs it is compared with);
each row is one setting, keyed by (workload, optimizer family, front, method, options, scheme,
error feedback), with its steps factor over seeds (the median; each seed paired with the same
seed of the uncompressed run: the same batches; every seed's result and the spread kept), the
final held-out loss's relative gap, the files and the command that re-creates the runs. One rule
for every workload: held-out loss, target the uncompressed run's final held-out loss (for
ResNet-20 too, not its accuracy: the loss is continuous, 359 test images make accuracy move in
0.28-point steps). It ships as ``quality_table.json`` in this package (``python -m
gradcomp.analysis.quality docs/results`` regenerates it; a test checks it equals the generator's
output); a hook row whose method's noise ratio, from the workload's quality calibration under
docs/results/quality-calibration, is at most the noise model's line takes the calibration's rule
(:func:`_noise_model`); a row that missed the target by no more than its workload's null
(uncompressed trained again: :func:`null_row`) is ``unresolved`` and decides nothing.
:func:`rows_from_runs` turns any recorded curves into rows (what a calibration of the
user's workload reuses); a user's file with the same row schema overrides the shipped rows.

**Lookup.** :meth:`Evidence.lookup` finds the row for a choice in a scenario: the same optimizer
family (AdamW for transformer presets, SGD for ResNet/VGG ones: :func:`optimizer_family`), the
same front (``hook``; ``fsdp`` under FSDP; ``zeroone`` / ``dgc`` / ``diloco``), method and the
options the row records; a row of the same method under another (or an unrecorded) scheme is the
nearest setting and is named so. No row: the choice's quality is unmeasured.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..methods import REGISTRY
from ..numfmt import plain

TABLE_FORMAT = 1
TABLE_FILE = "quality_table.json"
DEFAULT_MAX_FACTOR = 4.0
"""How many times the uncompressed run's steps a choice may need and still count as reaching the
target (the evidence rarely covers that much: a curve covers its own length)."""
TARGET_TOLERANCE = 0.01
"""The default target sits this fraction above the uncompressed run's final held-out loss: runs
of the same configuration with other seeds end about this far apart (the GPT's uncompressed
runs: 0.014 nats/byte, 0.8%), so a choice that ends within it has reached the same model; with
none, a choice 0.06% above (fp16 on the GPT) would count as never reaching it."""


WIDENED_WHY = "the null's largest final-loss gap, over 1%"
"""Why a target's tolerance is not :data:`TARGET_TOLERANCE`: a calibration's null set it
(:func:`null_tolerance`)."""


def tolerance_text(tolerance: float) -> str:
    """A target's tolerance as the rule writes it: ``+ 1%``, or ``+ 38% (the null's largest
    final-loss gap, over 1%)`` where a calibration's null widened it."""
    text = f"+ {plain(round(100 * tolerance, 2))}%"
    return text if tolerance == TARGET_TOLERANCE else f"{text} ({WIDENED_WHY})"


def target_rule(tolerance: float = TARGET_TOLERANCE) -> str:
    """The rule's text, with the target's ``tolerance``."""
    return (f"target: the uncompressed run's final held-out loss {tolerance_text(tolerance)}"
            f" (same seed); steps to target: the step of the first held-out "
            "evaluation at or below it (no interpolation); factor: a choice's steps to target / the "
            "uncompressed run's; several seeds: the median")


TARGET_RULE = target_rule()


def null_tolerance(null_gaps) -> float:
    """The target's tolerance a workload's null can resolve: the largest final-loss gap, either
    way, of uncompressed trained again (rounding alone) from uncompressed, when over
    :data:`TARGET_TOLERANCE` (a calibration's rule: gradcomp.emulate.quality.build_table). The
    same reason as that default's, measured on the workload: a choice that ends nearer than its
    own reruns do has reached the same model as far as this workload can tell, and a tighter
    target leaves the null itself reaching it by chance."""
    gaps = [abs(float(g)) for g in null_gaps]
    return max([TARGET_TOLERANCE, *gaps])


FRONTS = ("hook", "fsdp", "zeroone", "dgc", "diloco")
FAMILIES = ("adamw", "sgd")


# ---- the steps factor ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StepsFactor:
    """Steps a choice needs to first reach the target over the uncompressed run's steps to it.

    ``value``: the factor (None when not reached); ``reached``; ``within``: the factor the
    evidence covers (not reached: not within this many times the steps); ``steps``: the step of the
    choice's first evaluation at or below the target (None: none); ``baseline_steps``: the
    uncompressed run's; ``target``: the held-out loss aimed at."""

    value: float | None
    reached: bool
    within: float
    steps: int | None = None
    baseline_steps: int | None = None
    target: float | None = None

    def __post_init__(self):
        if self.reached != (self.value is not None):
            raise ValueError(f"a steps factor is reached exactly when it has a value, got value={self.value!r}, "
                             f"reached={self.reached!r}")
        if self.value is not None and not (math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"a steps factor must be a finite number > 0, got {self.value!r}")
        if not (isinstance(self.within, (int, float)) and math.isfinite(self.within) and self.within > 0):
            raise ValueError(f"'within' must be a finite number > 0, got {self.within!r}")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict) -> StepsFactor:
        if not isinstance(data, dict) or "reached" not in data or "within" not in data:
            raise ValueError(f"a steps factor needs 'value', 'reached' and 'within', got {data!r}")
        return cls(data.get("value"), bool(data["reached"]), data["within"], data.get("steps"),
                   data.get("baseline_steps"), data.get("target"))

    def text(self) -> str:
        """``1.40x`` or ``not reached within 1x``."""
        return f"{self.value:.2f}x" if self.reached else f"not reached within {self.within:.3g}x"


def _check_curve(curve, what: str) -> list[tuple[int, float]]:
    points = [(int(s), float(v)) for s, v in curve]
    if not points:
        raise ValueError(f"{what}: an empty curve")
    steps = [s for s, _ in points]
    if steps[0] < 1 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"{what}: evaluation steps must be >= 1 and strictly increasing, got {steps}")
    if not all(math.isfinite(v) for _, v in points):
        raise ValueError(f"{what}: a held-out loss is not finite")
    return points


def first_at_or_below(curve, target: float) -> int | None:
    """The step of the first evaluation of ``curve`` at or below ``target`` (None: none)."""
    return next((s for s, v in curve if v <= target), None)


def steps_factor(baseline_curve, curve, target: float | None = None,
                 max_factor: float = DEFAULT_MAX_FACTOR, tolerance: float = TARGET_TOLERANCE) -> StepsFactor:
    """The steps ``curve`` needs to first reach ``target`` over the steps ``baseline_curve`` needs
    (curves: [(step, held-out loss)], steps increasing). ``target`` defaults to the baseline's
    final loss times 1 + ``tolerance`` (:data:`TARGET_TOLERANCE`). Not reached at an evaluation within ``max_factor`` x the baseline's steps, or
    before ``curve`` ends: ``StepsFactor(None, False, within)``, ``within`` the factor covered."""
    base = _check_curve(baseline_curve, "baseline curve")
    run = _check_curve(curve, "curve")
    if not (isinstance(max_factor, (int, float)) and math.isfinite(max_factor) and max_factor > 0):
        raise ValueError(f"max_factor must be a finite number > 0, got {max_factor!r}")
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite fraction >= 0, got {tolerance!r}")
    target = base[-1][1] * (1 + tolerance) if target is None else float(target)
    base_steps = first_at_or_below(base, target)
    if base_steps is None:
        raise ValueError(f"the baseline never reaches the target {target!r}: no factor against it")
    covered = min(max_factor, run[-1][0] / base_steps)
    steps = first_at_or_below(run, target)
    if steps is None or steps > max_factor * base_steps:
        return StepsFactor(None, False, covered, None, base_steps, target)
    return StepsFactor(steps / base_steps, True, covered, steps, base_steps, target)


def median_factor(factors: list[StepsFactor]) -> StepsFactor:
    """The median over seeds (not reached counts as the largest); not reached when the median is,
    ``within`` then the least any seed covers."""
    if not factors:
        raise ValueError("no steps factors to take the median of")
    keys = sorted(f.value if f.reached else math.inf for f in factors)
    middle = statistics.median(keys)
    within = min(f.within for f in factors)
    if math.isinf(middle):
        return StepsFactor(None, False, within)
    return StepsFactor(middle, True, within)


# ---- rows from recorded runs --------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One recorded run: its seed, held-out curve, final held-out loss and where it came from
    (``files``: its folder, or files)."""

    seed: int
    curve: tuple
    files: tuple = ()

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]


def rows_from_runs(setting: dict, baseline_runs: list[Run], runs: list[Run],
                   max_factor: float = DEFAULT_MAX_FACTOR, tolerance: float = TARGET_TOLERANCE) -> dict:
    """One table row: ``setting`` (the key fields and descriptions) with the steps factor of
    ``runs`` against ``baseline_runs`` (each run paired with the baseline run of its seed, else
    the first baseline run; the target ``tolerance`` above its final loss), per seed and the median."""
    if not runs or not baseline_runs:
        raise ValueError("a row needs at least one run and one uncompressed run")
    by_seed = {b.seed: b for b in baseline_runs}
    per_seed, gaps, sources, baseline_sources = [], [], [], []
    for run in sorted(runs, key=lambda r: r.seed):
        base = by_seed.get(run.seed, baseline_runs[0])
        factor = steps_factor(base.curve, run.curve, max_factor=max_factor, tolerance=tolerance)
        gap = run.final_loss / base.final_loss - 1.0
        per_seed.append({"seed": run.seed, "baseline_seed": base.seed, **factor.to_dict(),
                         "final_loss": run.final_loss, "baseline_final_loss": base.final_loss,
                         "final_gap": gap})
        gaps.append(gap)
        sources += list(run.files)
        baseline_sources += [f for f in base.files if f not in baseline_sources]
    median = median_factor([StepsFactor.from_dict(s) for s in per_seed])
    values = [s["value"] for s in per_seed if s["reached"]]
    return {**setting, "seeds": [s["seed"] for s in per_seed],
            "steps_factor": {"value": median.value, "reached": median.reached, "within": median.within},
            "spread": {"min": min(values) if values else None, "max": max(values) if values else None,
                       "reached": len(values), "of": len(per_seed)},
            "final_gap": statistics.median(gaps), "per_seed": per_seed,
            "sources": sources, "baseline_sources": baseline_sources}


def read_curve(evals_csv: Path) -> tuple:
    """[(step, held-out loss)] of a runner's evals.csv."""
    with open(evals_csv, newline="") as f:
        return tuple((int(r["step"]), float(r["heldout_loss"])) for r in csv.DictReader(f))


# ---- gradcomp's own runs (docs/results) ---------------------------------------------------------

GROUPS = (
    # (group under docs/results, the group holding its uncompressed runs, the sweep's --out)
    ("gpt", "gpt", "results/conv"),
    ("resnet20", "resnet20", "results/conv"),
    ("fsdp/gpt", "fsdp/gpt", "results/fsdp"),
    ("optim/gpt", "optim/gpt", "results/optim"),
    ("optim/resnet20", "resnet20", "results/optim"),
    ("diloco/gpt", "optim/gpt", "results/diloco"),
    ("diloco/gpt1500", "diloco/gpt1500", "results/diloco1500"),
    ("diloco/gpt3000", "diloco/gpt3000", "results/diloco3000"),
)
"""The groups of runs the table is made of. Left out: optim/gpt-stopped (runs stopped early, no
summary.json), optim/gpt-300steps (no uncompressed run of that length), diloco/link100 (wall
clock over an emulated link, the first steps only)."""

WORKLOADS = {
    "gpt": ("gradcomp's byte-level GPT (0.88M parameters, Python source)", "adamw"),
    "resnet20": ("gradcomp's ResNet-20 (0.27M parameters, 16x16 digits)", "sgd"),
}
FAMILY_NAMES = {"adamw": "AdamW", "sgd": "SGD"}
_LENGTH_KEYS = ("steps", "epochs", "batch_size", "world_size", "corpus_mb", "n_layer", "d_model", "n_head",
                "context", "digits_side", "digits_distort", "cifar", "text")
_LENGTH_DEFAULTS = {"digits_distort": 0}  # a key younger than some recorded runs: their value


def _config_setting(config: dict) -> dict:
    """(front, method, options, scheme, error_feedback, family) of a runner's config.json, in the
    names of gradcomp's methods and of gradcomp.analysis.optim's optimizer options."""
    optimizer = config.get("optimizer", "adamw")
    if optimizer in ("adamw", "sgd"):
        method = config["hook"]
        front = "fsdp" if config.get("fsdp") else "hook"
        options = {"ratio": config["ratio"]} if method == "topk" else {"rank": config["rank"]} if method == "powersgd" else {}
        # the scheme is not recorded: each hook ran its default (docs/convergence.md: all-gather),
        # certain only for a method with one scheme
        offered = () if method == "none" else REGISTRY[method].schemes
        scheme = offered[0] if len(offered) == 1 else None
        ef = None if method in ("none", "fp16") else bool(config["error_feedback"])
        return dict(front=front, method=method, options=options, scheme=scheme, error_feedback=ef,
                    optimizer=optimizer)
    if optimizer == "zeroone":
        momentum = config.get("momentum_method", "sign")
        options = {"warmup_steps": config["exchange_warmup"], "warmup_method": config.get("warmup_method"),
                   "var_refresh_interval": config.get("refresh_interval", 0),
                   "sync_every": config.get("sync_every", 1), "sync_growth": config.get("sync_growth", 0),
                   "method": momentum, "local_updates": config.get("local_updates", "shared")}
        if momentum == "topk":
            options["method_options"] = {"ratio": config["momentum_ratio"]}
        return dict(front="zeroone", method=momentum, options=options, scheme=config.get("sign_scheme"),
                    error_feedback=bool(config["error_feedback"]), optimizer="adamw")
    if optimizer == "dgc":
        options = {"density": config["density"], "warmup_steps": config["exchange_warmup"],
                   "initial_density": config["initial_density"]}
        return dict(front="dgc", method="topk", options=options, scheme="allgather", error_feedback=True,
                    optimizer="sgd")
    if optimizer == "diloco":
        outer = None if config["outer_method"] == "fp32" else config["outer_method"]
        options = {"sync_every": config["sync_every"], "method": outer, "fragments": config.get("fragments", 1)}
        if outer == "topk":
            options["method_options"] = {"ratio": config["outer_ratio"]}
        return dict(front="diloco", method=outer or "none", options=options, scheme=None,
                    error_feedback=outer is not None and bool(config["error_feedback"]), optimizer="adamw")
    raise ValueError(f"unknown optimizer {optimizer!r} in a run's config.json")


def _command(config: dict, seeds: list[int], out: str) -> str:
    """The runner command that re-creates a row's runs (docs/convergence.md)."""
    words = ["python examples/experiment.py sweep --model", config["model"], "--seeds", *map(str, seeds),
             "--configs", config["config"]]
    if config["model"] == "gpt" and config.get("steps") not in (None, 750):
        words += ["--steps", str(config["steps"])]
    if config["model"] != "gpt" and config.get("epochs") not in (None, 10):
        words += ["--epochs", str(config["epochs"])]
    if config.get("eval_every") is not None:
        words += ["--eval-every", str(config["eval_every"])]
    default_lr = 0.1 if config.get("optimizer") in ("sgd", "dgc") else 2e-3
    if config.get("lr") is not None and config["lr"] != default_lr:
        words += ["--lr", f"{config['lr']:g}"]
    return " ".join(words + ["--out", out])


def _runs(folder: Path, prefix: str, results: Path) -> list[tuple[dict, Run]]:
    """(config, Run) of each finished run (summary.json present) in ``folder``/seed*/."""
    out = []
    for seed_dir in sorted(folder.glob("seed*")):
        if not (seed_dir / "summary.json").is_file():
            continue
        config = json.loads((seed_dir / "config.json").read_text())
        rel = f"{prefix}/{seed_dir.relative_to(results).as_posix()}"
        out.append((config, Run(int(config["seed"]), read_curve(seed_dir / "evals.csv"), (rel,))))
    return out


def _describe_workload(config: dict, family: str, front: str, steps: int, seeds: int) -> str:
    name, _ = WORKLOADS[config["model"]]
    length = f"{steps} steps" if config["model"] == "gpt" else f"{steps} steps ({config['epochs']} epochs)"
    optimizer = FAMILY_NAMES[family] if front in ("hook", "fsdp") else {
        "zeroone": "ZeroOneAdam", "dgc": "DGC (momentum SGD)", "diloco": "DiLoCo (inner AdamW)"}[front]
    return (f"measured on {name}, {optimizer}, {config['world_size']} ranks, {length}, "
            f"{seeds} seed{'s' if seeds > 1 else ''}")


def generate_table(results: str | Path, prefix: str = "docs/results",
                   max_factor: float = DEFAULT_MAX_FACTOR) -> dict:
    """gradcomp's quality table from the recorded runs under ``results`` (docs/results): one row
    per configuration of each group in :data:`GROUPS` (the uncompressed ``none`` rows left out:
    they are the reference), files named under ``prefix``."""
    results = Path(results)
    rows = []
    for group, baseline_group, out in GROUPS:
        baseline = [run for _, run in _runs(results / baseline_group / "none", prefix, results)]
        base_configs = {c["seed"]: c for c, _ in _runs(results / baseline_group / "none", prefix, results)}
        if not baseline:
            raise ValueError(f"{results / baseline_group}: no finished uncompressed runs (none/seed*)")
        for folder in sorted(p for p in (results / group).iterdir() if p.is_dir() and p.name != "none"):
            found = _runs(folder, prefix, results)
            if not found:
                continue
            config = found[0][0]
            for c, _ in found:
                base = base_configs.get(c["seed"], next(iter(base_configs.values())))
                differ = [k for k in _LENGTH_KEYS
                          if c.get(k, _LENGTH_DEFAULTS.get(k)) != base.get(k, _LENGTH_DEFAULTS.get(k))]
                if differ or c["model"] != base["model"]:
                    raise ValueError(f"{folder}: seed {c['seed']} differs from its uncompressed run in {differ}")
            setting = _config_setting(config)
            seeds = sorted(c["seed"] for c, _ in found)
            steps = found[0][1].curve[-1][0]
            description = _describe_workload(config, setting["optimizer"], setting["front"], steps, len(seeds))
            key = {"workload": config["model"], **setting}
            rows.append(rows_from_runs(
                {**key, "config": folder.name, "group": group, "steps": steps,
                 "training": {"lr": config.get("lr"), "outer_lr": config.get("outer_lr"),
                              "outer_momentum": config.get("outer_momentum")} if setting["front"] == "diloco"
                 else {"lr": config.get("lr")},
                 "description": description,
                 "command": _command(config, seeds, out)},
                [r for r in baseline], [r for _, r in found], max_factor))
    _noise_model(rows, results / CALIBRATIONS)
    nulls = _null(rows, results, prefix, max_factor)
    return {"format": TABLE_FORMAT, "target_rule": TARGET_RULE, "max_factor": max_factor,
            "run_files": list(RUN_FILES), "nulls": nulls, "rows": rows}


NOISE_MODEL_MAX_RATIO = 0.01
"""A candidate whose noise ratio (the median over the uncompressed runs' evaluations) is at most
this takes the noise model's steps factor instead of its curves' (:func:`noise_model_row`): at most
1% more steps, the same 1% as the loss target; the auto hook's default quality budget
(gradcomp.analysis.auto.DEFAULT_QUALITY_BUDGET) is this line, on the same signal."""


def noise_model_row(row: dict, ratios: list[tuple[int, int, float]]) -> dict:
    """``row`` (a calibration row from its curves) with its steps factor by the rule:

    - the candidate's noise ratio r, the median of ``ratios`` ((seed, step, ratio), measured at
      every evaluation of the uncompressed runs: gradcomp.emulate.quality.NoiseProbe), at most
      :data:`NOISE_MODEL_MAX_RATIO`, and no seed diverged: the factor is **1 + r**. Extra gradient
      noise of r times the minibatch noise scales the noise scale B_noise by 1 + r, and steps to a
      loss go as S_min (1 + B_noise / B) (McCandlish et al. 2018), so the steps grow by at most
      1 + r (unbiased, independent errors; error feedback only lowers it). Below that line a short
      calibration's curves do not decide: they move by more than the 1% target for reasons a full
      run does not keep (an early effect of a small error, or rounding alone: docs/breakeven.md).
    - a larger ratio, and curves that reach the target in fewer steps than uncompressed: the
      factor is **1**, the model's other bound (extra noise raises B_noise, it never lowers the
      steps), so a short calibration's noise cannot credit compression with faster convergence
      (int4 on the GPT: 0.93x at 100 of 750 steps, 1.08x in full).
    - otherwise (a larger ratio, no ratio: PowerSGD, a divergence): the curves' factor.

    The curves' factor stays in ``curve_factor``, the ratio in ``noise_ratio``; ``basis`` names
    which decided (``noise model``, ``noise model's floor``, ``curves``)."""
    curves = row["steps_factor"]
    measured = [r for _, _, r in ratios]
    ratio = statistics.median(measured) if measured else None
    row["noise_ratio"] = {"median": ratio, "limit": NOISE_MODEL_MAX_RATIO,
                          "per_step": [[seed, step, r] for seed, step, r in ratios]}
    row["curve_factor"] = dict(curves)
    if ratio is None or row.get("diverged"):
        row["basis"] = "curves"
    elif ratio <= NOISE_MODEL_MAX_RATIO:
        row["steps_factor"] = {"value": 1.0 + ratio, "reached": True, "within": curves["within"]}
        row["basis"] = "noise model"
    elif curves["reached"] and curves["value"] < 1.0:
        row["steps_factor"] = {"value": 1.0, "reached": True, "within": curves["within"]}
        row["basis"] = "noise model's floor"
    else:
        row["basis"] = "curves"
    return row


CALIBRATIONS = "quality-calibration"
"""The folder under docs/results of the workloads' quality calibrations (``gradcomp calibrate
--quality``), whose noise ratios the table's hook rows read."""


def _noise_model(rows: list[dict], folder: Path) -> None:
    """The calibration's rule (:func:`noise_model_row`) on the table's hook rows:
    a method whose noise ratio, measured on the same workload's uncompressed runs by its
    calibration file under ``folder`` (same method, options and error feedback), is at most the
    noise model's line takes the factor 1 + ratio, its curves' kept in ``curve_factor``. A
    near-lossless method's full runs cannot resolve its cost where the held-out loss at the end
    of training moves more between seeds than the 1% target (ResNet-20's, on 359 images)."""
    def setting(workload: str, row: dict) -> tuple:
        return workload, row["method"], json.dumps(row.get("options") or {}, sort_keys=True), row.get("error_feedback")

    measured = {}
    for path in sorted(folder.glob("*.json")):
        calibration = json.loads(path.read_text())
        for row in calibration["rows"]:
            if row.get("noise_ratio") and row["noise_ratio"].get("per_step"):
                measured[setting(calibration["calibration"]["workload"], row)] = [
                    tuple(x) for x in row["noise_ratio"]["per_step"]]
    for row in rows:
        if row.get("front") == "hook" and setting(row["workload"], row) in measured:
            noise_model_row(row, measured[setting(row["workload"], row)])


NULLS = "null"
"""The folder under docs/results of each workload's null (``null/<model>/seed*``): uncompressed
trained again with DDP buckets of 0.25 MB, the same sums in another order (benchmarks/auto_quality.py
``run --what null``): what rounding alone does to a run."""


def null_row(row: dict, null: dict) -> dict:
    """``row`` with ``unresolved`` (why) when it missed the target by no more than its workload's
    ``null`` does (:func:`null_summary`): the row's median factor not reached, the null not
    reaching the same target on every seed, and the row's median final gap at most the null's
    largest. Rounding alone moves a run that far, so such a miss is not evidence that the method
    costs quality (nor that it does not): the verdicts and the auto hook treat the row as deciding
    nothing."""
    if (not row["steps_factor"]["reached"] and null["reached"] < null["of"]
            and row["final_gap"] <= max(null["final_gaps"])):
        gaps = " / ".join(f"{g:+.1%}" for g in null["final_gaps"])
        row["unresolved"] = (f"inside the null: uncompressed trained again (rounding alone) reaches this target "
                             f"on {null['reached']} of {null['of']} seeds and ends {gaps} from it")
    return row


def null_summary(null: dict) -> dict:
    """A workload's null as the table keeps it, from its row (:func:`rows_from_runs` of the null's
    runs against the uncompressed runs): seeds reaching the target, final gaps per seed, files."""
    return {"reached": null["spread"]["reached"], "of": null["spread"]["of"],
            "final_gaps": [s["final_gap"] for s in null["per_seed"]], "files": null["sources"]}


def _null(rows: list[dict], results: Path, prefix: str, max_factor: float) -> dict:
    """Each workload's null (``gpt``, ``resnet20``: :data:`NULLS`, skipped if absent) and
    :func:`null_row` on the rows compared with that workload's own uncompressed runs."""
    nulls = {}
    for workload in WORKLOADS:
        found = _runs(results / NULLS / workload, prefix, results)
        if found:
            baseline = [run for _, run in _runs(results / workload / "none", prefix, results)]
            nulls[workload] = null_summary(rows_from_runs({}, baseline, [run for _, run in found], max_factor))
    for row in rows:
        baseline_group = next(b for g, b, _ in GROUPS if g == row["group"])
        if baseline_group in nulls:
            null_row(row, nulls[baseline_group])
    return nulls


def table_text(table: dict) -> str:
    """The table as the JSON text shipped (sorted keys, one indent)."""
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


# ---- loading and lookup -------------------------------------------------------------------------

RUN_FILES = ("config.json", "evals.csv", "summary.json")
"""What each run folder a row names holds (the runner's output, docs/convergence.md)."""
REQUIRED = ("front", "method", "steps_factor")


def check_rows(rows, where: str) -> list[dict]:
    """``rows`` checked against the row schema (ValueError naming ``where`` and the row)."""
    if not isinstance(rows, list):
        raise ValueError(f"{where}: 'rows' must be a list of rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or any(k not in row for k in REQUIRED):
            raise ValueError(f"{where}: row {i} needs {', '.join(REQUIRED)}")
        if row["front"] not in FRONTS:
            raise ValueError(f"{where}: row {i}: front must be one of {', '.join(FRONTS)}, got {row['front']!r}")
        if row.get("optimizer") is not None and row["optimizer"] not in FAMILIES:
            raise ValueError(f"{where}: row {i}: optimizer must be one of {', '.join(FAMILIES)} (or absent: any)")
        if not isinstance(row.get("options", {}), dict):
            raise ValueError(f"{where}: row {i}: options must be an object")
        StepsFactor.from_dict(row["steps_factor"])  # validates
        out.append(row)
    return out


def load_table(path: str | Path | None = None) -> dict:
    """The shipped table (``path`` None) or a file with the same schema (``{"rows": [...]}``)."""
    if path is None:
        text = resources.files("gradcomp.analysis").joinpath(TABLE_FILE).read_text()
        where = f"gradcomp/analysis/{TABLE_FILE}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the quality file {path}: {exc.strerror}") from None
        where = str(path)
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(table, dict) or "rows" not in table:
        raise ValueError(f"{where}: a quality file is an object with 'rows' (see docs/breakeven.md)")
    table["rows"] = check_rows(table["rows"], where)
    tolerance = table.get("target_tolerance", TARGET_TOLERANCE)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
            math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"{where}: target_tolerance must be a finite fraction >= 0, got {tolerance!r}")
    return table


TRANSFORMERS = ("gpt", "bert", "llama", "transformer", "vit", "t5")
CONVNETS = ("resnet", "vgg", "cnn", "conv")


def optimizer_family(model_name: str) -> str | None:
    """The optimizer a model is usually trained with: ``adamw`` for transformers (GPT, BERT,
    LLaMA presets), ``sgd`` for ResNet/VGG; None when the name says neither."""
    import re

    tokens = [t for t in re.split(r"[^a-z0-9]+", (model_name or "").lower()) if t]
    for words, family in ((TRANSFORMERS, "adamw"), (CONVNETS, "sgd")):
        if any(t.startswith(words) for t in tokens):
            return family
    return None


@dataclass(frozen=True)
class Match:
    """A row found for a choice: ``source`` (``table``, ``user``), whether it is the exact
    setting (``exact``: same scheme, or the scheme does not matter) and a note when not."""

    row: dict
    source: str
    exact: bool
    note: str = ""

    @property
    def factor(self) -> StepsFactor:
        return StepsFactor.from_dict(self.row["steps_factor"])

    @property
    def unresolved(self) -> str:
        """Why the row decides nothing (its miss is inside its workload's null: :func:`null_row`), or ""."""
        return self.row.get("unresolved", "")

    @property
    def decisive_factor(self) -> StepsFactor | None:
        """The factor a verdict may rest on: None when the row is unresolved."""
        return None if self.unresolved else self.factor

    def to_dict(self) -> dict:
        r = self.row
        return {"source": "gradcomp's table" if self.source == "table" else f"user file {self.source}",
                "description": r.get("description", ""), "exact": self.exact, "note": self.note,
                "row": {k: r.get(k) for k in ("workload", "optimizer", "front", "method", "options", "scheme",
                                              "error_feedback", "config", "steps", "seeds")},
                "steps_factor": r["steps_factor"], "spread": r.get("spread"), "final_gap": r.get("final_gap"),
                "files": r.get("sources", []), "baseline_files": r.get("baseline_sources", []),
                "command": r.get("command"), "unresolved": r.get("unresolved", "")}


def _resolved_options(front: str, method: str, options: dict) -> dict:
    """The choice's options with its defaults filled (a method's fields, or an optimizer's)."""
    if front in ("zeroone", "dgc", "diloco"):
        from .optim import _options

        return _options(front, options)
    if method == "none":
        return {}
    import dataclasses

    from ..methods import get_method

    m = get_method(method, **options)
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m)} if dataclasses.is_dataclass(m) else dict(options)


@dataclass(frozen=True)
class Evidence:
    """Where a scenario's steps factors come from: gradcomp's table, optionally overridden by a
    user's rows, for one optimizer ``family`` (None: only rows without one, e.g. a user's)."""

    family: str | None
    table: dict = field(default_factory=dict)
    user: dict | None = None
    user_path: str = ""

    @classmethod
    def load(cls, family: str | None, path: str | Path | None = None) -> Evidence:
        if family is not None and family not in FAMILIES:
            raise ValueError(f"unknown optimizer family {family!r}; choose one of {', '.join(FAMILIES)}")
        return cls(family, load_table(), load_table(path) if path else None, str(path or ""))

    def lookup(self, front: str, method: str, options: dict | None = None, scheme: str | None = None,
               error_feedback: bool | None = True) -> Match | None:
        """The row for a choice (user rows first), or None: quality unmeasured."""
        resolved = _resolved_options(front, method, dict(options or {}))
        for source, table in ((self.user_path, self.user), ("table", self.table)):
            if not table:
                continue
            candidates = []
            for row in table["rows"]:
                if row["front"] != front or row["method"] != method:
                    continue
                family = row.get("optimizer")
                if family is not None and family != self.family:
                    continue
                ef = row.get("error_feedback")
                if ef is not None and error_feedback is not None and ef != error_feedback:
                    continue
                if any(resolved.get(k) != v for k, v in row.get("options", {}).items()):
                    continue
                exact = scheme is None or row.get("scheme") == scheme
                candidates.append((not exact, -row.get("steps", 0), -len(row.get("seeds", [])),
                                   row["steps_factor"]["value"] if row["steps_factor"]["reached"] else math.inf,
                                   row.get("config", ""), exact, row))
            if candidates:
                *_, exact, row = min(candidates, key=lambda c: c[:5])
                note = "" if exact else (
                    f"nearest setting: measured with the {row['scheme']} scheme" if row.get("scheme")
                    else "nearest setting: the runs' scheme is not recorded (the default then: all-gather)")
                return Match(row, source, exact, note)
        return None


def main(argv=None) -> int:
    """``python -m gradcomp.analysis.quality [RESULTS]``: regenerate the shipped table."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    results = Path(args[0] if args else "docs/results")
    path = Path(__file__).with_name(TABLE_FILE)
    path.write_text(table_text(generate_table(results)))
    print(f"{path}: {len(json.loads(path.read_text())['rows'])} rows from {results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
