"""What the "auto" hook (gradcomp.hooks.auto) decides with, computed from numbers alone: its
policy of allowed choices, the link rescaled by the seconds per byte the hook's own collectives
took beyond the probe's fit, and the cost model's pick for a step's buckets. What it measures at
run time (the costs of the methods on this device and their cache, the link probe) is
gradcomp.analysis.probe.

    from gradcomp.analysis.auto import auto_plan, format_auto_plan
    print(format_auto_plan(make_scenario("gpt2-1.5b", 64, "h100", "100gbe")))

The pick is per bucket: ``simulate`` (gradcomp.analysis.costmodel) prices a whole step under one
choice per bucket, and :func:`choose_per_bucket` searches the plans (the best uniform choice,
then each run of buckets in turn tries every allowed choice with the others fixed).
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..methods import get_method
from ..schemes import SCHEMES
from .collectives import Link, Network
from .costmodel import UNCOMPRESSED, Bucket, Choice, Scenario, ddp_buckets, schemes, simulate
from .models import ModelSpec, Parameter
from .profile import Compute, LinearCost, MethodCost, Profile
from .quality import NOISE_MODEL_MAX_RATIO

DEFAULT_POLICY = (UNCOMPRESSED, "fp16", "bf16", "int8")
"""Methods the convergence runs (docs/convergence.md) show harmless: fp16 and int8 with error
feedback lose nothing; bf16 is fp16's range-for-precision twin."""
OPT_IN = ("int4", "sign", "topk", "powersgd")
"""Methods that change convergence (docs/convergence.md): candidates when named, or by default when
auto is given the optimizer (EVERY_METHOD), and then only within the quality budget."""
EVERY_METHOD = (*DEFAULT_POLICY, *OPT_IN)
"""auto's default policy when it is given the optimizer and a quality budget: every method, each
admitted by its noise ratio in the optimizer's coordinates and the measured table (the policy the
trained-to-the-end runs of docs/auto.md measured)."""
MIN_WIRE_S_PER_BYTE = 8e-15  # 1000 Tbit/s: the fastest wire a rescaled link may have
MIN_OBSERVED_BYTES = 512 << 10
"""Collectives that move fewer bytes per rank say little about the bandwidth: latency and noise
dominate, and a token-bucket shaper lets them through at full speed after each idle period (tc
tbf with gradcomp.emulate's 256 KiB burst, which the two directions of a rank pair share)."""
PROBE_EXTRA_S = 1e-9  # the step in seconds per byte by which a scheme's bytes on the wire are counted
POLICY_OPTIONS = {"powersgd": ("rank",)}
"""The options a policy entry may name (``powersgd:rank=8``), by method: a choice's label does
not show its options, so each method enters a policy with one set of them."""


def policy_entry(text: str) -> Choice:
    """One entry of auto's policy as a Choice: ``method``, ``method:scheme`` or, for the options
    of POLICY_OPTIONS, ``method:name=value`` (``powersgd:rank=8``: whole numbers)."""
    if not isinstance(text, str):
        raise TypeError(f"auto: a policy entry is a method name such as 'int8' or 'powersgd:rank=8', got {text!r}")
    parts = text.strip().lower().split(":")
    options = {}
    for part in parts:
        if "=" in part:
            name, _, value = part.partition("=")
            if name not in POLICY_OPTIONS.get(parts[0], ()):
                known = ", ".join(f"{m}:{o}=..." for m, opts in POLICY_OPTIONS.items() for o in opts)
                raise ValueError(f"auto: {text!r}: a policy entry takes no option {name!r}; the options it takes: {known}")
            if not value.isdigit():
                raise ValueError(f"auto: {text!r}: {name} must be a whole number, got {value!r}")
            options[name] = int(value)
    return Choice.parse(":".join(part for part in parts if "=" not in part), options)


