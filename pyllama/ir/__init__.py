"""The vocabulary every layer shares: element types, tensors, ops and graphs."""
