"""The Triton kernels, one per module: a pure plan_* function and a launcher that checks its inputs.
Imported only once a Triton backend is chosen. design: docs/gpu.md#the-triton-kernels
"""
