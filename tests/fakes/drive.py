"""Fake Google Drive API v3 over HTTPS, for google-api-python-client pointed at it by `api_endpoint`.

In-memory files (`id → DriveFile`); list with a small `q` parser, get / `alt=media` / export, JSON and
multipart (and `uploadType=media`) create and update, delete, and an OAuth `/token` endpoint for
service-account credentials. It must run over TLS: the client keeps the `https` scheme of its upload URLs
whatever endpoint it is given (see service-protocols.md §2.3).
"""

from __future__ import annotations

import email.parser
import email.policy
import itertools
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tests.fakes.service import Call, Handler, ServiceFake
from tests.fakes.tls import TLSFiles

FOLDER = "application/vnd.google-apps.folder"
GOOGLE_DOC = "application/vnd.google-apps.document"
ACCESS_TOKEN = "fake-access"  # what /token hands out for a service-account assertion

_CLAUSE = re.compile(
    r"\s*(?:'(?P<parent>(?:[^'\\]|\\.)*)'\s+in\s+parents"
    r"|(?P<field>name|mimeType)\s*(?P<op>=|!=|contains)\s*'(?P<value>(?:[^'\\]|\\.)*)'"
    r"|trashed\s*=\s*(?P<trashed>true|false))\s*(?:and\b|$)"
)


def drive_error(status: int, reason: str, message: str, location: str | None = None) -> dict[str, Any]:
    """Drive's JSON error body."""
    item = {"domain": "global", "reason": reason, "message": message}
    if location:
        item |= {"locationType": "parameter", "location": location}
    return {"error": {"code": status, "message": message, "errors": [item]}}


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


@dataclass
class DriveFile:
    """One file or folder of the fake Drive."""

    id: str
    name: str
    mimeType: str
    parents: list[str]
    content: bytes = b""
    trashed: bool = False
    modifiedTime: str = field(default_factory=_now)

    def resource(self) -> dict[str, Any]:
        res: dict[str, Any] = {
            "kind": "drive#file",
            "id": self.id,
            "name": self.name,
            "mimeType": self.mimeType,
            "parents": list(self.parents),
            "trashed": self.trashed,
            "modifiedTime": self.modifiedTime,
        }
        if not self.mimeType.startswith("application/vnd.google-apps."):
            res["size"] = str(len(self.content))
        return res


