"""The engine: a model's context (KV cache, graph scheduler) over its devices."""
