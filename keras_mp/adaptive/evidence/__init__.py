"""What measures: forward and gradient statistics, the float32 probe, float8 evidence, hooks."""
