"""The OpenAI Files API: a tenant's files, their rows in the store and their bytes in a FileStorage.

    POST /v1/files (multipart: file, purpose)   GET /v1/files   GET /v1/files/{id}
    GET /v1/files/{id}/content                  DELETE /v1/files/{id}

A file's row (tables.files) is the one record that it exists and whose it is; the storage holds bytes by
(tenant, file id) and nothing else. A tenant sees only its own files: every query names its tenant id.
"""
import asyncio
import email.parser
import email.policy
import os
import time
import uuid
from pathlib import Path
from typing import Protocol

from sqlalchemy import Engine, delete, func, insert, select
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.gateway.auth import authorization, client_address
from inferd.gateway.tables import files
from inferd.protocol.errors import InvalidRequest, NotFound, PayloadTooLarge
from inferd.protocol.http import read_body

PURPOSES = ("batch", "batch_output")  # batch: uploaded; batch_output: a batch's output and error files
UPLOADABLE = ("batch",)


class FileStorage(Protocol):
    """Where file bytes live (a local directory here; an S3-compatible store would be another one)."""
    def put(self, tenant_id: str, file_id: str, content: bytes) -> None: ...
    def get(self, tenant_id: str, file_id: str) -> bytes: ...
    def delete(self, tenant_id: str, file_id: str) -> None: ...


