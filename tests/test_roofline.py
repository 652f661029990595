"""benchmarks/roofline.py without a GPU: its SASS counting on hand-written SASS, the per-rank
loop of a compiled decode-sum, and loud failures when a row no longer matches its kernel. The
validated command itself (``--smoke``: three rows of 532ad50 against their H100 measurements)
runs in tests/test_scripts.py."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import roofline  # noqa: E402

from gradcomp.kernels.common import interpreting  # noqa: E402

SASS = """Function:k
--:-:-:-:2\tS2R R0, SR_TID.X;
--:-:0:-:1\tLDG.E.128 R4, desc[UR4][R2.64];
LBB0:
--:-:-:-:4\tFADD R1, R1, R4;
--:-:-:-:1\tIMAD R2, R2, 0x4, R3;
--:-:-:-:1\t@!P1 LOP3.LUT R5, R5, 0xff, RZ, 0xc0, !PT;
--:-:1:-:1\tLDG.E.U16 R6, desc[UR4][R2.64];
--:-:-:-:a\t@P0 BRA LBB0;
--:-:-:-:1\tI2F R7, R6;
--:-:-:-:1\tSTG.E desc[UR4][R2.64], R7;
--:-:-:-:1\tEXIT;
LBB1:
--:-:-:-:0\tBRA LBB1;
--:-:-:-:0\tNOP;
"""
"""One load, a loop (FADD, IMAD, a predicated LOP3, a 2-byte load, the backward branch), a
conversion, a store, the exit and the idle self-branch with its padding (never executed)."""


def test_sass_counts_each_pipe_with_the_loop_trips():
    sass = roofline.Sass.parse(SASS)
    assert len(sass.ops) == 10 and sass.loops == [(2, 6)]
    counts = roofline.pipe_counts(sass, (10,))
    assert counts["issue"] == 5 + 5 * 10
    assert counts["fma"] == 10 + 2 * 10  # IMAD runs on the heavy half of the FMA pipe
    assert counts["alu"] == 10 and counts["xu"] == 1
    assert counts["lsu"] == 4 + 10 + 1  # a 16-byte warp access is four 128-byte wavefronts
    assert counts["stall"] == 2 + 1 + (4 + 1 + 1 + 1 + 10) * 10 + 1 + 1 + 1
    assert counts["round_trips"] == 1 + 10  # the load before the loop, one per iteration
    assert counts["memory_ops"] == {"LDG.128": 1, "LDG.16": 10, "STG.32": 1}
    with pytest.raises(ValueError, match="1 loops in the SASS, 2 trip counts in the row"):
        roofline.pipe_counts(sass, (10, 3))


def test_a_slow_path_the_fast_path_branches_over_is_not_counted():
    """div_rn's: a CALL behind a forward branch taken unless FCHK flags an operand."""
    sass = roofline.Sass.parse("--:-:-:-:1\tFCHK P1, R1, R2;\n--:-:-:-:6\t@!P1 BRA LBB0;\n"
                               "--:-:-:-:1\tMOV R4, R1;\n--:-:-:-:5\tCALL.REL.NOINC 0x100;\nLBB0:\n"
                               "--:-:-:-:1\tFADD R1, R1, R2;\n--:-:-:-:1\tEXIT;\n")
    counts = roofline.pipe_counts(sass, ())
    assert counts["issue"] == 4 and counts["alu"] == 1 and counts["fma"] == 1
    assert counts["stall"] == 1 + 6 + 1 + 1


@pytest.fixture(scope="module")
def tree():  # the tests that use it compile kernels ahead of time (seconds)
    if interpreting():
        pytest.skip("ahead-of-time compilation needs the JIT")
    with contextlib.ExitStack() as stack:
        yield roofline.Tree(roofline.VALIDATED, stack)


DECODE = {"HAS_ADDEND": False, "OUT_BF16": False, "CB": roofline.CHUNK}


@pytest.mark.slow
def test_a_renamed_or_changed_kernel_fails_loudly(tree):
    with pytest.raises(LookupError, match="no compile case of sign_unpack_kernel"):
        tree.configs("sign", "sign_unpack_kernel", {})
    with pytest.raises(LookupError, match=r"sign_decode_sum_kernel has no constexpr \['GROUP'\]"):
        tree.configs("sign", "sign_decode_sum_kernel", {"GROUP": 2})
    no_loop = roofline.Launch("sign", "sign_decode_sum_kernel", DECODE, lambda meta: 1)
    with pytest.raises(ValueError, match="1 loops in the SASS, 0 trip counts in the row: update the rows"):
        roofline.predict_launch(tree, no_loop)


@pytest.mark.slow
def test_every_shipped_config_is_predicted(tree):
    """Autotune picks among the configs: the cast kernel ships two (BLOCK 1024 and 4096)."""
    configs = tree.configs("cast", "ef_cast_kernel", {"HAS_RESIDUAL": True, "X_BF16": False, "TO_BF16": False})
    assert sorted((values["BLOCK"], case.num_warps) for case, values in configs) == [(1024, 4), (4096, 8)]


@pytest.mark.slow
def test_the_decode_sum_loop_costs_the_same_for_each_rank(tree):
    """sign_decode_sum's loop over the other ranks: each rank adds one loop body, so the ALU work
    of 64 ranks minus that of 2 is 62 bodies, and 64 ranks are bound by instructions, not bytes."""
    def alu(world):
        launch = roofline.Launch("sign", "sign_decode_sum_kernel", DECODE, lambda meta: 1, (world - 1,))
        return roofline.predict_launch(tree, launch)["per_warp"]["alu"]

    two, three, many = alu(2), alu(3), alu(64)
    assert three - two > 0 and many - two == pytest.approx(62 * (three - two))
    row = next(r for r in roofline.rows(tree, roofline.SIZES["100M"]) if r.name == "sign decode-sum p=64")
    predicted = roofline.predict(tree, row, copy_gbps=2954)
    assert predicted["bound"] != "bytes" and predicted["instr_ms"] > 2 * predicted["bytes_ms"]
