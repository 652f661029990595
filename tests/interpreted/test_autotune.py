"""GPU rules held under the interpreter with triton's own Autotuner (no GPU needed):

- rule (b), autotune trials: on a GPU, the first launch per tuning key runs every config several
  times before the real launch. Every tuned kernel, run through its real ``triton.autotune``
  object (whose benchmark function here launches each config ``TRIALS`` times), must leave every
  output as one launch of the chosen config does: in-place outputs need ``restore_value``, atomic
  outputs ``reset_to_zero`` (a missing reset made the first top-k decode add ``2 * TRIALS + 1``
  times into its output).
- finding 9, size classes: sizes in one size class (common.size_class) share a tuning key, so a
  new size of the same class neither compiles nor benchmarks again.

The tuned kernels are discovered (every SerializedLaunch of every gradcomp.kernels module); a
kernel that no scenario below launches fails the coverage test.
"""
import collections
import contextlib
import importlib
import itertools
import pkgutil

import pytest
import torch
import triton
from kernel_utils import assert_same_bits, gradient, residual_like

import gradcomp.kernels
from gradcomp.kernels import cast, powersgd, quant, sign, topk
from gradcomp.kernels.common import SerializedLaunch
from gradcomp.methods.topk import sample_rank

TRIALS = 3
MODULES = [importlib.import_module(f"gradcomp.kernels.{info.name}")
           for info in pkgutil.iter_modules(gradcomp.kernels.__path__)]
TUNED = {f"{module.__name__}.{name}": launch for module in MODULES
         for name, launch in vars(module).items() if isinstance(launch, SerializedLaunch)}
GRID_FUNCTIONS = {f"{module.__name__}.{name}" for module in MODULES
                  for name, value in vars(module).items()
                  if name.endswith("_grid") and getattr(value, "__module__", None) == module.__name__}


def trial_configs(autotuner) -> list[triton.Config]:
    """The configs autotune chooses among; a single config gets a twin (another num_stages, the
    same code under the interpreter), so that the trial loop runs for every kernel, as it will
    the day a second config ships."""
    configs = list(autotuner.configs)
    if len(configs) == 1:
        only = configs[0]
        configs.append(triton.Config(dict(only.kwargs), num_warps=only.num_warps,
                                     num_stages=only.num_stages + 1))
    return configs


@contextlib.contextmanager
def launched(mode: str, tunings: collections.Counter | None = None, grids: list | None = None):
    """Inside the block every tuned kernel launches as ``mode`` says.

    "tuned": through its triton Autotuner (configs from :func:`trial_configs`, an empty tuning
    cache), whose benchmark of a config is ``TRIALS`` launches; each benchmark reports a shorter
    time than the one before, so the last config is chosen; ``tunings[name]`` counts the
    benchmarks. "chosen": one plain launch of that last config. ``grids`` collects the grid
    callable of every launch.
    """
    saved = {name: (launch.config, launch.kernel.configs, dict(launch.kernel.cache))
             for name, launch in TUNED.items()}
    original_getitem = SerializedLaunch.__getitem__
    clock = itertools.count()
    try:
        for name, launch in TUNED.items():
            configs = trial_configs(launch.kernel)
            if mode == "chosen":
                launch.config = configs[-1]
                continue

            def bench(kernel_call, quantiles, name=name):
                for _ in range(TRIALS):
                    kernel_call()
                if tunings is not None:
                    tunings[name] += 1
                return [-float(next(clock))] * len(quantiles)

            launch.config, launch.kernel.configs = None, configs
            launch.kernel.cache.clear()
            launch.kernel.do_bench = bench  # shadows the cached_property (no GPU benchmarker)
        if grids is not None:
            def recording(self, grid):
                grids.append(grid)
                return original_getitem(self, grid)

            SerializedLaunch.__getitem__ = recording
        yield
    finally:
        SerializedLaunch.__getitem__ = original_getitem
        for name, launch in TUNED.items():
            config, configs, cache = saved[name]
            launch.config, launch.kernel.configs = config, configs
            launch.kernel.cache.clear()
            launch.kernel.cache.update(cache)
            launch.kernel.__dict__.pop("do_bench", None)


# ---- scenarios: every launcher, fresh seeded inputs, every output (in-place ones included) ----

def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(rows)


def cast_scenario(n: int) -> dict:
    x, res = gradient(n, 1), residual_like(n, 1)
    values = cast.ef_cast(x, res, 0.5, torch.float16)
    payloads = _stacked([values, cast.ef_cast(gradient(n, 2), None, 0.5, torch.float16),
                         values.flip(0)])
    return {"values": values, "residual": res, "sum": cast.cast_decode_sum(payloads, 0.5)}


def quant_scenario(n: int) -> dict:
    outputs = {}
    for levels in (127, 7):
        x, res = gradient(n, 3), residual_like(n, 3)
        codes, scales = quant.ef_quantize(x, res, 256, levels)
        codes2, scales2 = quant.ef_quantize(gradient(n, 4), None, 256, levels, seed=11)
        outputs |= {f"codes{levels}": codes, f"scales{levels}": scales, f"residual{levels}": res,
                    f"stochastic{levels}": codes2,
                    f"sum{levels}": quant.dequantize_sum(_stacked([codes, codes2]),
                                                         _stacked([scales, scales2]), n, 256)}
    return outputs


def sign_scenario(n: int) -> dict:
    x, res = gradient(n, 5), residual_like(n, 5)
    bits, scales = sign.ef_sign(x, res, 1024)
    bits2, scales2 = sign.ef_sign(gradient(n, 6), None, 1024)
    return {"bits": bits, "scales": scales, "residual": res,
            "sum": sign.sign_decode_sum(_stacked([bits, bits2]), _stacked([scales, scales2]), n,
                                        1024)}


