"""google_drive: list, read, create, append, update and delete files inside one Google Drive folder.

Every operation is confined to the folder `FOLDER_ID` and the folders below it: a file whose parents do
not lead there is refused. Delete moves to the Drive trash unless `delete_mode` is `permanent`.
Credentials come from `credentials.json` in the config dir: a service-account key, or OAuth user
credentials (`authorized_user`, e.g. a `token.json` made once by a consent flow; when `credentials.json`
is the OAuth *client* file, `token.json` next to it is used). The Drive service is built once; each call
runs in a worker thread on its own HTTP connection (httplib2 is not thread-safe).

`plugin_config.plugin_storage_googledrive`: `base_url` (or env `DRIVE_BASE_URL`; the Drive API root
including `/drive/v3/`), `ca_bundle` (or env `DRIVE_CA_BUNDLE`; PEM file of CAs to trust), `subject`
(user to impersonate with domain-wide delegation), `delete_mode` (`trash`/`permanent`), `timeout` (s),
`num_retries`, `max_read_chars`, `max_list`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import re
import socket
from pathlib import Path
from typing import Any, Literal

import google.auth.exceptions
import google_auth_httplib2
import httplib2
from google.oauth2 import credentials as user_credentials
from google.oauth2 import service_account
from googleapiclient.discovery import build
from googleapiclient.errors import HttpError
from googleapiclient.http import MediaInMemoryUpload
from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

from failures import Service, describe, failure
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings

logger = logging.getLogger("agent_mcp.plugins.google_drive")

TOOL = "google_drive"
SCOPES = ["https://www.googleapis.com/auth/drive"]
FOLDER_MIME = "application/vnd.google-apps.folder"
GOOGLE_TYPES = "application/vnd.google-apps."
EXPORT_AS = {
    "application/vnd.google-apps.document": "text/plain",
    "application/vnd.google-apps.spreadsheet": "text/csv",
    "application/vnd.google-apps.presentation": "text/plain",
}
WRITE_OPERATIONS = frozenset({"create", "append", "update", "delete"})
FIELDS = "id,name,mimeType,parents,trashed,size,modifiedTime"
FILE_ID = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
MAX_DEPTH = 20  # folder levels walked up from a file looking for FOLDER_ID
MAX_DOWNLOAD = 10 * 1024 * 1024


class DriveSettings(PluginSettings):
    """`plugin_config.plugin_storage_googledrive`."""

    base_url: str | None = Field(default=None, pattern=r"^https?://")
    ca_bundle: str | None = None
    subject: str | None = None
    delete_mode: Literal["trash", "permanent"] = "trash"
    timeout: float = Field(default=60, gt=0)
    num_retries: int = Field(default=2, ge=0, le=5)
    max_read_chars: int = Field(default=100_000, ge=1000)
    max_list: int = Field(default=500, ge=10, le=10_000)


class DriveError(Exception):
    """An operation cannot be done as asked; the message says why and what to do instead."""


class _DriveArgs(BaseModel):
    operation: Literal["list", "read", "create", "append", "update", "delete"] = Field(
        description="list a folder; read a file; create a file; append text; update (replace text or rename); "
                    "delete (to the trash)"
    )
    file_id: str = Field(default="", description="The file's id (from list); read/append/update/delete")
    file_name: str = Field(
        default="", description="create: the new file's name; read/append/update/delete without file_id: the "
                                "exact name to look up in the folder; update with file_id: a new name")
    content: str = Field(default="", description="create/append: the text; update: the new full text")
    folder_id: str = Field(default="", description="list/create: a subfolder's id (default: the shared folder)")


def drive_operation(args: dict[str, Any]) -> str:
    """Gate operation type of a google_drive call: create/append/update/delete write, list/read read."""
    return "write" if args.get("operation") in WRITE_OPERATIONS else "read"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PluginConfigError(f"cannot read {path} ({exc}); put the service-account key or OAuth "
                                "credentials there") from None


def load_credentials(config_dir: Path, subject: str | None) -> Any:
    """Credentials from `credentials.json` (service account or OAuth user; client file → `token.json`)."""
    path = config_dir / "credentials.json"
    info = _read_json(path)
    if isinstance(info, dict) and ("installed" in info or "web" in info):
        path = config_dir / "token.json"
        if not path.is_file():
            raise PluginConfigError(
                f"{config_dir / 'credentials.json'} is an OAuth client file, and {path} does not exist: create "
                "token.json once with the consent flow (README, google_drive) or use a service-account key"
            )
        info = _read_json(path)
    kind = info.get("type") if isinstance(info, dict) else None
    if kind is None and isinstance(info, dict) and "refresh_token" in info:
        kind = "authorized_user"  # what google-auth's Credentials.to_json() writes: no "type" field
    try:
        if kind == "service_account":
            creds = service_account.Credentials.from_service_account_info(info, scopes=SCOPES)
            return creds.with_subject(subject) if subject else creds
        if kind == "authorized_user":
            return user_credentials.Credentials.from_authorized_user_info(info, SCOPES)
    except (ValueError, KeyError) as exc:
        raise PluginConfigError(f"{path}: not usable {kind} credentials ({exc})") from None
    raise PluginConfigError(f"{path}: \"type\" is {kind!r}; expected a service-account key (\"service_account\") "
                            "or OAuth user credentials (\"authorized_user\")")


def _escape(value: str) -> str:
    """A string literal for a Drive `q` query."""
    return value.replace("\\", "\\\\").replace("'", "\\'")


def _error_reason(exc: HttpError) -> str:
    details = exc.error_details
    if isinstance(details, list) and details and isinstance(details[0], dict):
        return str(details[0].get("reason") or "")
    return ""


def describe_error(exc: Exception, settings: DriveSettings) -> str:
    """What went wrong and what to do, in one line."""
    if isinstance(exc, DriveError):
        return str(exc)
    if isinstance(exc, google.auth.exceptions.RefreshError):
        return f"cannot get a Drive access token ({exc}); the credentials are revoked or expired: renew them"
    service = Service(
        "Drive", where=settings.base_url or "https://www.googleapis.com/drive/v3/", timeout=None,
        says={401: "Drive rejected the credentials", 404: "Drive has no such file, or this account cannot see it",
              403: "Drive refused", 429: "Drive rate limit reached"},
        advice={401: "renew credentials.json / token.json", 404: "use list for ids",
                403: "share the folder with this account (a service account's client_email) as Editor",
                429: "wait a minute and try again"})
    if not isinstance(exc, HttpError):
        return describe(service, exc) + (" and ca_bundle" if failure(exc).kind == "unreachable" else "")
    reason = _error_reason(exc)
    if reason == "storageQuotaExceeded":
        return ("Drive refused to store the file: service accounts have no storage quota. Use a folder on a "
                "shared drive, domain-wide delegation (plugin_config subject) or OAuth user credentials")
    limited = reason in ("rateLimitExceeded", "userRateLimitExceeded")
    named = reason and not limited and exc.status_code not in (401, 404)  # those say enough without it
    message = f"{reason}: {exc.reason}" if named else exc.reason
    return describe(service, exc, status=429 if limited else exc.status_code, message=message)


EXPECTED_ERRORS = (DriveError, HttpError, google.auth.exceptions.GoogleAuthError, httplib2.HttpLib2Error, OSError)


def _close_sockets(exc: BaseException) -> None:
    """Close sockets left open in the frames of a failed call.

    httplib2 0.32 does not close the socket of a refused connect(); it stays in a frame of the error's
    traceback (a reference cycle) until the garbage collector finds it. Every connection of a call ends
    with the call anyway.
    """
    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, socket.socket) and value.fileno() != -1:
                value.close()
        tb = tb.tb_next


class DriveFolder:
    """The Drive service and the folder every operation is confined to (shared by all calls)."""

    def __init__(self, service: Any, creds: Any, settings: DriveSettings, folder_id: str):
        self.service, self.creds, self.settings, self.folder_id = service, creds, settings, folder_id

    def run(self, operation: str, file_id: str, file_name: str, content: str, folder_id: str) -> str:
        """Do one operation (blocking: call it in a worker thread); returns the result text or raises."""
        http = google_auth_httplib2.AuthorizedHttp(
            self.creds, http=httplib2.Http(ca_certs=self.settings.ca_bundle, timeout=self.settings.timeout))
        try:
            call = _DriveCall(self, http)
            if operation in ("list", "create"):
                folder = call.folder(folder_id)
                if operation == "list":
                    return call.list(folder)
                return call.create(folder, file_name.strip(), content)
            meta = call.resolve(file_id.strip(), file_name.strip())
            if operation == "read":
                return call.read(meta)
            if operation == "append":
                return call.append(meta, content)
            if operation == "update":
                return call.update(meta, content, file_name.strip() if file_id.strip() else "")
            return call.delete(meta)
        except Exception as exc:
            _close_sockets(exc)
            raise
        finally:
            http.close()


class _DriveCall:
    """One operation's requests, all on the connection it was given (httplib2 is not thread-safe)."""

    def __init__(self, drive: DriveFolder, http: Any):
        self.files, self.settings, self.folder_id = drive.service.files(), drive.settings, drive.folder_id
        self.http = http

    # ── plumbing ──

    def _exec(self, request: Any) -> Any:
        """A Drive API request's answer: its JSON, or the bytes of a download (googleapiclient ships no types)."""
        return request.execute(http=self.http, num_retries=self.settings.num_retries)

    def _meta(self, file_id: str) -> dict[str, Any]:
        if not FILE_ID.match(file_id):
            raise DriveError(f"'{file_id}' is not a Drive file id; use list to see the ids")
        try:
            meta: dict[str, Any] = self._exec(self.files.get(fileId=file_id, fields=FIELDS, supportsAllDrives=True))
            return meta
        except HttpError as exc:
            if exc.status_code == 404:
                raise DriveError(f"no file with id {file_id} (or this account cannot see it); use list") from None
            raise

    def _inside(self, meta: dict[str, Any]) -> bool:
        """Whether FOLDER_ID is among the file's ancestors."""
        frontier, seen = list(meta.get("parents") or []), set()
        for _ in range(MAX_DEPTH):
            if self.folder_id in frontier:
                return True
            upper: list[str] = []
            for parent in frontier:
                if parent in seen:
                    continue
                seen.add(parent)
                try:
                    upper += self._exec(self.files.get(fileId=parent, fields="id,parents",
                                                          supportsAllDrives=True)).get("parents") or []
                except HttpError as exc:
                    if exc.status_code not in (403, 404):  # a parent we cannot see does not lead to FOLDER_ID
                        raise
            if not upper:
                return False
            frontier = upper
        return False

    def _confined(self, meta: dict[str, Any]) -> dict[str, Any]:
        if meta["id"] != self.folder_id and self._inside(meta):
            return meta
        if meta["id"] == self.folder_id:
            raise DriveError("that id is the shared folder itself; pass the id of a file inside it")
        raise DriveError(f"refused: '{meta.get('name')}' (id: {meta['id']}) is outside the shared folder "
                         f"{self.folder_id}; only files inside it can be used")

    def folder(self, folder_id: str) -> str:
        folder_id = folder_id.strip()
        if not folder_id or folder_id == self.folder_id:
            return self.folder_id
        meta = self._confined(self._meta(folder_id))
        if meta.get("mimeType") != FOLDER_MIME:
            raise DriveError(f"'{meta.get('name')}' (id: {folder_id}) is a file, not a folder")
        return folder_id

    def resolve(self, file_id: str, file_name: str) -> dict[str, Any]:
        """The metadata of the file named by id (checked to be inside) or by exact name in the folder."""
        if file_id:
            meta = self._confined(self._meta(file_id))
        elif file_name:
            found = self._exec(self.files.list(
                q=f"name = '{_escape(file_name)}' and '{self.folder_id}' in parents and trashed = false",
                fields=f"files({FIELDS})", pageSize=10, supportsAllDrives=True, includeItemsFromAllDrives=True,
            )).get("files", [])
            if not found:
                raise DriveError(f"no file named '{file_name}' in the shared folder; use list to see the names")
            if len(found) > 1:
                ids = ", ".join(f["id"] for f in found)
                raise DriveError(f"several files are named '{file_name}' (ids: {ids}); pass file_id")
            meta = found[0]
        else:
            raise DriveError("this operation needs file_id (from list) or file_name")
        if meta.get("trashed"):
            raise DriveError(f"'{meta.get('name')}' (id: {meta['id']}) is in the trash; restore it in Drive first")
        return meta

    @staticmethod
    def _label(meta: dict[str, Any]) -> str:
        return f"'{meta.get('name')}' (id: {meta['id']})"

    def _text_of(self, meta: dict[str, Any]) -> str:
        mime = meta.get("mimeType", "")
        if mime == FOLDER_MIME:
            raise DriveError(f"{self._label(meta)} is a folder; use list with folder_id={meta['id']}")
        if mime in EXPORT_AS:
            data = self._exec(self.files.export(fileId=meta["id"], mimeType=EXPORT_AS[mime]))
        elif mime.startswith(GOOGLE_TYPES):
            raise DriveError(f"{self._label(meta)} is a {mime} file, which cannot be read as text")
        elif int(meta.get("size") or 0) > MAX_DOWNLOAD:
            raise DriveError(f"{self._label(meta)} is {meta['size']} bytes, too large to read here")
        else:
            data = self._exec(self.files.get_media(fileId=meta["id"], supportsAllDrives=True))
        try:
            return data.decode("utf-8") if isinstance(data, bytes) else str(data)
        except UnicodeDecodeError:
            raise DriveError(f"{self._label(meta)} is a binary file ({mime}); it cannot be shown as text") from None

    def _writable(self, meta: dict[str, Any]) -> None:
        if meta.get("mimeType", "").startswith(GOOGLE_TYPES):
            raise DriveError(f"{self._label(meta)} is a Google Docs Editors file or folder ({meta['mimeType']}); "
                             "this tool can read it but only writes plain files")

    def _upload(self, meta: dict[str, Any], text: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        media = MediaInMemoryUpload(text.encode("utf-8"), mimetype=meta.get("mimeType") or "text/plain",
                                    resumable=False)
        updated: dict[str, Any] = self._exec(self.files.update(fileId=meta["id"], body=body or {}, media_body=media,
                                                               fields="id,name,size", supportsAllDrives=True))
        return updated

    # ── operations ──

    def list(self, folder: str) -> str:
        rows: list[dict[str, Any]] = []
        token, more = None, False
        while True:
            page = self._exec(self.files.list(
                q=f"'{folder}' in parents and trashed = false", orderBy="folder,name",
                fields="nextPageToken, files(id,name,mimeType,size,modifiedTime)", pageSize=100, pageToken=token,
                supportsAllDrives=True, includeItemsFromAllDrives=True,
            ))
            rows += page.get("files", [])
            token = page.get("nextPageToken")
            if not token or len(rows) >= self.settings.max_list:
                more = bool(token) or len(rows) > self.settings.max_list
                break
        if not rows:
            return f"(Folder {folder} is empty)"
        lines = [f"Contents of folder {folder}:"]
        for f in rows[: self.settings.max_list]:
            if f.get("mimeType") == FOLDER_MIME:
                lines.append(f"  [DIR]  {f['name']}  (id: {f['id']})")
            else:
                size = f", {f['size']} bytes" if f.get("size") else ""
                lines.append(f"  [FILE] {f['name']}  (id: {f['id']}, {f.get('mimeType')}{size}, "
                             f"modified {f.get('modifiedTime', '?')})")
        if more:
            lines.append(f"  … more items not shown (first {self.settings.max_list} listed)")
        return "\n".join(lines)

    def read(self, meta: dict[str, Any]) -> str:
        text = self._text_of(meta)
        limit = self.settings.max_read_chars
        note = f"\n…(truncated: {len(text) - limit} more characters not shown)" if len(text) > limit else ""
        return f"{self._label(meta)}:\n{text[:limit]}{note}"

    def create(self, folder: str, name: str, content: str) -> str:
        if not name:
            raise DriveError("create needs file_name")
        guessed = mimetypes.guess_type(name)[0] or ""
        mime = guessed if guessed.startswith("text/") or guessed in ("application/json", "application/xml") \
            else "text/plain"
        media = MediaInMemoryUpload(content.encode("utf-8"), mimetype=mime, resumable=False)
        made = self._exec(self.files.create(body={"name": name, "parents": [folder], "mimeType": mime},
                                               media_body=media, fields="id,name", supportsAllDrives=True))
        return f"Created '{made.get('name', name)}' — id: {made['id']}"

    def append(self, meta: dict[str, Any], content: str) -> str:
        if not content:
            raise DriveError("append needs content")
        self._writable(meta)
        current = self._text_of(meta)
        joined = current + ("\n" if current and not current.endswith("\n") else "") + content
        self._upload(meta, joined)
        return f"Appended {len(content)} characters to {self._label(meta)}; it now has {len(joined)} characters"

    def update(self, meta: dict[str, Any], content: str, new_name: str) -> str:
        rename = new_name if new_name and new_name != meta.get("name") else ""
        if not content and not rename:
            raise DriveError("update needs content (the new full text) or, with file_id, file_name (a new name)")
        self._writable(meta)
        body = {"name": rename} if rename else {}
        if content:
            self._upload(meta, content, body)
        else:
            self._exec(self.files.update(fileId=meta["id"], body=body, fields="id,name", supportsAllDrives=True))
        done = ([f"replaced its text ({len(content)} characters)"] if content else []) + (
            [f"renamed it to '{rename}'"] if rename else [])
        return f"Updated {self._label(meta)}: {' and '.join(done)}"

    def delete(self, meta: dict[str, Any]) -> str:
        if self.settings.delete_mode == "permanent":
            self._exec(self.files.delete(fileId=meta["id"], supportsAllDrives=True))
            return f"Deleted {self._label(meta)} permanently"
        self._exec(self.files.update(fileId=meta["id"], body={"trashed": True}, fields="id",
                                        supportsAllDrives=True))
        return f"Moved {self._label(meta)} to the Drive trash (it can be restored from there)"


class GoogleDrivePlugin(BasePlugin):
    PLUGIN_NAME = "plugin_storage_googledrive"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "google_drive: list, read, create, append, update, delete within one folder"
    DEPENDENCIES = ["google-api-python-client", "google-auth", "google-auth-httplib2"]
    ENV_VARS = ["FOLDER_ID"]

    def __init__(self) -> None:
        super().__init__()
        self.settings = DriveSettings()
        self.drive: DriveFolder | None = None

    def init(self, config: dict[str, Any]) -> bool:
        assert self.context is not None
        env = self.context.config.env
        self.settings = parse_settings(self.PLUGIN_NAME, DriveSettings, config,
                                       {"base_url": env.get("DRIVE_BASE_URL"), "ca_bundle": env.get("DRIVE_CA_BUNDLE")})
        folder_id = (env.get("FOLDER_ID") or "").strip()
        if not FILE_ID.match(folder_id):
            raise PluginConfigError("FOLDER_ID must be set in .env to the id of the Drive folder to work in "
                                    "(the last part of the folder's URL)")
        if self.settings.ca_bundle and not Path(self.settings.ca_bundle).is_file():
            raise PluginConfigError(f"ca_bundle {self.settings.ca_bundle} is not a file")
        creds = load_credentials(self.context.config.config_dir, self.settings.subject)
        options = {"api_endpoint": self.settings.base_url} if self.settings.base_url else None
        # Static discovery: the Drive v3 document ships with the library, so building makes no request.
        service = build("drive", "v3", credentials=creds, client_options=options, static_discovery=True,
                        cache_discovery=False)
        self.drive = DriveFolder(service, creds, self.settings, folder_id)
        return True

    def shutdown(self) -> None:
        if self.drive is not None:
            self.drive.service.close()
        self.drive = None

    def get_tools(self) -> dict[str, Any]:
        async def google_drive(operation: str, file_id: str = "", file_name: str = "", content: str = "",
                               folder_id: str = "") -> str:
            assert self.drive is not None
            try:
                return await asyncio.to_thread(self.drive.run, operation, file_id, file_name, content, folder_id)
            except Exception as exc:
                text = f"Drive error ({operation}): {describe_error(exc, self.settings)}"
                # Log the text, not the exception: a kept record would keep its traceback and sockets alive.
                logger.log(logging.INFO if isinstance(exc, EXPECTED_ERRORS) else logging.WARNING, "%s", text)
                return text

        return {"lc": [StructuredTool.from_function(
            coroutine=google_drive, name=TOOL, args_schema=_DriveArgs,
            description="Work with files in the shared Google Drive folder: list, read, create, append, update, "
                        "delete (to the trash).",
        )]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {TOOL: {"type": "drive", "operation": drive_operation}}
