"""What shows a run: precision_report, the picture of a run, TensorBoard summaries."""
