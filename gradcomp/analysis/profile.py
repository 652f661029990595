"""Device profiles: what compress, decompress, the model's compute and the network cost on a device.

A profile is either derived from a preset device (bytes moved / memory bandwidth) or measured by
``gradcomp calibrate`` and stored as JSON (``Profile.save`` / ``Profile.load``).

Preset costs come from the global-memory bytes each fused kernel in ``gradcomp.kernels`` declares
(its ``*_bytes`` functions, checked there against the bytes the kernel really moves), for an fp32
gradient with error feedback as the hooks run it (off for fp16/bf16), divided by the device's
memory bandwidth, plus a launch cost. Decoding and summing k payloads is linear in k.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..checks import check_number
from ..methods import METHODS, get_method
from .collectives import Link
from .presets import Device

PROFILE_FORMAT = 1
# The tensor at which per-element preset costs are taken: large (block padding negligible) and a
# matrix (PowerSGD compresses it).
REFERENCE_SHAPE = (4096, 4096)
REFERENCE_NUMEL = 4096 * 4096


@dataclass(frozen=True)
class LinearCost:
    """seconds(numel) = fixed_s + per_element_s * numel."""

    fixed_s: float
    per_element_s: float

    def __post_init__(self):
        for name in ("fixed_s", "per_element_s"):
            value = getattr(self, name)
            check_number("", name, value, 0, finite=True)

    def __call__(self, numel: float) -> float:
        return self.fixed_s + self.per_element_s * numel

    @classmethod
    def fit(cls, numels, seconds, through: tuple[float, float] | None = None) -> LinearCost:
        """Least-squares line through (numel, seconds), clipped to non-negative coefficients;
        with ``through`` = (numel, seconds) measured apart, the line goes through that point and
        only the slope is fitted (the intercept it implies, clipped at 0)."""
        x = np.asarray(numels, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if through is not None:
            x0, y0 = through
            check_number("LinearCost.fit", "the numel of through", x0, 0, finite=True)
            check_number("LinearCost.fit", "the seconds of through", y0, 0, finite=True)
            dx = x - x0
            if not np.any(dx):
                raise ValueError(f"a slope fit through ({x0:g}, {y0:g}) needs a size other than {x0:g}")
            slope = max(float(dx @ (y - y0) / (dx @ dx)), 0.0)
            return cls(max(y0 - slope * x0, 0.0), slope)
        if len(np.unique(x)) < 2:
            raise ValueError("a linear fit needs at least two different sizes")
        slope = max(float(np.polyfit(x, y, 1)[0]), 0.0)
        return cls(max(float((y - slope * x).mean()), 0.0), slope)


@dataclass(frozen=True)
class MethodCost:
    """One method's compute costs: ``compress`` of a tensor, ``decompress`` of one payload
    (summing k payloads costs ``k`` times its per-element part), ``output_per_element_s``, the
    cost of writing the dense result once, and ``per_tensor_s``, a fixed cost per compressed
    tensor of a method that compresses tensor by tensor (PowerSGD's matmuls and
    orthogonalization), charged with the compress. ``decode_rates``: (payloads, fraction) points,
    sorted by payloads: decoding-and-summing that many payloads runs at that fraction of the speed
    the per-element parts price (measured kernels: ``presets.KernelRates``); () for 1.
    ``per_tensor_decode_s``: a fixed cost per compressed tensor of the decode (an implementation that
    decodes tensor by tensor: gradcomp.analysis.implementations), charged with the decompress."""

    compress: LinearCost
    decompress: LinearCost
    output_per_element_s: float = 0.0
    per_tensor_s: float = 0.0
    decode_rates: tuple[tuple[int, float], ...] = ()
    per_tensor_decode_s: float = 0.0

    def __post_init__(self):
        rates = tuple((p, f) for p, f in self.decode_rates)
        payloads = [p for p, _ in rates]
        if (any(not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in payloads)
                or payloads != sorted(set(payloads))):
            raise ValueError(f"decode_rates' payload counts must be distinct integers >= 1 in increasing "
                             f"order, got {payloads}")
        for p, f in rates:
            check_number("", f"decode_rates' fraction at {p} payloads", f, 0, finite=True, low_open=True)
        object.__setattr__(self, "decode_rates", rates)

    def decode_factor(self, payloads: int) -> float:
        """The fraction of the priced speed a decode-and-sum of ``payloads`` payloads runs at:
        ``decode_rates`` interpolated linearly in log(payloads), the nearest point beyond them."""
        rates = self.decode_rates
        if not rates:
            return 1.0
        if payloads <= rates[0][0]:
            return rates[0][1]
        for (p0, f0), (p1, f1) in zip(rates, rates[1:]):
            if payloads <= p1:
                t = math.log(payloads / p0) / math.log(p1 / p0)
                return f0 + t * (f1 - f0)
        return rates[-1][1]

    def decompress_s(self, numel: float, payloads: int = 1) -> float:
        d = self.decompress
        per_element = self.output_per_element_s + payloads * d.per_element_s
        return d.fixed_s + numel * per_element / self.decode_factor(payloads)


@dataclass(frozen=True)
class Compute:
    """Measured (or estimated) seconds of one training step's phases on one rank."""

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    model: str = ""

    def __post_init__(self):
        for name in ("forward_s", "backward_s", "optimizer_s"):
            value = getattr(self, name)
            check_number("", f"compute {name}", value, 0, finite=True)


NETWORK_KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall")
"""The collectives a profile's ``network`` may hold a fitted link for."""


