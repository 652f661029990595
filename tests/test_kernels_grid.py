"""GPU rule (d): every launcher's grid stays within CUDA's limits at extreme shapes.

CUDA takes at most 2^31 - 1 programs on grid axis 0 and 65535 on axes 1 and 2. Each launcher
builds its grid with one of the modules' ``*_grid`` functions (tests/interpreted/test_autotune.py
checks that every launch does); here each of them is evaluated, without allocating anything, at
shapes far beyond any single GPU's memory, for every config its kernels can run with.
"""
import importlib
import pkgutil

import pytest
import triton

import gradcomp.kernels
from gradcomp.kernels import cast, common, declared, powersgd, quant, sign, topk

MODULES = [importlib.import_module(f"gradcomp.kernels.{info.name}")
           for info in pkgutil.iter_modules(gradcomp.kernels.__path__)]
GRID_FUNCTIONS = {f"{module.__name__}.{name}" for module in MODULES
                  for name, value in vars(module).items()
                  if name.endswith("_grid") and getattr(value, "__module__", None) == module.__name__}
AXIS_LIMITS = (2**31 - 1, 65535, 65535)
HUGE = 2**36
"""Elements of one tensor (256 GiB of fp32): beyond any single GPU, so every real launch is
covered."""


def configs(module, prefix: str = "") -> list[triton.Config]:
    """Every config a module's kernels (``<prefix>CONFIGS``) run with: the autotuned ones and the
    interpreter's (``<prefix>CPU_CONFIG``)."""
    return [*getattr(module, f"{prefix}CONFIGS"), getattr(module, f"{prefix}CPU_CONFIG")]


def plane_case(module, width: int, planes: int):
    """The quant / sign launches over HUGE elements in runs of ``width``."""
    return [(common.plane_grid(first, end, width), configs(module))
            for first, end, _ in common.plane_runs(HUGE + 3, width, planes)]


KINDS = ("ef_matmul", "transpose_matmul", "residual_update")


def run_programs(kind: str, k: int, n: int, m: int) -> int:
    """Programs of a run of k [n, m] matrices in one PowerSGD matmul kernel, at the smallest tile
    of any config (the most programs)."""
    block_n = min(c.kwargs["BLOCK_N"] for c in configs(powersgd, "MATMUL_"))
    block_m = min(c.kwargs["BLOCK_M"] for c in configs(powersgd, "MATMUL_"))
    return declared.run_programs(kind, k, n, m, block_n, block_m)[0]


CASES = {
    "gradcomp.kernels.cast.elementwise_grid": [(cast.elementwise_grid(n), configs(cast))
                                               for n in (2**31 + 5, HUGE)],
    "gradcomp.kernels.common.plane_grid": (plane_case(quant, 2, 2) + plane_case(quant, 256, 1)
                                           + plane_case(quant, quant.MAX_BLOCK, 2)
                                           + plane_case(sign, 8, 8) + plane_case(sign, 1024, 8)),
    "gradcomp.kernels.topk.elementwise_grid": [(topk.elementwise_grid(2**31 - 1), configs(topk))],
    "gradcomp.kernels.topk.one_program_grid": [(topk.one_program_grid(), [topk.SCAN_CONFIG])],
    "gradcomp.kernels.topk.run_grid": [(topk.run_grid(2**31 - 1),
                                        [topk.SELECT_CONFIG, topk.SELECT_CPU_CONFIG])],
    "gradcomp.kernels.topk.scatter_add_grid": [(topk.scatter_add_grid(k, world), configs(topk))
                                               for k, world in ((2**31 - 1, 64), (10**7, 1024),
                                                                (100, 70000))],
    "gradcomp.kernels.topk.fallback_grid": [(topk.fallback_grid(k, world), [topk.ROWS_CONFIG])
                                            for k, world in ((2**31 - 1, 64), (1, 10**6),
                                                             (100, 70000))],
    "gradcomp.kernels.powersgd.run_programs_grid": [
        (powersgd.run_programs_grid(run_programs(kind, k, n, m)), configs(powersgd, "MATMUL_"))
        for kind in KINDS
        for k, n, m in ((1, 10**7, 1024), (1, 1024, 10**7), (1, 1, HUGE), (1, HUGE, 1),
                        (1, 2**18, 2**18), (HUGE // 4096**2, 4096, 4096), (10**6, 8, 8192))],
    "gradcomp.kernels.powersgd.orthonormalize_grid": [(powersgd.orthonormalize_grid(10**6),
                                                       configs(powersgd, "ORTHO_"))],
}


def test_every_grid_function_has_extreme_cases():
    assert set(CASES) == GRID_FUNCTIONS, sorted(GRID_FUNCTIONS ^ set(CASES))


def over_limits(axes: tuple) -> list[tuple[int, int]]:
    """(axis, size) of every grid axis beyond CUDA's limit."""
    return [(axis, size) for axis, (size, limit) in enumerate(zip(axes, AXIS_LIMITS)) if size > limit]


@pytest.mark.parametrize("name", sorted(CASES))
def test_grid_within_cuda_limits(name):
    for grid, module_configs in CASES[name]:
        assert module_configs
        for config in module_configs:
            axes = grid(config.kwargs)
            assert 1 <= len(axes) <= 3 and all(isinstance(a, int) and a >= 1 for a in axes), axes
            assert not over_limits(axes), f"{name} with {config.kwargs}: grid {axes} over CUDA's limits"


def test_limits_catch_a_count_on_axis_1():
    """The old residual_update grid (column blocks on axis 1) fails this check at m = 10^7."""
    meta = powersgd.MATMUL_CONFIGS[0].kwargs
    axes = (triton.cdiv(1024, meta["BLOCK_N"]), triton.cdiv(10**7, meta["BLOCK_M"]))
    assert over_limits(axes) == [(1, axes[1])]