def topk_scenario(n: int) -> dict:
    k, sample = n // 64, 512
    rank = sample_rank(n, k, sample)
    x, res = gradient(n, 7), residual_like(n, 7)
    values, indices = topk.ef_topk(x, res, k, 1.0, sample, rank, 3)  # the candidates hold it
    values2, indices2 = topk.ef_topk(gradient(n, 8), None, k, 0.5, sample, rank, 4)
    total = topk.scatter_add_sum(_stacked([values, values2]), _stacked([indices, indices2]), n)
    total2 = topk.scatter_add_sum(_stacked([values, values2]), _stacked([indices, indices2]), n,
                                  addend=gradient(n, 11).to(torch.bfloat16), addend_scale=0.5)
    x4, res4 = gradient(n, 10), residual_like(n, 10)  # ties overflow the buffer: the select
    x4[: n // 2] = 1.0  # kernels read c
    values4, indices4 = topk.ef_topk(x4, res4, k, 1.0, sample, 1, 5)
    return {"values": values, "indices": indices, "residual": res, "values2": values2,
            "indices2": indices2, "sum": total, "sum2": total2, "values4": values4,
            "indices4": indices4, "residual4": res4}


def powersgd_scenario(n: int) -> dict:
    rows, cols, rank = n // 64, 64, 4
    x = gradient(rows * cols, 9).view(rows, cols)
    res = residual_like(rows * cols, 9).view(rows, cols)
    q = gradient(cols * rank, 10).view(cols, rank)
    p = powersgd.ef_matmul(x, res, q)
    flat = torch.cat([p.flatten(), gradient(37 * 3, 11)])
    powersgd.orthonormalize_batched_(flat, [(rows, rank), (37, 3)])
    p = flat[:rows * rank].view(rows, rank).clone()
    q_new = powersgd.transpose_matmul(res, p)
    powersgd.residual_update(res, p, q)
    return {"p": p, "orthonormal": flat, "q": q_new, "residual": res}


SCENARIOS = [cast_scenario, quant_scenario, sign_scenario, topk_scenario, powersgd_scenario]
SIZE = (1 << 12) + 100
"""Sizes derived from it (n, k = n // 64, PowerSGD rows = n // 64) sit inside their size classes."""


def test_tuned_kernels_are_discovered():
    assert len(TUNED) >= 12
    for name, launch in TUNED.items():
        assert isinstance(launch.kernel, triton.runtime.Autotuner), name


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_autotune_trials_leave_outputs_as_one_launch(scenario):
    """Every output after autotune's trials (and the chosen config's launch) has the bits of one
    launch of that config."""
    with launched("chosen"):
        expected = scenario(SIZE)
    tunings = collections.Counter()
    with launched("tuned", tunings):
        actual = scenario(SIZE)
    assert tunings and all(count >= 2 for count in tunings.values()), tunings
    for name in expected:
        try:
            assert_same_bits(actual[name], expected[name])
        except AssertionError as error:
            raise AssertionError(f"{scenario.__name__}: {name!r} after autotuning: {error}") \
                from None


def test_autotune_trials_catch_a_missing_reset():
    """Without its declared restore_value (of the output: the tile decode's sum), the atomic
    scatter-add's trials add into the output again: the comparison above fails (so it can)."""
    autotuner = topk.scatter_add_kernel.kernel
    declared = autotuner.restore_value
    # descending indices: the rank fails the sorted check and the atomic fallback adds it
    values, indices = torch.ones(1, 8), torch.arange(8, dtype=torch.int32).flip(0).view(1, 8)
    try:
        autotuner.restore_value = []
        with launched("tuned"):
            total = topk.scatter_add_sum(values, indices, 8)
    finally:
        autotuner.restore_value = declared
    assert total.tolist() == [2 * TRIALS + 1] * 8


@pytest.fixture(scope="module")
def tuned_passes():
    """Every scenario through launched("tuned"), one empty tuning cache for all: the tunings
    after the pass at SIZE, after one at 2 SIZE - 400 (same classes: n <= 8192, n // 64 <= 128)
    and after one at 2 SIZE + 400 (until a scenario tunes again: the rest would only repeat
    it); and the grids of the first pass."""
    tunings, grids, after = collections.Counter(), [], []
    with launched("tuned", tunings, grids):
        for scenario in SCENARIOS:
            scenario(SIZE)
        after.append(dict(tunings))
        first_grids = list(grids)
        for scenario in SCENARIOS:
            scenario(2 * SIZE - 400)
        after.append(dict(tunings))
        for scenario in SCENARIOS:
            scenario(2 * SIZE + 400)
            if any(tunings[name] > after[0].get(name, 0) for name in tunings):
                break
        after.append(dict(tunings))
    return after, first_grids


def test_every_tuned_kernel_and_grid_is_exercised(tuned_passes):
    """The scenarios launch every discovered tuned kernel, each through a module's ``*_grid``
    function (the ones tests/test_kernels_grid.py evaluates at extreme shapes)."""
    (tunings, _, _), grids = tuned_passes
    assert set(tunings) == set(TUNED), sorted(set(TUNED) - set(tunings))
    sources = {f"{grid.__module__}.{grid.__qualname__.split('.<locals>')[0]}" for grid in grids}
    assert sources <= GRID_FUNCTIONS, sorted(sources - GRID_FUNCTIONS)


def test_sizes_of_one_class_share_a_tuning(tuned_passes):
    """A second size in the same class tunes nothing; a size of the next class tunes again."""
    (first, same_class, next_class), _ = tuned_passes
    assert same_class == first
    grown = {name for name in next_class if next_class[name] > first.get(name, 0)}
    assert grown, "a size of another class must tune again"
