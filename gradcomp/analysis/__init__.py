"""The break-even analyser: when does gradient compression pay, and with which method?

    from gradcomp.analysis import make_scenario, estimate
    for e in estimate(make_scenario("gpt2-1.5b", world_size=64, device="h100", link="100gbe")):
        print(e.method, e.step_s, e.speedup, e.breakeven_gbps)

See docs/breakeven.md for the model, its formulas and its validation on an emulated link.
"""
from .collectives import Link, Network
from .breakeven import Estimate, breakeven_gbps, breakeven_world_size, estimate
from .costmodel import Choice, Scenario, default_choices, ddp_buckets, simulate, sweep_bandwidth
from .models import MODELS, ModelSpec, Parameter, from_module, model
from .presets import DEVICES, LINKS, NODES, device, link, node
from .profile import Compute, LinearCost, MethodCost, Profile, preset_profile
from .scenario import make_scenario
from . import linkfit

__all__ = ["Link", "Network", "Choice", "Estimate", "Scenario", "breakeven_gbps", "breakeven_world_size",
           "default_choices", "ddp_buckets", "estimate", "simulate", "sweep_bandwidth", "MODELS", "ModelSpec",
           "Parameter", "from_module", "model", "DEVICES", "LINKS", "NODES", "device", "link", "node", "Compute", "LinearCost",
           "MethodCost", "Profile", "preset_profile", "make_scenario"]
