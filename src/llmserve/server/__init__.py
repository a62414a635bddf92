"""The OpenAI-compatible HTTP server: FastAPI app, protocol schemas, serving layers, auth and errors.

It uses only the engine's public API (`AsyncEngine`, `SamplingParams`, `RequestOutput`).
"""
