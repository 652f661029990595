"""Fused Triton kernels, one module per method (installed as gradcomp.kernels)."""
