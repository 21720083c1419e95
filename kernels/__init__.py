"""Triton kernels (pack/unpack, k-means assignment, fused dequant + attention) land here.

This package imports nothing from quantwm/. Until a kernel exists for an operation, quantwm uses its
pure-PyTorch reference (the `*_ref` functions), which is also what runs on CPU.
"""
