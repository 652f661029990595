"""gradcomp.schemes: one object per scheme, and every user of a scheme agrees with it.

The fronts count ``Scheme.sent_bytes`` of what ``Scheme.send`` made; the analyser prices
``Scheme.wire_bytes`` and ``Scheme.stages``: these tests hold them to each other for every
registered method under every flat scheme it offers (no process group needed: ``send`` issues
no collective).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import gradcomp
from gradcomp import hooks
from gradcomp.analysis import Choice, make_scenario
from gradcomp.analysis.auto import collective_s, decode_s
from gradcomp.analysis.costmodel import _compressed_stages
from gradcomp.analysis.optim import _exchange_seconds
from gradcomp.methods.registry import SCHEME_NAMES
from gradcomp.schemes import FLAT_SCHEMES, SCHEMES, scheme, shard_size

FLAT = [(m, s) for m in gradcomp.METHODS for s in gradcomp.get_method(m).schemes if s in FLAT_SCHEMES]


def test_the_scheme_lists_are_derived_from_the_objects():
    assert list(SCHEMES) == SCHEME_NAMES  # what methods may declare: handed over by gradcomp.schemes
    assert FLAT_SCHEMES == tuple(n for n, s in SCHEMES.items() if not s.per_tensor)
    assert not hasattr(hooks, "SCHEMES")  # one name, one meaning: gradcomp.schemes.SCHEMES
    assert "lowrank" not in FLAT_SCHEMES and SCHEMES["lowrank"].per_tensor
    with pytest.raises(ValueError, match="unknown scheme 'carrier-pigeon'"):
        scheme("carrier-pigeon")


def test_declared_schemes_check_every_registered_method():
    """gradcomp.schemes hands its names to the method registry, which checks the methods
    registered before it loaded (the built-in ones) against them."""
    from gradcomp.methods import registry

    try:
        with pytest.raises(ValueError, match=r"Int8.schemes must be a non-empty tuple of \('allreduce',\)"):
            registry.declare_schemes(("allreduce",))
    finally:
        registry.declare_schemes(tuple(SCHEMES))
    assert SCHEME_NAMES == list(SCHEMES)


def test_the_fronts_ask_schemes_what_they_rely_on():
    """The hooks run a method stateless when its first scheme sums on the wire; FSDP compresses
    its rows in one pass for methods declaring a chunked scheme."""
    assert [n for n, s in SCHEMES.items() if s.summing] == ["allreduce"]
    assert [n for n, s in SCHEMES.items() if s.chunked] == ["twophase"]
    from gradcomp import fsdp
    assert fsdp.encodes_whole(gradcomp.get_method("int8"), 512)
    assert not fsdp.encodes_whole(gradcomp.get_method("topk"), 512)


@pytest.mark.parametrize("method, name", FLAT)
@settings(max_examples=15, deadline=None)
@given(numel=st.integers(1, 3000), world=st.integers(1, 5))
def test_bytes_the_fronts_count_are_the_bytes_the_analyser_prices(method, name, numel, world):
    m, s = gradcomp.get_method(method), SCHEMES[name]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    sent = s.send(x, m, m.compress, world)
    assert s.sent_bytes(sent) == s.wire_bytes(m, numel, world)
    if s.deferred:  # two-phase: p rows of whole granules, the padded tensor's payload cut in p
        assert sent.rows == world and sent.numel % m.granule == 0 and sent.numel * world >= numel


@pytest.mark.parametrize("method, name", FLAT)
def test_a_lone_rank_decodes_what_it_sent(method, name):
    """With one rank the sum over ranks is this rank's own decoded payload (two-phase: padded,
    then cut back to the tensor's size)."""
    m, s = gradcomp.get_method(method), SCHEMES[name]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    sent = s.send(x, m, m.compress, 1)
    arrived = sent.as_rows(1) if name == "allgather" else sent  # what the all-gather of one rank returns
    out = s.decode(m, arrived, torch.empty(1000))
    expected = m.decompress(sent if sent.rows is None else sent.joined()).reshape(-1)[:1000]
    assert torch.equal(out, expected)  # the same decode, the same bits


@pytest.mark.parametrize("method, name", FLAT)
@pytest.mark.parametrize("world", [2, 7, 64])
def test_the_cost_model_and_the_optimizer_analysis_price_an_exchange_alike(method, name, world):
    """One pricing (``Scheme.stages``): the optimizer analysis's collective and compute seconds
    are the cost model's network and compute stages (it once priced the two-phase chunk without
    rounding it to whole granules)."""
    scenario = make_scenario("gpt2-124m", world, device="h100", link="100gbe")
    m = gradcomp.get_method(method)
    n = 1_000_003  # no multiple of any granule: the padding shows
    stages, wire = _compressed_stages(Choice(method, {}, name), [(n,)], n, scenario.network, scenario.profile, 0.0)
    comm_s, compute_s = _exchange_seconds((m, name, n), scenario)
    assert comm_s == sum(t for r, t in stages if r == "network")
    assert compute_s == sum(t for r, t in stages if r == "compute")
    assert wire == SCHEMES[name].wire_bytes(m, n, world)
    # auto prices the counted bytes through the same scheme (two-phase: p + 1 equal chunk
    # payloads; the same seconds up to the division's rounding)
    assert collective_s(scenario.network, name, wire) == pytest.approx(comm_s, rel=1e-12)
    assert decode_s(scenario.profile, Choice(method, {}, name), n, world) == stages[-1][1]


def test_the_hierarchical_shard_is_cut_as_the_scheme_pads():
    assert shard_size(1000, 2, 2, "allgather", 256) == 500
    assert shard_size(1000, 2, 2, "twophase", 256) == SCHEMES["twophase"].padded_numel(500, 2, 256) == 512
