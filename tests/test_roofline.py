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


@pytest.mark.slow
def test_the_working_trees_topk_compress_is_all_triton_at_the_copy_floor():
    """The top-k compress at 100M (1%, error feedback): nine Triton launches and no torch op
    (the sample, the candidate pass, the radix select over the candidates, the count, its scan
    and the ordered write), predicted at >= 0.8 of a copy."""
    if interpreting():
        pytest.skip("ahead-of-time compilation needs the JIT")
    with contextlib.ExitStack() as stack:
        tree = roofline.Tree(None, stack)
        row = next(r for r in roofline.rows(tree, roofline.SIZES["100M"])
                   if r.name == "topk compress+EF")
        assert row.torch_ops == () and len(row.launches) == 9
        predicted = roofline.predict(tree, row, copy_gbps=2954)
        assert predicted["bytes_ms"] / predicted["predicted_ms"] >= 0.8


def _meta(tree, launch):
    """A launch's config values (the one shipped config of each PowerSGD kernel; no compile)."""
    (_, values), = tree.configs(launch.family, launch.kernel, launch.constexprs)
    return values


def _trips(tree, launch):
    meta = _meta(tree, launch)
    return tuple(t(meta) if callable(t) else t for t in launch.loops)


def test_the_powersgd_hook_row_is_one_launch_a_pass_for_the_bucket():
    """The working tree's hook rows: each pass one launch for all of a bucket's matrices (six
    4096 x 4096 at 100M: 3072 ef_matmul programs of 8 trips over 512-column splits, one
    Gram-Schmidt program per matrix, 15 sweeps of 2 row tiles, 24576 residual tiles), the hook's
    17 torch ops and 2 all-reduces; the GPT-2 block's runs of other shapes as mean trips; the
    bytes bench_gpu reports for the rows."""
    import bench_gpu

    assert (roofline.GPT2_BLOCK, roofline.GPT2_OP, roofline.SIDE) == (bench_gpu.GPT2_BLOCK, bench_gpu.GPT2_OP,
                                                                      bench_gpu.SIDE)
    with contextlib.ExitStack() as stack:
        tree = roofline.Tree(None, stack)
        names = [row.name for row in roofline.rows(tree, roofline.SIZES["16M"])]
        assert names[-2:] == ["powersgd hook", "powersgd hook gpt2-small block"]
        bucket = roofline.powersgd_row(tree, roofline.SIZES["100M"])
        block = roofline.powersgd_bucket_row(tree, roofline.GPT2_OP, roofline.GPT2_BLOCK)
        kernels = ["ef_matmul_kernel", "orthonormalize_kernel", "transpose_matmul_kernel", "residual_update_kernel"]
        for row in (bucket, block):
            assert [launch.kernel for launch in row.launches] == kernels
            assert all(launch.repeat == 1 for launch in row.launches)
            assert sum(count for _, count in row.torch_ops) == 17 + 2
            assert all(launch.constexprs["ALIGN"] == 8 for launch in row.launches if "matmul" in launch.kernel
                       or "residual" in launch.kernel)
        shapes = [(4096, 4096)] * 6
        assert bucket.n == 6 * 4096**2 and bucket.declared_bytes == bench_gpu.powersgd_bytes(shapes)
        assert [launch.programs(_meta(tree, launch)) for launch in bucket.launches] == [3072, 6, 3072, 24576]
        assert [_trips(tree, launch) for launch in bucket.launches] == [(8,), (4, 1.5, 2, 2, 2), (8,), (4,)]
        assert block.n == 7077888 and block.declared_bytes == bench_gpu.powersgd_bytes(bench_gpu.GPT2_BLOCK)
        assert [launch.programs(_meta(tree, launch)) for launch in block.launches] == [180, 4, 168, 1728]
        # ef_matmul: 12 + 12 + 12 + 48 row blocks x 4, 1, 6, 1 splits of 9, 12, 8, 12 trips;
        # transpose_matmul: 36 + 12 + 48 + 12 column blocks x 1, 1, 1, 6 splits of 12, 12, 12, 8
        assert [_trips(tree, launch) for launch in block.launches] == [
            (pytest.approx(1728 / 180),), (4, 1.5, 2, 2, 2), (pytest.approx(1728 / 168),), (4,)]


@pytest.mark.slow
def test_the_powersgd_hook_rows_match_their_sass():
    """Their loops are the compiled kernels' (predict raises otherwise): the bucket of six
    4096 x 4096 is bytes-bound, the GPT-2 block is not."""
    if interpreting():
        pytest.skip("ahead-of-time compilation needs the JIT")
    with contextlib.ExitStack() as stack:
        tree = roofline.Tree(None, stack)
        bucket = roofline.predict(tree, roofline.powersgd_row(tree, roofline.SIZES["100M"]), copy_gbps=2954)
        block = roofline.predict(tree, roofline.powersgd_bucket_row(tree, roofline.GPT2_OP, roofline.GPT2_BLOCK),
                                 copy_gbps=2954)
    assert bucket["launches"] == block["launches"] == 4 + 19
    assert bucket["bound"] == "bytes" and block["bound"] != "bytes"
    assert [k["programs"] for k in bucket["kernels"]] == [3072, 6, 3072, 24576]


@pytest.mark.slow
def test_the_blind_check_is_recomputed_from_the_measured_json():
    """d75eb4b's own roofline (from git) on its kernels against the H200 run's JSON: every row it
    predicts is a measured row of the same declared bytes (top-k's compress: the bench counts
    the candidates it found, the model 1.1k), and the counts docs/kernels.md states."""
    if interpreting():
        pytest.skip("ahead-of-time compilation needs the JIT")
    import json

    report = roofline.blind()
    measured = json.loads((roofline.REPO / roofline.BLIND["results"]).read_text())
    assert report["copy_gbps"] == measured["copy_gbps"]
    times = {(f"{r['method']} {r['op']}", r["n"]): r["kernel_ms"] for r in measured["rows"]}
    for row in report["rows"]:
        assert row["measured_ms"] == times[(row["row"], row["n"])]
        assert row["ratio"] == pytest.approx(row["predicted_ms"] / row["measured_ms"])
        if row["row"] != "topk compress+EF":
            assert row["declared_bytes"] == row["measured_declared_bytes"], row["row"]
        else:
            assert row["declared_bytes"] == pytest.approx(row["measured_declared_bytes"], rel=1e-3)
    assert len(report["rows"]) + len(report["not_predicted"]) == len(times)
    s = report["summary"]
    assert (s["rows"], s["within"], s["optimistic"], s["pessimistic_misses"]) == (51, 24, 45, 0)
    doc = (roofline.REPO / "docs" / "kernels.md").read_text()
    assert f"{s['within']} of {s['rows']} rows within 25%; {s['optimistic']} of {s['rows']}" in doc
