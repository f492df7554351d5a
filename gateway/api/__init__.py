"""HTTP APIs: Ollama (``/api/*``, ``/``) and OpenAI-compatible (``/v1/*``)."""
