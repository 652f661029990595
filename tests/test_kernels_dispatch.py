"""Outside the interpreter, forcing the Triton backend on CPU tensors fails with a clear error."""
import pytest
import torch

import gradcomp
from gradcomp.kernels.common import interpreting

pytestmark = pytest.mark.skipif(interpreting(), reason="the interpreter runs CPU tensors")


@pytest.mark.parametrize("name", ["fp16", "int8", "sign", "topk", "powersgd"])
def test_forced_triton_on_cpu_names_the_fix(name, monkeypatch):
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gradcomp.compress(torch.randn(64, 512), name)


def test_auto_backend_keeps_cpu_tensors_on_torch(monkeypatch):
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)
    x = torch.randn(1000)
    assert torch.equal(gradcomp.decompress(gradcomp.compress(x, "fp16")), x.half().float())
