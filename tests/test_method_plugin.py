"""Adding a compressor from outside gradcomp: one class, registered, and every front serves it.

docs/design.md's "Add a compressor" walkthrough follows this file step by step. The toy method is
a ternary quantizer: per chunk of ``chunk`` elements a scale s = max |v|, and each element sent as
one int8 code in {-1, 0, 1} (|v| >= s / 2 -> sign, else 0), decoded as code * s.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

import gradcomp
import gradcomp.cli
import gradcomp.hooks
from dist_utils import run_ranks
from ddp_models import build_model, flat_params, make_ddp, train_steps


# Step 1: the method is a frozen dataclass whose fields are its options.
@dataclass(frozen=True)
class Ternary(gradcomp.Method):
    """Ternary codes with one fp32 max-|v| scale per chunk: 1 + 4/chunk bytes per element."""

    name = "ternary"
    schemes = ("allgather", "twophase")  # Step 2: how its payloads may cross the wire
    chunk: int = 128

    def __post_init__(self):  # Step 3: options validated once, with a message naming the problem
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"ternary: chunk must be an integer >= 1, got {self.chunk!r}")

    @property
    def granule(self) -> int:  # chunks of whole granules concatenate (the two-phase scheme)
        return self.chunk

    def parts_layout(self, shape, dtype):  # Step 4: the parts (their bytes on the wire follow)
        n = math.prod(shape)
        return {"codes": (torch.int8, (n,)), "scales": (torch.float32, (math.ceil(n / self.chunk),))}

    def _compress(self, x, residual, state):  # Step 5: encode (+ error feedback via _feed_back)
        c = x.reshape(-1).float() + (residual if residual is not None else 0)
        n = c.numel()
        padded = torch.nn.functional.pad(c, (0, -n % self.chunk)).view(-1, self.chunk)
        scales = padded.abs().amax(dim=1)
        codes = torch.where(padded.abs() >= scales[:, None] / 2, torch.sign(padded), 0.0)
        payload = self._payload(x, {"codes": codes.reshape(-1)[:n].to(torch.int8), "scales": scales})
        return self._feed_back(c, payload, residual)

    def _decompress_into(self, payload, out):  # Step 6: decode one payload into a flat tensor
        codes, scales = payload.parts["codes"], payload.parts["scales"]
        out.copy_(codes.float() * scales.repeat_interleave(self.chunk)[: codes.numel()])


@pytest.fixture
def ternary():
    gradcomp.register_method(Ternary)  # Step 7: register; unregister when done
    yield
    gradcomp.unregister_method("ternary")


def test_compress_decompress_and_error_feedback(ternary):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload = gradcomp.compress(x, "ternary", chunk=100)
    # 1000 code bytes and 10 scales, each part padded to 16 bytes in the wire layout
    assert payload.parts_nbytes == Ternary(chunk=100).parts_bytes(1000) == 1040
    assert payload.nbytes == Ternary(chunk=100).wire_bytes(1000) == 1008 + 48
    y = gradcomp.decompress(payload)
    scales = x.view(10, 100).abs().amax(dim=1).repeat_interleave(100)
    assert torch.all((y == 0) | (y.abs() == scales)) and torch.all((x - y).abs() <= scales)
    # error feedback conserves mass: sent + final residual == sum of inputs
    ef, sent, total = gradcomp.ErrorFeedback(), torch.zeros(1000), torch.zeros(1000)
    for step in range(5):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        sent += gradcomp.decompress(ef.compress("w", g, "ternary", chunk=100))
        total += g
    torch.testing.assert_close(sent + ef.residual("w"), total, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ternary: chunk must be an integer >= 1"):
        gradcomp.compress(x, "ternary", chunk=0)
    with pytest.raises(ValueError, match="already registered"):
        gradcomp.register_method(Ternary)


def test_registration_is_checked():
    @dataclass(frozen=True)
    class NoSchemes(Ternary):
        name = "noschemes"
        schemes = ("carrier-pigeon",)

    with pytest.raises(ValueError, match="schemes must be a non-empty tuple"):
        gradcomp.register_method(NoSchemes)
    with pytest.raises(TypeError, match="subclass of gradcomp.Method"):
        gradcomp.register_method(dict)
    assert "noschemes" not in gradcomp.METHODS


def _train_with_ternary(rank, world, scheme):
    gradcomp.register_method(Ternary)  # a fresh process: register it there too
    model = build_model(seed=1)
    ddp = make_ddp(model)
    state = gradcomp.hooks.register(ddp, "ternary", scheme=scheme, chunk=64)
    losses = train_steps(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 4, rank)
    return {"params": flat_params(model), "stats": state.stats(), "losses": losses,
            "state": type(state).__name__}


@pytest.mark.parametrize("scheme", ["allgather", "twophase"])
def test_ddp_hook_on_two_ranks(ternary, scheme):
    results = run_ranks(_train_with_ternary, 2, scheme)
    assert torch.equal(results[0]["params"], results[1]["params"])  # replicas bit-identical
    stats = results[0]["stats"]
    assert stats["steps"] == 4 and stats["wire_bytes"] > 0 and results[0]["state"] == "TernaryState"
    assert 2.0 < stats["ratio"] < 4.0  # fp32 (4 bytes) -> ~1.06 bytes (+ the two-phase's second phase)
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_breakeven_rows(ternary, capsys):
    assert gradcomp.cli.main(["breakeven", "--model", "resnet50", "--world-size", "8", "--device", "a100",
                              "--link", "10gbe", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in records}  # method[:scheme] labels
    assert {"ternary:allgather", "ternary:twophase"} <= set(rows)
    row = rows["ternary:allgather"]
    assert row["wire_bytes"] > 0 and row["step_s"] > 0


def test_a_plugin_without_parts_layout_counts_its_own_wire_bytes():
    """A method declaring wire_bytes but no parts_layout: its count serves as the parts' bytes
    too (the all-reduce scheme's); one declaring neither says what to declare."""

    @dataclass(frozen=True)
    class Counted(gradcomp.Method):
        name = "counted"

        def wire_bytes(self, numel, shape=None, dtype=torch.float32):
            return numel + 4

    @dataclass(frozen=True)
    class Silent(gradcomp.Method):
        name = "silent"

    assert Counted().parts_bytes(10) == Counted().wire_bytes(10) == 14
    for count in (Silent().wire_bytes, Silent().parts_bytes):
        with pytest.raises(NotImplementedError, match="silent: declare parts_layout"):
            count(10)
