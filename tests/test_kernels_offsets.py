"""GPU rule (c): no index product that can pass 2^31 is computed in 32 bits.

Triton computes index arithmetic in int32 unless a value is widened: ``w * n`` with int32 w and n
wraps once p x n >= 2^31 and the kernel reads or writes outside its buffer. Each shipped kernel
variant (every family's ``compile_cases()``, ``gradcomp.kernels.FAMILIES``) is compiled ahead of time for sm_90 and its TTIR is
read: every ``arith.muli`` on i32 must multiply compile-time values only (constants and
``tl.arange`` ranges, whose product is bounded by the tile). A product involving a runtime value
(a kernel argument, a program id, a loop variable, a loaded value) must be i64.
"""
import importlib
import pkgutil
import re

import pytest

triton = pytest.importorskip("triton")

import gradcomp.kernels  # noqa: E402
from gradcomp.kernels.common import interpreting  # noqa: E402
from gradcomp.kernels.aot import compile_case  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(interpreting(), reason="ahead-of-time compilation needs the JIT")]

MODULES = [importlib.import_module(f"gradcomp.kernels.{info.name}")
           for info in pkgutil.iter_modules(gradcomp.kernels.__path__)]
"""Every module of the package: a ``*_kernel`` outside the families would have no compile case."""
CASES = [case for module in gradcomp.kernels.families() for case in module.compile_cases()]

DEFINITION = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ([\w.]+)(.*)$")
VALUE = re.compile(r"%[\w#]+")
COMPILE_TIME = {"arith.constant", "tt.make_range"}
"""Ops whose result is known at compile time (a tl.arange is bounded by its constexpr size)."""
SHAPING = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "arith.addi", "arith.subi",
           "arith.muli", "arith.extsi", "arith.extui", "arith.trunci", "arith.shli",
           "arith.divsi", "arith.remsi", "arith.andi", "arith.ori"}
"""Ops whose result is known at compile time when all their operands are."""


def i32_runtime_products(ttir: str) -> list[str]:
    """The TTIR lines that multiply in i32 (scalar or tensor) with a runtime operand and feed a
    pointer offset (products that feed no pointer, e.g. inside tl.rand's hash, are data)."""
    defs = {}
    for line in ttir.splitlines():
        match = DEFINITION.match(line)
        if match:
            name, op, rest = match.groups()
            defs[name] = (op, VALUE.findall(rest.split(" : ")[0]), line.strip())

    known = {}

    def compile_time(name: str) -> bool:
        if name not in known:  # block arguments (loop variables, kernel arguments) are runtime
            op, operands, _ = defs.get(name, ("argument", [], ""))
            known[name] = op in COMPILE_TIME or (op in SHAPING and all(map(compile_time, operands)))
        return known[name]

    addressing, pending = set(), [operands[1] for op, operands, _ in defs.values()
                                  if op == "tt.addptr" and len(operands) > 1]
    while pending:  # every value an offset is computed from
        name = pending.pop()
        if name not in addressing:
            addressing.add(name)
            pending.extend(defs.get(name, ("", [], ""))[1])
    return [line for name, (op, operands, line) in defs.items()
            if name in addressing and op == "arith.muli"
            and re.search(r":\s*(tensor<[^>]*xi32[,>]|i32\b)", line)
            and not all(map(compile_time, operands))]


def test_checker_flags_a_32_bit_row_offset():
    """The check fails on the pattern of finding 3 (``w * n`` in int32) and passes it widened."""
    import triton.language as tl

    @triton.jit
    def rows_kernel(x_ptr, out_ptr, n, world, WIDE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        acc = tl.load(x_ptr + offs, mask=offs < n)
        for w in range(1, world):
            if WIDE:
                row = w.to(tl.int64) * n
            else:
                row = w * n
            acc += tl.load(x_ptr + row + offs, mask=offs < n)
        tl.store(out_ptr + offs, acc, mask=offs < n)

    from gradcomp.kernels.common import CompileCase
    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "world": "i32",
                 "WIDE": "constexpr", "BLOCK": "constexpr"}
    flagged = {}
    for wide in (False, True):
        case = CompileCase("rows", rows_kernel, signature, {"WIDE": wide, "BLOCK": 128}, 4)
        flagged[wide] = i32_runtime_products(compile_case(case, 90).asm["ttir"])
    assert len(flagged[False]) == 1 and "arith.muli" in flagged[False][0]
    assert flagged[True] == []


def test_every_kernel_family_is_checked():
    names = {case.kernel.__name__ for case in CASES}
    for module in MODULES:
        kernels = {name for name in vars(module) if name.endswith("_kernel")}
        assert kernels <= names, f"{module.__name__}: no compile case for {sorted(kernels - names)}"
    assert {case.kernel.__module__ for case in CASES} == {m.__name__ for m in gradcomp.kernels.families()}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_index_products_are_64_bit(case):
    ttir = compile_case(case, 90).asm["ttir"]
    assert "arith.muli" in ttir or "tt.addptr" in ttir
    products = i32_runtime_products(ttir)
    assert not products, f"{case.name}: 32-bit products of runtime values:\n" + "\n".join(products)
