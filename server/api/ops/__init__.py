"""What runs the server rather than a model API: the dashboard and its files, health, metrics,
the model list, usage, and the tokenizer over HTTP."""

from starlette.routing import Route

from server.api.ops import dashboard, health, tokenize, usage

ROUTES = [
    Route("/", dashboard.index, methods=["GET"]),
    Route("/static/{name}", dashboard.static_file, methods=["GET"]),
    Route("/v1/dashboard/state", dashboard.dashboard_state, methods=["GET"]),
    Route("/health", health.health, methods=["GET"]),
    Route("/metrics", health.prometheus, methods=["GET"]),
    Route("/get_load", health.get_load, methods=["GET"]),
    Route("/v1/models", health.list_models, methods=["GET"]),
    Route("/v1/models/{model}/load", health.load_model, methods=["POST"]),
    Route("/v1/models/{model}/unload", health.unload_model, methods=["POST"]),
    Route("/v1/models/{model:path}", health.get_model, methods=["GET"]),
    Route("/v1/usage", usage.get_usage, methods=["GET"]),
    Route("/tokenize", tokenize.tokenize, methods=["POST"]),
    Route("/detokenize", tokenize.detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenize.tokenizer_info, methods=["GET"]),
]
