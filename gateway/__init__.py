"""llama-gateway: one Ollama-compatible endpoint over one llama-server per GPU."""

__version__ = "0.1.0"