def policy_choices(methods=DEFAULT_POLICY) -> list[Choice]:
    """The choices auto may take: ``none`` (always) and every scheme of each named method, or the
    one scheme named (``int8:twophase``), with the options named (:func:`policy_entry`); a method
    with two sets of options, or a hierarchical choice, is refused (ValueError)."""
    out, options = [Choice(UNCOMPRESSED)], {}
    for text in methods:
        choice = policy_entry(text)
        if choice.method == UNCOMPRESSED:
            continue
        if choice.hierarchical:
            raise ValueError(f"auto cannot switch to {text!r}: it has no hierarchical choices; register "
                             "the hierarchical hook on its own (gradcomp.hooks.register(model, ..., node_size=...))")
        if options.setdefault(choice.method, choice.options) != choice.options:
            raise ValueError(f"auto: {choice.method} is named with two sets of options "
                             f"({options[choice.method]} and {choice.options}); name it once")
        named_scheme = len([part for part in text.split(":") if "=" not in part]) > 1
        for scheme in ((choice.scheme,) if named_scheme else schemes(choice.method)):
            candidate = replace(choice, scheme=scheme)
            if candidate not in out:
                out.append(candidate)
    return out


# ---- the link -----------------------------------------------------------------------------------

def collective_s(network: Network, scheme: str, wire_bytes: float) -> float:
    """Seconds of the collectives that carry ``wire_bytes`` (as the hooks count them) under a
    scheme: ``allreduce`` (and uncompressed), ``allgather``, ``twophase`` (p chunk payloads in an
    all-to-all, then one in an all-gather)."""
    return SCHEMES[scheme].collective_s(network, wire_bytes)


def _with_beta(link: Link, beta_s: float) -> Link:
    """``link`` at the bandwidth that makes its seconds per byte ``beta_s`` (host cost kept)."""
    wire = max(beta_s - link.per_byte_s, MIN_WIRE_S_PER_BYTE)
    return replace(link, bandwidth_gbps=8.0 / (wire * 1e9 * link.efficiency))


def with_extra_per_byte(network: Network, extra_s: float) -> Network:
    """``network`` with ``extra_s`` seconds added to every byte of every collective (negative:
    taken off, down to a floor): a shaped or congested wire adds the same cost per byte whatever
    the collective, on top of the host costs the probe measured."""
    gather = network.allgather_link
    return replace(network, link=_with_beta(network.link, network.link.beta_s + extra_s),
                   allgather_link=None if gather is None else _with_beta(gather, gather.beta_s + extra_s))


def extra_per_byte(probed: Network, observations) -> float | None:
    """The seconds per byte the observed collectives took beyond the ``probed`` network's
    prediction: the least over ``observations`` ((scheme, wire bytes, seconds from launch to
    arrival)) of (seconds - predicted) / (bytes the scheme's collectives move per rank), counting
    only collectives that move at least MIN_OBSERVED_BYTES per rank; None without such. The
    least, because everything else a collective waits for (an earlier collective, a busy core,
    the GIL, a late peer) only adds."""
    stepped = with_extra_per_byte(probed, PROBE_EXTRA_S)
    extras = []
    for scheme, nbytes, seconds in observations:
        predicted = collective_s(probed, scheme, nbytes)
        moved = (collective_s(stepped, scheme, nbytes) - predicted) / PROBE_EXTRA_S
        if moved >= MIN_OBSERVED_BYTES:
            extras.append((seconds - predicted) / moved)
    return min(extras) if extras else None


# ---- the choice ---------------------------------------------------------------------------------

def step_scenario(bucket_tensors, backward_shares, backward_s: float, network: Network,
                  profile: Profile) -> tuple[Scenario, list[Bucket]]:
    """A Scenario of one measured step: one bucket per item of ``bucket_tensors`` (its element
    count, or its tensors' shapes: what a per-tensor method such as PowerSGD compresses by), in
    the order backward makes them ready, each with its share of ``backward_s``; no forward or
    optimizer time (they are the same under every choice)."""
    shapes = [((n,),) if isinstance(n, int) else tuple(tuple(s) for s in n) for n in bucket_tensors]
    buckets = [Bucket(s, share) for s, share in zip(shapes, backward_shares)]
    spec = ModelSpec("measured step", tuple(Parameter(f"bucket{i}.{j}", shape) for i, bucket in enumerate(shapes)
                                            for j, shape in enumerate(bucket)))
    return Scenario(spec, network, profile, Compute(0.0, backward_s)), buckets


