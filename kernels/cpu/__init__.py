"""The C kernels for the CPU: their build (build.py), paged decode attention over the blocks in
place (attention.py), the GEMM on packed weights (gemm.py); the fused elementwise ops' C side is
csrc/fused_ops.c, called from kernels/fused.py."""