class LocalFileStorage:
    """One folder per tenant under root; a file is written beside its name, synced, then renamed into place."""

    def __init__(self, root: Path):
        self.root = root

    def put(self, tenant_id: str, file_id: str, content: bytes) -> None:
        path = self._path(tenant_id, file_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with partial.open("wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)

    def get(self, tenant_id: str, file_id: str) -> bytes:
        return self._path(tenant_id, file_id).read_bytes()

    def delete(self, tenant_id: str, file_id: str) -> None:
        self._path(tenant_id, file_id).unlink(missing_ok=True)

    def _path(self, tenant_id: str, file_id: str) -> Path:
        assert "/" not in tenant_id and "/" not in file_id and not file_id.startswith(".")
        return self.root / tenant_id / file_id


class Files:
    """A tenant's files: rows in the store, bytes in the storage, all of a tenant's within its size cap."""

    def __init__(self, engine: Engine, storage: FileStorage, max_file_bytes: int, tenant_max_bytes: int):
        self.engine = engine
        self.storage = storage
        self.max_file_bytes = max_file_bytes
        self.tenant_max_bytes = tenant_max_bytes

    def create(self, tenant_id: str, filename: str, purpose: str, content: bytes, file_id: str | None = None
               ) -> dict:
        """Store a file; a given file_id (a batch's output) replaces that file if it exists."""
        if len(content) > self.max_file_bytes:
            raise PayloadTooLarge(f"The file is larger than {self.max_file_bytes} bytes.", param="file")
        used = self.used_bytes(tenant_id)
        if purpose in UPLOADABLE and used + len(content) > self.tenant_max_bytes:
            raise PayloadTooLarge(f"Your files would take {used + len(content)} bytes; the limit is "
                                  f"{self.tenant_max_bytes}. Delete files first.", param="file",
                                  code="file_storage_limit")
        row = {"id": file_id or f"file-{uuid.uuid4().hex}", "tenant_id": tenant_id, "purpose": purpose,
               "filename": filename[:256], "bytes": len(content), "created_at": int(time.time())}
        self.storage.put(tenant_id, row["id"], content)
        with self.engine.begin() as conn:
            conn.execute(delete(files).where(files.c.id == row["id"], files.c.tenant_id == tenant_id))
            conn.execute(insert(files).values(**row))
        return file_object(row)

    def get(self, tenant_id: str, file_id: str) -> dict:
        return file_object(self._row(tenant_id, file_id))

    def content(self, tenant_id: str, file_id: str) -> bytes:
        self._row(tenant_id, file_id)
        return self.storage.get(tenant_id, file_id)

    def delete(self, tenant_id: str, file_id: str) -> dict:
        self._row(tenant_id, file_id)
        with self.engine.begin() as conn:
            conn.execute(delete(files).where(files.c.id == file_id, files.c.tenant_id == tenant_id))
        self.storage.delete(tenant_id, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def page(self, tenant_id: str, limit: int, after: str | None, purpose: str | None = None) -> dict:
        query = select(files).where(files.c.tenant_id == tenant_id)
        if purpose:
            query = query.where(files.c.purpose == purpose)
        return list_page(self.engine, query, files, tenant_id, limit, after, file_object, max_limit=10_000)

    def used_bytes(self, tenant_id: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(files.c.bytes), 0))
                                    .where(files.c.tenant_id == tenant_id)).scalar_one())

    def _row(self, tenant_id: str, file_id: str) -> dict:
        with self.engine.connect() as conn:
            row = conn.execute(select(files).where(files.c.id == file_id, files.c.tenant_id == tenant_id)
                               ).mappings().first()
        if row is None:
            raise NotFound(f"No such file: '{file_id}'.", param="file_id", code="file_not_found")
        return dict(row)


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def list_page(engine: Engine, query, table, tenant_id: str, limit: int, after: str | None, render,
              max_limit: int = 100) -> dict:
    """Newest first, `limit` rows after the row with id `after` (OpenAI's cursor pagination)."""
    if not 1 <= limit <= max_limit:
        raise InvalidRequest(f"limit must be between 1 and {max_limit}", param="limit")
    with engine.connect() as conn:
        if after is not None:
            seq = conn.execute(select(table.c.seq).where(table.c.id == after, table.c.tenant_id == tenant_id)
                               ).scalar_one_or_none()
            if seq is None:
                raise InvalidRequest(f"No such object: '{after}'.", param="after")
            query = query.where(table.c.seq < seq)
        rows = [dict(r) for r in conn.execute(query.order_by(table.c.seq.desc()).limit(limit + 1)).mappings()]
    data = [render(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (filename or None, bytes)."""
    if not content_type.startswith("multipart/form-data"):
        raise InvalidRequest("POST /v1/files takes multipart/form-data (fields: file, purpose)")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"content-type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise InvalidRequest("the multipart body could not be read")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


# routes

class FileRoutes:
    def __init__(self, gateway):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/v1/files", self.create, methods=["POST"]), Route("/v1/files", self.listing, methods=["GET"]),
                Route("/v1/files/{file_id}", self.get, methods=["GET"]),
                Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", self.content, methods=["GET"])]

    async def _tenant(self, request: Request) -> str:
        key = await self.gw.keys.authenticate(authorization(request), client_address(request))
        return key.tenant.id

    async def create(self, request: Request) -> Response:
        tenant_id = await self._tenant(request)
        body = await read_body(request, self.gw.files.max_file_bytes + 64 * 1024)
        fields = parse_form(request.headers.get("content-type", ""), body)
        purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace")
        if purpose not in UPLOADABLE:
            raise InvalidRequest(f"purpose must be one of {', '.join(UPLOADABLE)}", param="purpose")
        if "file" not in fields:
            raise InvalidRequest("the form has no 'file' field", param="file")
        filename, content = fields["file"]
        return JSONResponse(await asyncio.to_thread(self.gw.files.create, tenant_id, filename or "upload.jsonl",
                                                   purpose, content))

    async def listing(self, request: Request) -> Response:
        tenant_id, q = await self._tenant(request), request.query_params
        return JSONResponse(await asyncio.to_thread(self.gw.files.page, tenant_id, page_limit(q, 10000),
                                                   q.get("after"), q.get("purpose")))

    async def get(self, request: Request) -> Response:
        tenant_id = await self._tenant(request)
        return JSONResponse(await asyncio.to_thread(self.gw.files.get, tenant_id, request.path_params["file_id"]))

    async def content(self, request: Request) -> Response:
        tenant_id = await self._tenant(request)
        data = await asyncio.to_thread(self.gw.files.content, tenant_id, request.path_params["file_id"])
        return Response(data, media_type="application/octet-stream")

    async def delete(self, request: Request) -> Response:
        tenant_id = await self._tenant(request)
        return JSONResponse(await asyncio.to_thread(self.gw.files.delete, tenant_id, request.path_params["file_id"]))


def page_limit(q, default: int) -> int:
    """A listing's ?limit=, or a 400 that names it."""
    try:
        return int(q.get("limit", default))
    except ValueError:
        raise InvalidRequest("limit must be a number", param="limit") from None
