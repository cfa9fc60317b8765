"""`nvchat serve`: the engine behind an OpenAI-compatible HTTP API (FastAPI on uvicorn)."""