def predict(scenario: Scenario, choices, buckets: list[Bucket] | None = None) -> dict[str, float]:
    """Predicted step seconds (``simulate``) by choice label; choices whose method the profile
    has no costs for are left out."""
    return {c.label: simulate(scenario, c, buckets).step_s for c in choices
            if c.method == UNCOMPRESSED or c.method in scenario.profile.methods}


DEFAULT_QUALITY_BUDGET = NOISE_MODEL_MAX_RATIO
"""The auto hook's default quality budget: the largest ratio of the variance a method's
compression error adds to the averaged gradient over the variance of the minibatch noise already
in it (:func:`noise_ratio`). 0.01: the error may add at most a hundredth to the noise the
optimizer already absorbs, so by the noise model (steps to a loss grow by at most 1 + the ratio;
gradcomp.analysis.quality.noise_model_row) at most 1% more steps, the same 1% as the loss target.
On the byte-level GPT under AdamW (docs/auto.md) int8 stays under 0.004, int4 at 0.013-0.061
after the first steps, sign at 0.7-2.2 and top-k 1% at 0.10-0.52; the GPT trained to the end with
int4 ended +0.30% and +1.08% above uncompressed (seeds 0 and 1), and auto under a budget of 0.1,
taking int4, +0.61 / +1.60 / +0.96%: 0.01 keeps the GPT to int8 and fp16/bf16. Per-rank relative
errors (||C(g) - g||^2 / ||g||^2) of Gaussian gradients: int8 near 4e-5, int4 near 0.01; the ratio
is at least (p - 1) / p times the relative error (the noise is at most the gradient's energy)."""
NOISE_FLOOR = 2.0 ** -20
"""The noise variance is taken as at least this fraction of the ranks' mean squared gradient, so
that ranks seeing the same data (no measurable noise) still admit an error far below fp32's own
rounding (fp16's relative error is about 2^-22)."""


def noise_ratio(local_sq: float, error_sq: float, mean_sq: float, world_size: int) -> float:
    """The variance a method's error adds to the averaged gradient over its minibatch noise, from
    sums over ranks: ``local_sq`` = sum_i ||g_i||^2 (each rank's gradient of the bucket),
    ``error_sq`` = sum_i ||C(g_i) - g_i||^2 (each rank compressing its own gradient, without
    error feedback), ``mean_sq`` = ||mean_i g_i||^2.

    With independent errors the averaged gradient's error variance is mean_i ||e_i||^2 / p, and
    its noise variance sigma^2 / p, where sigma^2 = p / (p - 1) (mean_i ||g_i||^2 - ||g_mean||^2)
    estimates one rank's minibatch noise (floored at NOISE_FLOOR x mean_i ||g_i||^2): the ratio
    is mean_i ||e_i||^2 / sigma^2. A mean taken from a compressed average includes that
    average's error, which lowers sigma^2: the ratio errs high (toward refusing)."""
    if world_size < 2:
        raise ValueError(f"noise_ratio needs at least 2 ranks, got {world_size}")
    mean_local = local_sq / world_size
    noise = max(world_size / (world_size - 1) * (mean_local - mean_sq), NOISE_FLOOR * mean_local)
    if noise <= 0:  # every gradient zero: nothing to lose
        return 0.0 if error_sq <= 0 else math.inf
    return (error_sq / world_size) / noise


def squared_norm(vector, weight=None):
    """||w * v||^2 of ``vector`` times ``weight`` coordinate by coordinate (its shape; None: 1), a
    float64 scalar on the vector's device (no host synchronisation): every term of
    :func:`noise_ratio` in the coordinates ``weight`` gives (:func:`update_weight`)."""
    return (vector if weight is None else vector * weight).double().square().sum()


def compression_error_sq(method, gradient, weight=None):
    """||C(g) - g||^2 of a flat gradient ``g`` (fp32 [n]) compressed and decoded by ``method`` (no
    error feedback), a float64 scalar on g's device (no host synchronisation): the error term of
    :func:`noise_ratio`. ``weight`` (fp32 [n]): the error scaled by it coordinate by coordinate
    first (:func:`squared_norm`)."""
    return squared_norm(method.decompress(method.compress(gradient)).reshape(-1).float() - gradient, weight)


