"""Anthropic's APIs: Messages (with token counting) and Message Batches; errors on these routes
are in Anthropic's envelope (errors.py)."""

from starlette.routing import Route

from server.api.anthropic import message_batches, messages

ROUTES = [
    Route("/v1/messages", messages.create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
    Route("/v1/messages/batches", message_batches.create_message_batch, methods=["POST"]),
    Route("/v1/messages/batches", message_batches.list_message_batches, methods=["GET"]),
    Route("/v1/messages/batches/{message_batch_id}", message_batches.get_message_batch,
          methods=["GET"]),
    Route("/v1/messages/batches/{message_batch_id}", message_batches.delete_message_batch,
          methods=["DELETE"]),
    Route("/v1/messages/batches/{message_batch_id}/cancel",
          message_batches.cancel_message_batch, methods=["POST"]),
    Route("/v1/messages/batches/{message_batch_id}/results",
          message_batches.message_batch_results, methods=["GET"]),
]
