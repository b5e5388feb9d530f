"""What decides: the rule's thresholds, the pure decision, the loss scale's side, fit gain."""
