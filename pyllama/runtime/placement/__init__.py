"""Where a model's layers go: device plans, split balance."""
