"""The Triton kernels, one per module: store (K/V into the paged cache), decode (split-KV paged
decode attention), prefill (paged prefill attention, chunked or on cached context). Each module
has a pure plan_* function (shapes, dtype, Target -> LaunchPlan: launch.py) and a launcher that
checks its inputs (checks.py) and launches a plan. `make gpu-compile` (scripts/gpu_compile.py)
compiles the plans for real GPU targets on a machine without a GPU.

Nothing here is imported until a Triton backend is chosen (kernels/backends.py): TRITON_INTERPRET
must be set before triton is first imported.
"""
