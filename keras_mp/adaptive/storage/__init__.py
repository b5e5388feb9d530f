"""How each variable is stored (weights, gradients, optimizer state), from the same evidence."""