class FakeDrive(ServiceFake):
    """Drive v3 on `https://127.0.0.1:<port>/drive/v3/`; `files` holds the state, `calls` the requests."""

    def __init__(self, tls: TLSFiles, tokens: tuple[str, ...] = ("test-token", ACCESS_TOKEN)) -> None:
        super().__init__(tls=tls)
        self.files: dict[str, DriveFile] = {}
        self.tokens = set(tokens)
        self.quota_exceeded = False  # creates fail like a service account's in a My Drive folder
        self.refuse_grants = False  # /token answers invalid_grant (a deleted or disabled service account)
        self.token_requests: list[dict[str, str]] = []
        self._ids = itertools.count(1)

    @property
    def endpoint(self) -> str:
        """The `api_endpoint` to give the client (the Drive base, including `/drive/v3/`)."""
        return f"{self.url}/drive/v3/"

    def add(self, name: str, content: bytes | str = b"", *, parent: str, mime: str = "text/plain",
            file_id: str | None = None) -> str:
        """Put a file into the fake and return its id."""
        fid = file_id or f"f{next(self._ids)}"
        data = content.encode() if isinstance(content, str) else content
        self.files[fid] = DriveFile(fid, name, mime, [parent] if parent else [], data)
        return fid

    def routes(self) -> list[BaseRoute]:
        def ep(handler: Handler) -> Any:
            return self.recorded(self._signed_in(handler))

        return [
            Route("/drive/v3/files", ep(self._list), methods=["GET"]),
            Route("/drive/v3/files", ep(self._create), methods=["POST"]),
            Route("/upload/drive/v3/files", ep(self._create), methods=["POST"]),
            Route("/drive/v3/files/{fid}/export", ep(self._export), methods=["GET"]),
            Route("/drive/v3/files/{fid}", ep(self._get), methods=["GET"]),
            Route("/drive/v3/files/{fid}", ep(self._update), methods=["PATCH"]),
            Route("/upload/drive/v3/files/{fid}", ep(self._update), methods=["PATCH"]),
            Route("/drive/v3/files/{fid}", ep(self._delete), methods=["DELETE"]),
            Route("/token", self._token, methods=["POST"]),
        ]

    # ── helpers ──

    def _signed_in(self, handler: Handler) -> Handler:
        """Answer 401 unless the request carries one of `tokens`."""

        async def checked(request: Request, call: Call) -> Response:
            auth = call.headers.get("authorization", "")
            if not (auth.startswith("Bearer ") and auth[7:] in self.tokens):
                return self._error(401, "authError", "Request had invalid authentication credentials.",
                                   "Authorization")
            return await handler(request, call)

        return checked

    @staticmethod
    def _error(status: int, reason: str, message: str, location: str | None = None) -> JSONResponse:
        return JSONResponse(drive_error(status, reason, message, location), status_code=status)

    def _lookup(self, request: Request) -> DriveFile | JSONResponse:
        fid = request.path_params["fid"]
        f = self.files.get(fid)
        return f if f is not None else self._error(404, "notFound", f"File not found: {fid}.", "fileId")

    @staticmethod
    def _matches(f: DriveFile, q: str) -> bool | None:
        """Whether `f` satisfies query `q`; None when `q` is not understood."""
        pos, ok = 0, True
        while pos < len(q):
            m = _CLAUSE.match(q, pos)
            if not m or m.end() == pos:
                return None
            pos = m.end()
            if m["parent"] is not None:
                ok &= _unescape(m["parent"]) in f.parents
            elif m["trashed"] is not None:
                ok &= f.trashed == (m["trashed"] == "true")
            else:
                have, want = getattr(f, m["field"]), _unescape(m["value"])
                ok &= {"=": have == want, "!=": have != want, "contains": want in have}[m["op"]]
        return ok

    @staticmethod
    def _parse_upload(call: Call) -> tuple[dict[str, Any], bytes | None] | JSONResponse:
        """(metadata, content or None) of a JSON, multipart/related or media request body."""
        upload = call.query.get("uploadType")
        if upload is None:
            return (call.json or {}), None
        if upload == "media":
            return {}, call.body
        if upload != "multipart":
            return FakeDrive._error(400, "badRequest", f"uploadType {upload} is not supported by the fake")
        head = f"Content-Type: {call.headers.get('content-type', '')}\r\n\r\n".encode()
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + call.body)
        parts = list(msg.iter_parts()) if msg.is_multipart() else []
        if len(parts) != 2:
            return FakeDrive._error(400, "badContent", "multipart upload needs a metadata part and a media part")
        return json.loads(parts[0].get_payload(decode=True) or b"{}"), parts[1].get_payload(decode=True) or b""

    # ── routes ──

    async def _token(self, request: Request) -> Response:
        form = dict(await request.form())
        self.token_requests.append({k: str(v) for k, v in form.items()})
        if self.refuse_grants or form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer" \
                or not form.get("assertion"):
            return JSONResponse({"error": "invalid_grant", "error_description": "Invalid JWT Signature."},
                                status_code=400)
        return JSONResponse({"access_token": ACCESS_TOKEN, "expires_in": 3600, "token_type": "Bearer"})

    async def _list(self, request: Request, call: Call) -> Response:
        q = call.query.get("q", "")
        matched = []
        for f in self.files.values():
            verdict = self._matches(f, q)
            if verdict is None:
                return self._error(400, "invalid", "Invalid Value", "q")
            if verdict:
                matched.append(f)
        size = int(call.query.get("pageSize", "100"))
        start = int(call.query.get("pageToken", "0") or 0)
        page = matched[start : start + size]
        body: dict[str, Any] = {"kind": "drive#fileList", "incompleteSearch": False,
                                "files": [f.resource() for f in page]}
        if start + size < len(matched):
            body["nextPageToken"] = str(start + size)
        return JSONResponse(body)

    async def _get(self, request: Request, call: Call) -> Response:
        f = self._lookup(request)
        if isinstance(f, JSONResponse):
            return f
        if call.query.get("alt") == "media":
            if f.mimeType.startswith("application/vnd.google-apps."):
                return self._error(
                    403,
                    "fileNotDownloadable",
                    "Only files with binary content can be downloaded. Use Export with Docs Editors files.",
                    "alt",
                )
            return Response(f.content, media_type=f.mimeType)
        return JSONResponse(f.resource())

    async def _export(self, request: Request, call: Call) -> Response:
        f = self._lookup(request)
        if isinstance(f, JSONResponse):
            return f
        if not f.mimeType.startswith("application/vnd.google-apps.") or f.mimeType == FOLDER:
            return self._error(403, "fileNotExportable", "Export only supports Docs Editors files.", "fileId")
        target = call.query.get("mimeType", "")
        if not target.startswith("text/"):
            return self._error(400, "badRequest", "The requested conversion is not supported.", "convertTo")
        return Response(f.content, media_type=target)

    async def _create(self, request: Request, call: Call) -> Response:
        if self.quota_exceeded:
            return self._error(403, "storageQuotaExceeded",
                               "Service Accounts do not have storage quota. Leverage shared drives "
                               "(https://developers.google.com/workspace/drive/api/guides/about-shareddrives), "
                               "or use OAuth delegation instead.")
        parsed = self._parse_upload(call)
        if isinstance(parsed, JSONResponse):
            return parsed
        meta, content = parsed
        parents = meta.get("parents") or []
        for p in parents:
            if p not in self.files or self.files[p].mimeType != FOLDER:
                return self._error(404, "notFound", f"File not found: {p}.", "parents")
        fid = self.add(
            meta.get("name", "Untitled"),
            content or b"",
            parent=parents[0] if parents else "",
            mime=meta.get("mimeType") or ("text/plain" if content is not None else "application/octet-stream"),
        )
        return JSONResponse(self.files[fid].resource())

    async def _update(self, request: Request, call: Call) -> Response:
        f = self._lookup(request)
        if isinstance(f, JSONResponse):
            return f
        parsed = self._parse_upload(call)
        if isinstance(parsed, JSONResponse):
            return parsed
        meta, content = parsed
        for key in ("name", "trashed", "mimeType"):
            if key in meta:
                setattr(f, key, meta[key])
        if content is not None:
            f.content = content
        add = [p for p in call.query.get("addParents", "").split(",") if p]
        remove = [p for p in call.query.get("removeParents", "").split(",") if p]
        f.parents = [p for p in f.parents if p not in remove] + add
        f.modifiedTime = _now()
        return JSONResponse(f.resource())

    async def _delete(self, request: Request, call: Call) -> Response:
        f = self._lookup(request)
        if isinstance(f, JSONResponse):
            return f
        del self.files[f.id]
        return Response(status_code=204)
