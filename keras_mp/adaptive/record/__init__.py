"""What a run keeps: controller state as variables saved with the model; the run's timeline."""
