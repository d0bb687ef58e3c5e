"""Ollama's native API on the same port, for the clients that speak it (the `ollama` Python and
JS clients, Open WebUI, editors' plugins): chat and generate over the same turn as the OpenAI
endpoints (chat.py), the store and the loaded model (models.py). Errors are Ollama's
`{"error": message}` (errors.py)."""

from starlette.routing import Route

from server.api.ollama import chat, models

ROUTES = [
    Route("/api/chat", chat.chat, methods=["POST"]),
    Route("/api/generate", chat.generate, methods=["POST"]),
    Route("/api/tags", models.tags, methods=["GET"]),
    Route("/api/ps", models.ps, methods=["GET"]),
    Route("/api/show", models.show, methods=["POST"]),
    Route("/api/version", models.version, methods=["GET"]),
    Route("/api/embed", models.embed_inputs, methods=["POST"]),
    Route("/api/embeddings", models.embed_inputs, methods=["POST"]),
]