@dataclass(frozen=True)
class Profile:
    """Costs of one device: per-method compute, and optionally a measured network and model step.

    network: {"allreduce": Link, "allgather": Link} fitted on a live process group of
        ``world_size`` ranks (and "reduce_scatter", "alltoall" when the sweep timed them:
        ``Network.reduce_scatter_link``, ``Network.alltoall_link``), or None.
    average: the in-place 1/world_size scaling of a bucket that DDP (and every elementwise hook)
        runs before communicating it.
    """

    device: str
    methods: dict[str, MethodCost]
    compute: Compute | None = None
    network: dict[str, Link] | None = None
    world_size: int | None = None
    notes: dict = field(default_factory=dict)
    average: LinearCost = LinearCost(0.0, 0.0)

    def method(self, name: str) -> MethodCost:
        if name not in self.methods:
            raise ValueError(f"profile {self.device!r} has no costs for method {name!r}; "
                             f"it has {sorted(self.methods)} (calibrate it, or use a preset device)")
        return self.methods[name]

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "device": self.device,
            "methods": {name: asdict(cost) for name, cost in self.methods.items()},
            "compute": asdict(self.compute) if self.compute else None,
            "network": {k: asdict(v) for k, v in self.network.items()} if self.network else None,
            "world_size": self.world_size,
            "average": asdict(self.average),
            "notes": self.notes,
        }

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data, source: str = "profile") -> Profile:
        """Parse a profile dict; ValueError naming the bad field otherwise."""
        def fail(what):
            raise ValueError(f"malformed {source}: {what}")

        if not isinstance(data, dict):
            fail(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            fail(f"'format' must be {PROFILE_FORMAT}, got {data.get('format')!r}")
        if not isinstance(data.get("device"), str):
            fail("'device' must be a string")
        methods = data.get("methods")
        if not isinstance(methods, dict) or not methods:
            fail("'methods' must be a non-empty object of method name -> costs")
        try:
            parsed = {}
            for name, cost in methods.items():
                if name not in METHODS:
                    fail(f"unknown method {name!r} in 'methods' (known: {', '.join(METHODS)})")
                rates = cost.get("decode_rates", ())
                if (not isinstance(rates, (list, tuple))
                        or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rates)):
                    fail(f"'decode_rates' of {name!r} must be a list of [payloads, fraction] pairs, got {rates!r}")
                parsed[name] = MethodCost(LinearCost(**cost["compress"]), LinearCost(**cost["decompress"]),
                                          cost.get("output_per_element_s", 0.0), cost.get("per_tensor_s", 0.0),
                                          tuple(tuple(r) for r in rates),
                                          per_tensor_decode_s=cost.get("per_tensor_decode_s", 0.0))
            compute = Compute(**data["compute"]) if data.get("compute") else None
            network = ({k: Link(**v) for k, v in data["network"].items()} if data.get("network") else None)
            average = LinearCost(**data["average"]) if data.get("average") else LinearCost(0.0, 0.0)
        except (KeyError, TypeError) as exc:
            fail(f"{type(exc).__name__}: {exc}")
        if network is not None and not {"allreduce", "allgather"} <= set(network) <= set(NETWORK_KINDS):
            fail(f"'network' must have 'allreduce' and 'allgather' and may have 'reduce_scatter' and "
                 f"'alltoall', got {sorted(network)}")
        world_size = data.get("world_size")
        if network is not None and (not isinstance(world_size, int) or world_size < 2):
            fail(f"'world_size' must be an integer >= 2 when 'network' is given, got {world_size!r}")
        return cls(data["device"], parsed, compute, network, world_size, data.get("notes") or {}, average)

    @classmethod
    def load(cls, path) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"profile {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"malformed profile {path}: not JSON ({exc})") from None
        return cls.from_dict(data, source=f"profile {path}")


def declared_bytes(name: str, world: int = 1, **options) -> tuple[float, float]:
    """(compress, decode-and-sum of ``world`` payloads) global-memory bytes the method ``name``
    declares (``Method.declared_bytes``) for an fp32 tensor of REFERENCE_SHAPE, with error
    feedback as its hooks run it by default."""
    m = get_method(name, **options)
    return m.declared_bytes(REFERENCE_SHAPE, world, m.error_feedback_default)


def preset_profile(device: Device, methods=METHODS) -> Profile:
    """A profile for a preset device: every method's cost from its kernels' declared bytes at
    their measured fraction of the device's copy bandwidth (``Device.kernel_rates``; 1 where
    none), plus the device's fixed costs (a launch per compress and decode; for a method that
    compresses tensor by tensor, the hook call's and each tensor's)."""
    seconds_per_byte = 1.0 / (device.memory_gbps * 1e9)
    launch = device.launch_us * 1e-6
    costs = {}
    for name in methods:
        compress, one = declared_bytes(name, 1)
        per_payload = declared_bytes(name, 2)[1] - one
        per_tensor = get_method(name).per_tensor
        rates = device.kernel_rates.get(name)
        costs[name] = MethodCost(
            LinearCost(launch + (device.call_us * 1e-6 if per_tensor else 0.0),
                       compress / REFERENCE_NUMEL * seconds_per_byte / (rates.compress if rates else 1.0)),
            LinearCost(launch, per_payload / REFERENCE_NUMEL * seconds_per_byte),
            output_per_element_s=(one - per_payload) / REFERENCE_NUMEL * seconds_per_byte,
            per_tensor_s=device.tensor_us * 1e-6 if per_tensor else 0.0,
            decode_rates=rates.decode if rates else (),
        )
    # averaging reads and writes the fp32 bucket: 8 bytes per element
    return Profile(device.name, costs, notes={"source": f"preset {device.name}: gradcomp.kernels' declared "
                                                        f"bytes / {device.memory_gbps:.0f} GB/s"},
                   average=LinearCost(launch, 8.0 * seconds_per_byte))
