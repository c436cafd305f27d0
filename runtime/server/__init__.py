"""The OpenAI-compatible server: FastAPI app, engine service thread, metrics."""
