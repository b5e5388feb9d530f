"""Benchmark scenarios, one module each, runnable as ``python -m benchmarks.<name>``.

Every scenario module has ``run(quick: bool = False) -> dict`` returning its
figures (so a CLI can call it) and prints its side-by-side ratio table when
run as a script. Shared timing helpers live in :mod:`benchmarks.common`.
"""

SCENARIOS: tuple[str, ...] = (
    "fused_bias_gelu",
    "unscale_multi_tensor",
    "transformer_step",
    "matmul_placement",
)
