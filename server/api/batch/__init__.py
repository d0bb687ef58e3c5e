"""OpenAI's Files and Batch APIs and the batch queue (worker.py) that runs every batch's lines,
Anthropic's Message Batches' too, on the capacity interactive requests leave idle."""

from starlette.routing import Route

from server.api.batch import batches, files

ROUTES = [
    Route("/v1/files", files.upload_file, methods=["POST"]),
    Route("/v1/files", files.list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", files.get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
    Route("/v1/batches", batches.create_batch, methods=["POST"]),
    Route("/v1/batches", batches.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batches.get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batches.cancel_batch, methods=["POST"]),
]
