"""OpenAI's APIs: chat completions (and the stored ones), completions, embeddings, the
Responses API with background responses, and conversations."""

from starlette.routing import Route

from server.api.openai import (
    chat,
    completions,
    conversations,
    embeddings,
    render,
    responses,
    stored_completions,
)

ROUTES = [
    Route("/v1/chat/completions", chat.create_chat_completion, methods=["POST"]),
    Route("/v1/chat/completions", stored_completions.list_completions, methods=["GET"]),
    Route("/v1/chat/completions/render", render.render_chat, methods=["POST"]),
    Route("/v1/completions/render", render.render_completion, methods=["POST"]),
    Route("/v1/chat/completions/{completion_id}", stored_completions.get_completion,
          methods=["GET"]),
    Route("/v1/chat/completions/{completion_id}", stored_completions.update_completion,
          methods=["POST"]),
    Route("/v1/chat/completions/{completion_id}", stored_completions.delete_completion,
          methods=["DELETE"]),
    Route("/v1/chat/completions/{completion_id}/messages", stored_completions.list_messages,
          methods=["GET"]),
    Route("/v1/completions", completions.create_completion, methods=["POST"]),
    Route("/v1/embeddings", embeddings.create_embeddings, methods=["POST"]),
    Route("/v1/responses", responses.create_response, methods=["POST"]),
    Route("/v1/responses/input_tokens", responses.count_input_tokens, methods=["POST"]),
    Route("/v1/responses/compact", responses.compact, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", responses.list_input_items,
          methods=["GET"]),
    Route("/v1/responses/{response_id}/cancel", responses.cancel_response, methods=["POST"]),
    Route("/v1/conversations", conversations.create_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", conversations.get_conversation,
          methods=["GET"]),
    Route("/v1/conversations/{conversation_id}", conversations.update_conversation,
          methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", conversations.delete_conversation,
          methods=["DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", conversations.add_items,
          methods=["POST"]),
    Route("/v1/conversations/{conversation_id}/items", conversations.list_items,
          methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", conversations.get_item,
          methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", conversations.delete_item,
          methods=["DELETE"]),
]
