"""/v1/files: upload (multipart), list, retrieve, content, delete; a key sees only its own."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.api.auth import tenant
from server.api.errors import APIError, invalid
from server.api.owned import not_found, owned_row
from server.api.pagination import int_param, page
from server.api.state import ServerState
from storage.files import file_object

PURPOSES = ("batch",)
EXPIRY_SECONDS = (3600, 2592000)  # OpenAI's range for expires_after.seconds: 1 hour to 30 days


async def upload_file(request: Request) -> Response:
    state: ServerState = request.app.state.server
    limit = state.settings.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + (1 << 20):
        raise APIError(413, f"The file is larger than the limit of {limit} bytes.",
                       param="file", code="file_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid(None, "Upload files as multipart/form-data with fields 'file' and "
                      "'purpose'.")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as e:  # noqa: BLE001 - malformed multipart is the client's
        raise invalid(None, f"Could not parse the multipart body: {e}") from None
    try:
        purpose = form.get("purpose")
        upload = form.get("file")
        if not isinstance(purpose, str) or not purpose:
            raise invalid("purpose", "Missing required parameter: 'purpose'.")
        if purpose not in PURPOSES:
            raise invalid("purpose", f"Unsupported purpose {purpose!r}: localserve accepts "
                          f"{', '.join(map(repr, PURPOSES))}.")
        if not isinstance(upload, UploadFile):
            raise invalid("file", "Missing required parameter: 'file' (a file part).")
        expiry = {key[len("expires_after["):-1]: value for key, value in form.items()
                  if key.startswith("expires_after[") and key.endswith("]")}
        expires = expires_after(expiry or form.get("expires_after"), "expires_after")
        scratch = state.files.scratch()
        try:
            size = await asyncio.to_thread(_copy, upload, scratch, limit)
            if size > limit:
                raise APIError(413, f"The file is larger than the limit of {limit} bytes.",
                               param="file", code="file_too_large")
            row = await state.db.run(state.files.add, tenant(request),
                                     upload.filename or "upload.jsonl", purpose, scratch,
                                     request.headers.get("idempotency-key"), expires)
        except BaseException:
            scratch.unlink(missing_ok=True)
            raise
    finally:
        await form.close()
    return JSONResponse(file_object(row))


def expires_after(value: Any, param: str) -> int | None:
    """OpenAI's expiration policy {anchor: "created_at", seconds: 3600..2592000} -> seconds.
    In a multipart form the fields arrive as strings (`expires_after[seconds]`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(param, f"Invalid type for '{param}': expected an object with 'anchor' "
                      "and 'seconds'.")
    unknown = set(value) - {"anchor", "seconds"}
    if unknown:
        raise invalid(f"{param}.{sorted(unknown)[0]}", f"Unrecognized field "
                      f"'{param}.{sorted(unknown)[0]}': use 'anchor' and 'seconds'.")
    if value.get("anchor") != "created_at":
        raise invalid(f"{param}.anchor", f"Invalid '{param}.anchor': only 'created_at' is "
                      "supported.")
    seconds = value.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds)
    lo, hi = EXPIRY_SECONDS
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not lo <= seconds <= hi:
        raise invalid(f"{param}.seconds", f"Invalid '{param}.seconds': an integer from {lo} "
                      f"(1 hour) to {hi} (30 days), got {seconds!r}.")
    return seconds


def _copy(upload: UploadFile, scratch, limit: int) -> int:
    """Copy the spooled upload to `scratch`; returns its size (stops once past `limit`)."""
    upload.file.seek(0)
    size = 0
    with scratch.open("wb") as out:
        while chunk := upload.file.read(1 << 20):
            size += len(chunk)
            if size > limit:
                return size
            out.write(chunk)
    return size


async def list_files(request: Request) -> Response:
    state: ServerState = request.app.state.server
    q = request.query_params
    limit = int_param(q.get("limit"), "limit", 10000, 1, 10000)
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "'order' must be 'asc' or 'desc'.")
    rows, has_more = await state.db.run(state.files.list, tenant(request), q.get("purpose"),
                                        q.get("after"), limit, order)
    return JSONResponse(page([file_object(r) for r in rows], has_more))


async def get_file(request: Request) -> Response:
    return JSONResponse(file_object(await _row(request)))


async def file_content(request: Request) -> Response:
    state: ServerState = request.app.state.server
    row = await _row(request)
    chunks = await asyncio.to_thread(state.files.read, row)  # (the store's first chunk)
    if chunks is None:  # removed outside the server: say so, not a 500 naming the path
        raise APIError(404, f"The content of file {row['id']} is no longer stored.",
                       code="file_content_missing")
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={
        "content-length": str(row["bytes"]),
        "content-disposition": content_disposition(row["filename"])})


def content_disposition(filename: str) -> str:
    """attachment with the file's name (RFC 6266: percent-encoded in filename* where it is
    not plain ASCII), as Starlette's FileResponse writes it."""
    quoted = quote(filename)
    if quoted != filename:
        return f"attachment; filename*=utf-8''{quoted}"
    return f'attachment; filename="{filename}"'


async def delete_file(request: Request) -> Response:
    state: ServerState = request.app.state.server
    file_id = request.path_params["file_id"]
    if not await state.db.run(state.files.delete, tenant(request), file_id):
        raise not_found("File", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def _row(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return await owned_row(request, state.files.get, "File", "file_id")

