"""Gateway: OpenAI-compatible HTTP API (FastAPI), auth and priority, tokenization, streaming."""
