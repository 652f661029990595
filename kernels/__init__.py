"""Fused Triton kernels, one module per method family (installed as gradcomp.kernels).

cast (fp16/bf16), quant (int8/int4), sign, topk, powersgd: each has @triton.jit kernels, a
launcher per operation, its declared global-memory bytes (``*_bytes``) and ``compile_cases()``.
common: configs, dtype plumbing, exact rounding; traffic: byte counting under TRITON_INTERPRET=1.
gradcomp.methods dispatches CUDA tensors here (GRADCOMP_BACKEND=triton|torch forces a path).
See docs/kernels.md.
"""