UPDATE_QUALITY_BUDGET = 0.04
"""The auto hook's default quality budget when it is given the optimizer (``optimizer=``) and so
measures the noise ratio in the coordinates of the optimizer's update (:func:`update_weight`):
where the error lands in the step the model takes. On the workloads measured here (docs/auto.md),
a fixed method whose median ratio in those coordinates is at most 0.04 reached the uncompressed
run's quality every time (int4 and int8 on ResNet-20 under SGD and under AdamW), and int4 on the
byte-level GPT under AdamW, which missed it on one seed of three, measures 0.037-0.093 (median
0.052) there: in the gradient's coordinates it measures 0.033, which is why the budget without
the optimizer stays at DEFAULT_QUALITY_BUDGET."""


def torch_optimizer(optimizer):
    """The torch optimizer inside a framework's wrapper: Accelerate's ``AcceleratedOptimizer`` (and
    so the Hugging Face Trainer's ``optimizer``) keeps it as ``.optimizer``, Lightning's
    ``LightningOptimizer`` as ``._optimizer``; any other object is returned as it is."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def optimizer_family(optimizer) -> str | None:
    """``adamw`` for torch's AdamW and Adam, ``sgd`` for SGD (either inside a framework's wrapper:
    :func:`torch_optimizer`), None for another optimizer."""
    import torch

    optimizer = torch_optimizer(optimizer)
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        return "adamw"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return None


def update_family(optimizer) -> str:
    """:func:`optimizer_family` of an optimizer whose update's coordinates :func:`update_weight`
    knows; ValueError naming another."""
    family = optimizer_family(optimizer)
    if family is None:
        raise ValueError(f"the update's coordinates are known for torch's SGD, Adam and AdamW, not for "
                         f"{type(torch_optimizer(optimizer)).__name__}: measure in the gradient's instead "
                         "(auto: optimizer=None)")
    return family


def update_weight(optimizer, params, average=None):
    """What ``optimizer`` multiplies each coordinate of a step's averaged gradient by to make its
    update, up to the learning rate and the momentum's smoothing: fp32 [n], ``params`` flattened
    in order; None where that factor is the same for every coordinate (SGD).

    Adam and AdamW: 1 / (sqrt(v_hat) + eps), v_hat their second moment (amsgrad: its running
    maximum) bias-corrected, as of their last step, or, given ``average`` (fp32 [n], the step's
    averaged gradient), updated with it as their next step will (then exactly what that step
    divides by). Without ``average``, None when a parameter has no second moment yet (no step
    taken) or is not the optimizer's. Another optimizer: ValueError (its coordinates are not
    known here)."""
    import torch

    if update_family(optimizer) == "sgd":
        return None
    optimizer = torch_optimizer(optimizer)
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    out, offset = [], 0
    for p in params:
        group, state = groups.get(id(p)), optimizer.state.get(p, {})
        if group is None or (average is None and "exp_avg_sq" not in state):
            return None
        beta2, eps, amsgrad = group["betas"][1], group["eps"], group.get("amsgrad", False)

        def kept(key: str) -> torch.Tensor:  # a second moment as of the last step (zeros before the first)
            if key not in state:
                return torch.zeros(p.numel(), device=p.device)
            return state[key].detach().reshape(-1).float()
        v, step = kept("max_exp_avg_sq" if amsgrad else "exp_avg_sq"), int(state.get("step", 0))
        if average is not None:
            g = average[offset:offset + p.numel()].float()
            v = beta2 * kept("exp_avg_sq").to(g.device) + (1 - beta2) * g * g
            if amsgrad:
                v = torch.maximum(kept("max_exp_avg_sq").to(g.device), v)
            step += 1
        out.append(1.0 / ((v / (1 - beta2 ** step)).sqrt() + eps))
        offset += p.numel()
    return torch.cat(out) if out else None


def admitted_methods(ratios: dict[str, float], budget: float | None, refused) -> set[str]:
    """The methods of ``ratios`` (method -> noise ratio, one bucket) a quality ``budget`` admits:
    ratio within it (every one when ``budget`` is None) and not ``refused`` by the measured table."""
    return {m for m, r in ratios.items() if (budget is None or r <= budget) and m not in refused}


def refused_by_evidence(choices, family: str | None) -> dict[str, str]:
    """Method -> why: the methods of ``choices`` whose measured hook runs under optimizer
    ``family`` ("adamw", "sgd"; None: under either) did not reach the uncompressed run's target
    (gradcomp.analysis.quality's table, the rows the analyser reads too). A method without such
    a row, or whose row missed by no more than its workload's null (``unresolved``), is not
    refused here: its noise ratio decides."""
    from .quality import FAMILIES, Evidence

    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown optimizer family {family!r}; choose one of {', '.join(FAMILIES)} or None")
    evidence = [Evidence.load(fam) for fam in (FAMILIES if family is None else (family,))]
    out = {}
    for choice in choices:
        if choice.method == UNCOMPRESSED or choice.method in out:
            continue
        for table in evidence:
            match = table.lookup("hook", choice.method, choice.options)
            if match is not None and not match.unresolved and not match.factor.reached:
                out[choice.method] = f"{match.row.get('description', table.family)}: {match.factor.text()}"
                break
    return out


def allowed_labels(methods=DEFAULT_POLICY, quality_budget: float | None = DEFAULT_QUALITY_BUDGET,
                   family: str | None = None) -> tuple[str, ...]:
    """The labels of the choices an auto hook with this policy may ever take: ``policy_choices``,
    less the methods the measured table refuses (:func:`refused_by_evidence`) when it has a
    quality budget. (Its noise ratios may refuse more during a run.)"""
    choices = policy_choices(methods)
    refused = {} if quality_budget is None else refused_by_evidence(choices, family)
    return tuple(c.label for c in choices if c.method not in refused)


DEFAULT_HYSTERESIS = 0.1
"""A new plan must be predicted this fraction faster than the current one (the auto hook's
default; ``gradcomp breakeven``'s plan starts from no compression with it)."""
MAX_RUNS = 16
"""Buckets are decided in at most this many runs of consecutive buckets (one choice each), so a
decision costs at most (1 + 2 MAX_RUNS) x (allowed choices) simulations of one step."""


def choose_per_bucket(scenario: Scenario, choices, buckets: list[Bucket], current: list[Choice],
                      hysteresis: float, admitted=None) -> tuple[list[Choice], float]:
    """(one Choice per bucket, predicted step seconds): start from the best uniform plan, then
    let each run of consecutive buckets (at most MAX_RUNS runs) take the allowed choice that
    lowers the predicted step most with the others fixed, twice over. ``admitted``: None, or per
    bucket the methods its quality budget admits (uncompressed always is): a plan gives no
    bucket another method (a uniform plan leaves such buckets uncompressed). The plan replaces
    ``current`` (one Choice per bucket) only if it is predicted ``hysteresis`` faster, or if
    ``current`` gives a bucket a method no longer admitted."""
    allowed = [c for c in choices if c.method == UNCOMPRESSED or c.method in scenario.profile.methods]
    n = len(buckets)

    def ok(i: int, choice: Choice) -> bool:
        return choice.method == UNCOMPRESSED or admitted is None or choice.method in admitted[i]

    def step_s(plan) -> float:
        return simulate(scenario, plan, buckets).step_s

    uniform = {c.label: [c if ok(i, c) else Choice(UNCOMPRESSED) for i in range(n)] for c in allowed}
    uniform_s = {label: step_s(p) for label, p in uniform.items()}
    best = min(uniform_s, key=lambda label: (uniform_s[label], label))
    plan, plan_s = uniform[best], uniform_s[best]
    runs = [range(r * n // min(n, MAX_RUNS), (r + 1) * n // min(n, MAX_RUNS)) for r in range(min(n, MAX_RUNS))]
    for _ in range(2):
        improved = False
        for run in runs:
            for choice in allowed:
                if all(plan[i] == choice for i in run) or not all(ok(i, choice) for i in run):
                    continue
                trial = [choice if i in run else c for i, c in enumerate(plan)]
                trial_s = step_s(trial)
                if trial_s < plan_s:
                    plan, plan_s, improved = trial, trial_s, True
        if not improved:
            break
    current_s = step_s(current)
    if all(ok(i, c) for i, c in enumerate(current)) and plan_s > current_s * (1.0 - hysteresis):
        return list(current), current_s
    return plan, plan_s


def hook_compute_s(profile: Profile, choice: Choice, tensors, world_size: int) -> float:
    """The compress and decode seconds the cost model charges one bucket (``tensors``: its element
    count or its tensors' shapes, as :func:`step_scenario` takes them) under ``choice`` (what the
    hooks' ``compress_s`` + ``decompress_s`` statistics count: the averaging pass left out)."""
    if choice.method == UNCOMPRESSED:
        return 0.0
    network = Network(world_size, Link("none", 1.0, 0.0))
    scenario, buckets = step_scenario([tensors], [1.0], 0.0, network, profile)
    return simulate(scenario, choice, buckets).compress_s - profile.average(buckets[0].numel)


def decode_s(profile: Profile, choice: Choice, numel: int, world_size: int) -> float:
    """The seconds the cost model charges for decoding one bucket's collective result: one
    payload (all-reduce), or all ``world_size`` payloads (all-gather)."""
    if choice.method == UNCOMPRESSED:
        return 0.0
    return SCHEMES[choice.scheme].decode_s(profile.method(choice.method), numel, world_size)


def scaled_costs(profile: Profile, factor: float) -> Profile:
    """``profile`` with every method's compress and decode seconds times ``factor`` (what the
    hooks measured in training over what the cached costs predict)."""
    def times(cost: LinearCost) -> LinearCost:
        return LinearCost(cost.fixed_s * factor, cost.per_element_s * factor)
    return replace(profile, methods={name: MethodCost(times(c.compress), times(c.decompress),
                                                      c.output_per_element_s * factor)
                                     for name, c in profile.methods.items()})


def auto_plan(scenario: Scenario, methods=DEFAULT_POLICY) -> list[dict]:
    """What the auto hook would choose for each of the scenario's DDP buckets, starting from no
    compression with its default hysteresis: one record per bucket (``bucket``, ``elements``,
    ``choice``, ``step_s`` predicted, ``none_step_s``)."""
    buckets = ddp_buckets(scenario.model, scenario.bucket_cap_mb)
    none = [Choice(UNCOMPRESSED)] * len(buckets)
    plan, plan_s = choose_per_bucket(scenario, policy_choices(methods), buckets, none, DEFAULT_HYSTERESIS)
    none_s = simulate(scenario, none, buckets).step_s
    return [{"bucket": i, "elements": b.numel, "choice": c.label, "step_s": plan_s,
             "none_step_s": none_s} for i, (b, c) in enumerate(zip(buckets, plan))]


def format_auto_plan(scenario: Scenario, methods=DEFAULT_POLICY, plan: list[dict] | None = None) -> str:
    """``auto_plan`` (or ``plan``, its result already computed) as the lines ``gradcomp breakeven``
    prints under its table: runs of consecutive buckets with the same choice on one line each."""
    plan = auto_plan(scenario, methods) if plan is None else plan
    lines = [f"auto ({','.join(methods)}): {plan[0]['step_s'] * 1e3:.1f} ms per step predicted "
             f"(none {plan[0]['none_step_s'] * 1e3:.1f} ms)"]
    start = 0
    for i, record in enumerate(plan):
        if i + 1 == len(plan) or plan[i + 1]["choice"] != record["choice"]:
            run = plan[start:i + 1]
            where = f"bucket {start}" if len(run) == 1 else f"buckets {start}-{i}"
            lines.append(f"  {where} ({sum(r['elements'] for r in run):,} elements): {record['choice']}")
            start = i + 1
    return "\n".join(lines)


def gbps(link: Link) -> float:
    """A link's effective Gbit/s (nominal x efficiency, host cost included)."""
    return 8.0 / link.beta_s / 1e9 if math.isfinite(link.beta_s) and link.beta_s > 0 else math.inf
