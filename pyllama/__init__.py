"""pyllama: an LLM inference server for GGUF models, built for layer splits over several machines."""
__version__ = "0.1.0"
