"""Outside the interpreter, forcing the Triton backend on CPU tensors fails with a clear error;
the kernel families are listed once."""
import importlib
import pkgutil

import pytest
import torch

import gradcomp
import gradcomp.kernels
from gradcomp.kernels.common import interpreting

pytestmark = pytest.mark.skipif(interpreting(), reason="the interpreter runs CPU tensors")


def test_families_are_every_kernel_module_with_compile_cases():
    modules = [importlib.import_module(f"gradcomp.kernels.{info.name}")
               for info in pkgutil.iter_modules(gradcomp.kernels.__path__)]
    assert {m.__name__ for m in modules if hasattr(m, "compile_cases")} == \
        {m.__name__ for m in gradcomp.kernels.families()}


@pytest.mark.parametrize("name", list(gradcomp.METHODS))
def test_forced_triton_on_cpu_names_the_fix(name, monkeypatch):
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gradcomp.compress(torch.randn(64, 512), name)


def test_auto_backend_keeps_cpu_tensors_on_torch(monkeypatch):
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)
    x = torch.randn(1000)
    assert torch.equal(gradcomp.decompress(gradcomp.compress(x, "fp16")), x.half().float())
