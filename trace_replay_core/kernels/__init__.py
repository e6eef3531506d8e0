"""Triton kernels of the core, one module per kernel, and the compiled-launch helper."""
