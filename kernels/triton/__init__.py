"""The Triton kernels, one per module, each with a pure plan_* function (shapes, dtype, Target ->
LaunchPlan) and a launcher that checks its inputs and launches a plan. Nothing here is imported
until a Triton backend is chosen: TRITON_INTERPRET must be set before triton's first import.
"""
