"""User-facing error texts shared by the APIs and the (I/O-free) scheduler."""

# Ollama's runner text for a prompt over the context when context shift is off (llm/server.go).
CONTEXT_OVERFLOW_MESSAGE = ("the prompt is longer than the context length currently available to the "
                            "model; shorten the prompt, adjust the context length in settings, or use "
                            "a model with a longer context length")


def context_overflow(prompt_tokens: int, n_ctx: int, approx: bool = False) -> str:
    """Ollama's over-long-prompt text plus the numbers (tokens): one message for every place
    that finds it (the exact /tokenize check, the scheduler's estimate, the worker's own 400)."""
    about = "about " if approx else ""
    return (f"{CONTEXT_OVERFLOW_MESSAGE} (prompt: {about}{prompt_tokens} tokens, "
            f"context per slot: {n_ctx} tokens)")
