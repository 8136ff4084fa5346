"""The C kernels for the CPU and their build (design: docs/architecture.md#kernels)."""
