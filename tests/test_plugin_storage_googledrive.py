"""google_drive through the real google-api-python-client (httplib2, TLS) against the local Drive fake."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.conftest import free_port
from tests.fakes.drive import ACCESS_TOKEN, FOLDER, GOOGLE_DOC, FakeDrive, drive_error
from tests.fakes.tls import make_localhost_tls
from tests.plugin_host import call_tool, isolate_env, plugin_runtime, report

NAME = "plugin_storage_googledrive"
USER_TOKEN = {"type": "authorized_user", "client_id": "cid.apps.googleusercontent.com", "client_secret": "cs",
              "refresh_token": "1//refresh", "token": "test-token", "expiry": "2999-01-01T00:00:00Z"}


@pytest.fixture
def drive(tmp_path, monkeypatch):
    isolate_env(monkeypatch)
    (tmp_path / "tls").mkdir()
    with FakeDrive(make_localhost_tls(tmp_path / "tls")) as fake:
        fake.add("Shared", parent="", mime=FOLDER, file_id="FOLDER1")
        fake.add("Projects", parent="FOLDER1", mime=FOLDER, file_id="SUB1")
        fake.add("Archive", parent="SUB1", mime=FOLDER, file_id="SUB2")
        fake.add("notes.txt", "line one", parent="FOLDER1", file_id="NOTES")
        fake.add("Plan", "Doc text", parent="FOLDER1", mime=GOOGLE_DOC, file_id="DOC1")
        fake.add("logo.png", b"\x89PNG\r\n\x1a\n\xff\xfe", parent="FOLDER1", mime="image/png", file_id="PNG")
        fake.add("deep.md", "# deep", parent="SUB2", mime="text/markdown", file_id="DEEP")
        fake.add("Other", parent="", mime=FOLDER, file_id="OTHER")
        fake.add("secret.txt", "top secret", parent="OTHER", file_id="SECRET")
        fake.add("orphan.txt", "no parent", parent="GONE", file_id="ORPHAN")
        yield fake


@asynccontextmanager
async def drive_runtime(tmp_path: Path, fake: FakeDrive, credentials: Any = USER_TOKEN, **settings: Any):
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    if credentials is not None:
        (cfg / "credentials.json").write_text(json.dumps(credentials))
    conf = {"base_url": fake.endpoint, "ca_bundle": str(fake.tls.ca), "num_retries": 0, **settings}
    async with plugin_runtime(cfg, {NAME: conf}, {"FOLDER_ID": "FOLDER1"}) as rt:
        yield rt


async def drive_op(rt, operation: str, **args: Any) -> str:
    return await call_tool(rt, "google_drive", operation=operation, **args)


def content_requests(fake: FakeDrive) -> list[str]:
    """Requests that read or change a file's content or metadata (everything except metadata GETs)."""
    return [
        f"{c.method} {c.path}"
        for c in fake.calls
        if c.method != "GET" or c.query.get("alt") == "media" or "export" in c.path
    ]


async def test_list_shows_folders_first_then_files_with_details(tmp_path, drive):
    async with drive_runtime(tmp_path, drive) as rt:
        top = await drive_op(rt, "list")
        sub = await drive_op(rt, "list", folder_id="SUB1")
        drive.files["DEEP"].trashed = True
        empty = await drive_op(rt, "list", folder_id="SUB2")
    lines = top.splitlines()
    assert lines[0] == "Contents of folder FOLDER1:"
    assert lines[1] == "  [DIR]  Projects  (id: SUB1)"
    assert any(line.startswith("  [FILE] notes.txt  (id: NOTES, text/plain, 8 bytes, modified 20") for line in lines)
    assert "  [FILE] Plan  (id: DOC1, application/vnd.google-apps.document, modified" in top
    assert "secret" not in top and "orphan" not in top
    assert sub == "Contents of folder SUB1:\n  [DIR]  Archive  (id: SUB2)"
    assert empty == "(Folder SUB2 is empty)"
    q = drive.calls[0].query
    assert q["q"] == "'FOLDER1' in parents and trashed = false" and q["supportsAllDrives"] == "true"
    assert drive.calls[0].headers["authorization"] == "Bearer test-token"


async def test_list_follows_pages_up_to_max_list(tmp_path, drive):
    for i in range(130):
        drive.add(f"bulk-{i:03}.txt", "x", parent="SUB2")
    async with drive_runtime(tmp_path, drive, max_list=120) as rt:
        out = await drive_op(rt, "list", folder_id="SUB2")
    lines = out.splitlines()
    assert [c.query.get("pageToken") for c in drive.calls if c.path == "/drive/v3/files"] == [None, "100"]
    assert len([line for line in lines if "[FILE]" in line]) == 120
    assert lines[-1] == "  … more items not shown (first 120 listed)"


async def test_read_by_id_by_name_docs_and_nested_files(tmp_path, drive):
    async with drive_runtime(tmp_path, drive) as rt:
        by_id = await drive_op(rt, "read", file_id="NOTES")
        by_name = await drive_op(rt, "read", file_name="notes.txt")
        doc = await drive_op(rt, "read", file_id="DOC1")
        deep = await drive_op(rt, "read", file_id="DEEP")
        binary = await drive_op(rt, "read", file_id="PNG")
        folder = await drive_op(rt, "read", file_id="SUB1")
        missing = await drive_op(rt, "read", file_name="nope.txt")
    assert by_id == by_name == "'notes.txt' (id: NOTES):\nline one"
    assert doc == "'Plan' (id: DOC1):\nDoc text"
    assert any(c.path == "/drive/v3/files/DOC1/export" and c.query["mimeType"] == "text/plain" for c in drive.calls)
    assert deep == "'deep.md' (id: DEEP):\n# deep"  # two folders below FOLDER_ID
    assert binary == "Drive error (read): 'logo.png' (id: PNG) is a binary file (image/png); it cannot be shown as text"
    assert folder.startswith("Drive error (read): 'Projects' (id: SUB1) is a folder; use list with folder_id=SUB1")
    assert missing == "Drive error (read): no file named 'nope.txt' in the shared folder; use list to see the names"


async def test_read_truncates_long_files(tmp_path, drive):
    drive.add("big.txt", "y" * 1500, parent="FOLDER1", file_id="BIG")
    async with drive_runtime(tmp_path, drive, max_read_chars=1000) as rt:
        out = await drive_op(rt, "read", file_id="BIG")
    assert out == "'big.txt' (id: BIG):\n" + "y" * 1000 + "\n…(truncated: 500 more characters not shown)"


async def test_create_append_update_and_rename(tmp_path, drive):
    async with drive_runtime(tmp_path, drive) as rt:
        created = await drive_op(rt, "create", file_name="todo.md", content="- buy milk")
        fid = created.rsplit(" ", 1)[-1]
        nested = await drive_op(rt, "create", file_name="q3.csv", content="a,b\n1,2\n", folder_id="SUB2")
        appended = await drive_op(rt, "append", file_id=fid, content="- call Bob")
        appended_by_name = await drive_op(rt, "append", file_name="todo.md", content="- pay rent\n")
        updated = await drive_op(rt, "update", file_id="NOTES", content="brand new text")
        renamed = await drive_op(rt, "update", file_id="NOTES", file_name="notes-2026.txt")
        nothing = await drive_op(rt, "update", file_id="NOTES")
        empty_append = await drive_op(rt, "append", file_id="NOTES")
    assert created == f"Created 'todo.md' — id: {fid}"
    new = drive.files[fid]
    assert (new.parents, new.mimeType) == (["FOLDER1"], "text/markdown")
    assert new.content == b"- buy milk\n- call Bob\n- pay rent\n"
    assert appended == f"Appended 10 characters to 'todo.md' (id: {fid}); it now has 21 characters"
    assert appended_by_name.startswith("Appended 11 characters to 'todo.md'")
    nested_file = drive.files[nested.rsplit(" ", 1)[-1]]
    assert (nested_file.parents, nested_file.mimeType, nested_file.content) == (["SUB2"], "text/csv", b"a,b\n1,2\n")
    assert updated == "Updated 'notes.txt' (id: NOTES): replaced its text (14 characters)"
    assert renamed == "Updated 'notes.txt' (id: NOTES): renamed it to 'notes-2026.txt'"
    assert (drive.files["NOTES"].name, drive.files["NOTES"].content) == ("notes-2026.txt", b"brand new text")
    assert nothing.startswith("Drive error (update): update needs content (the new full text) or")
    assert empty_append == "Drive error (append): append needs content"
    uploads = [c for c in drive.calls if c.path.startswith("/upload/")]
    assert uploads and all(c.query["uploadType"] == "multipart" for c in uploads)


async def test_google_docs_are_read_only_here(tmp_path, drive):
    async with drive_runtime(tmp_path, drive) as rt:
        out = await drive_op(rt, "append", file_id="DOC1", content="more")
    assert out.startswith("Drive error (append): 'Plan' (id: DOC1) is a Google Docs Editors file or folder")
    assert drive.files["DOC1"].content == b"Doc text"


async def test_delete_moves_to_trash_by_default(tmp_path, drive):
    async with drive_runtime(tmp_path, drive) as rt:
        out = await drive_op(rt, "delete", file_id="NOTES")
        again = await drive_op(rt, "read", file_id="NOTES")
        gate = rt.tools.entry("google_drive").gate
    assert out == "Moved 'notes.txt' (id: NOTES) to the Drive trash (it can be restored from there)"
    assert drive.files["NOTES"].trashed is True
    assert [c.method for c in drive.calls if c.path == "/drive/v3/files/NOTES" and c.method != "GET"] == ["PATCH"]
    assert again.startswith("Drive error (read): 'notes.txt' (id: NOTES) is in the trash")
    assert gate["type"] == "drive"
    assert {op: gate["operation"]({"operation": op}) for op in ("list", "read", "create", "append", "update",
                                                                 "delete")} == {
        "list": "read", "read": "read", "create": "write", "append": "write", "update": "write", "delete": "write"}


async def test_permanent_delete_when_configured(tmp_path, drive):
    async with drive_runtime(tmp_path, drive, delete_mode="permanent") as rt:
        out = await drive_op(rt, "delete", file_name="notes.txt")
    assert out == "Deleted 'notes.txt' (id: NOTES) permanently" and "NOTES" not in drive.files
    assert any(c.method == "DELETE" and c.path == "/drive/v3/files/NOTES" for c in drive.calls)


@pytest.mark.parametrize("operation", ["read", "append", "update", "delete"])
async def test_files_outside_the_folder_are_refused(tmp_path, drive, operation):
    async with drive_runtime(tmp_path, drive) as rt:
        outside = await drive_op(rt, operation, file_id="SECRET", content="x")
        orphan = await drive_op(rt, operation, file_id="ORPHAN", content="x")
        folder_itself = await drive_op(rt, operation, file_id="FOLDER1", content="x")
    assert outside == (f"Drive error ({operation}): refused: 'secret.txt' (id: SECRET) is outside the shared "
                       "folder FOLDER1; only files inside it can be used")
    assert orphan.startswith(f"Drive error ({operation}): refused: 'orphan.txt' (id: ORPHAN) is outside")
    assert folder_itself.startswith(f"Drive error ({operation}): that id is the shared folder itself")
    assert content_requests(drive) == []  # only metadata was looked at
    assert drive.files["SECRET"].content == b"top secret" and not drive.files["SECRET"].trashed


async def test_folders_outside_are_refused_for_list_and_create(tmp_path, drive):
    async with drive_runtime(tmp_path, drive) as rt:
        listed = await drive_op(rt, "list", folder_id="OTHER")
        created = await drive_op(rt, "create", folder_id="OTHER", file_name="x.txt", content="x")
        into_file = await drive_op(rt, "create", folder_id="NOTES", file_name="x.txt", content="x")
        bad_id = await drive_op(rt, "read", file_id="../../files?q=x")
    assert listed.startswith("Drive error (list): refused: 'Other' (id: OTHER) is outside the shared folder")
    assert created.startswith("Drive error (create): refused: 'Other' (id: OTHER) is outside")
    assert into_file == "Drive error (create): 'notes.txt' (id: NOTES) is a file, not a folder"
    assert bad_id == "Drive error (read): '../../files?q=x' is not a Drive file id; use list to see the ids"
    assert content_requests(drive) == [] and len(drive.files) == 10


async def test_drive_errors_are_explained(tmp_path, drive):
    drive.add("notes.txt", "dup", parent="FOLDER1", file_id="DUP")
    async with drive_runtime(tmp_path, drive) as rt:
        unknown = await drive_op(rt, "read", file_id="NOSUCHFILE")
        several = await drive_op(rt, "read", file_name="notes.txt")
        drive.quota_exceeded = True
        quota = await drive_op(rt, "create", file_name="a.txt", content="a")
        drive.fail_next(500, drive_error(500, "backendError", "Internal Error"))
        server = await drive_op(rt, "list")
        drive.fail_next(403, drive_error(403, "insufficientFilePermissions",
                                         "The user does not have sufficient permissions for this file."))
        forbidden = await drive_op(rt, "list")
        no_name = await drive_op(rt, "create", content="a")
    assert unknown == "Drive error (read): no file with id NOSUCHFILE (or this account cannot see it); use list"
    assert several == "Drive error (read): several files are named 'notes.txt' (ids: NOTES, DUP); pass file_id"
    assert quota.startswith("Drive error (create): Drive refused to store the file: service accounts have no storage "
                            "quota. Use a folder on a shared drive")
    assert server == "Drive error (list): Drive answered HTTP 500: backendError: Internal Error; try again later"
    assert forbidden.startswith("Drive error (list): Drive refused (HTTP 403: insufficientFilePermissions: The user")
    assert no_name == "Drive error (create): create needs file_name"


@pytest.fixture
def service_account(drive) -> dict[str, str]:
    """A service-account key whose token endpoint is the fake's `/token`."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    return {"type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": pem,
            "client_email": "agent@p.iam.gserviceaccount.com", "client_id": "1", "token_uri": f"{drive.url}/token"}


async def test_service_account_credentials_get_a_token_from_the_token_endpoint(tmp_path, drive, service_account):
    async with drive_runtime(tmp_path, drive, credentials=service_account) as rt:
        first = await drive_op(rt, "read", file_id="NOTES")
        second = await drive_op(rt, "list")
    assert first.endswith("line one") and second.startswith("Contents of folder FOLDER1:")
    assert len(drive.token_requests) == 1  # the token is kept between calls
    assert drive.token_requests[0]["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
    assert {c.headers["authorization"] for c in drive.calls} == {f"Bearer {ACCESS_TOKEN}"}


async def test_rejected_credentials(tmp_path, drive, service_account):
    drive.tokens = {"another-token"}  # Drive refuses the access token even after a refresh
    async with drive_runtime(tmp_path, drive, credentials=service_account) as rt:
        rejected = await drive_op(rt, "list")
    assert rejected.startswith("Drive error (list): Drive rejected the credentials (HTTP 401: Request had invalid")
    drive.refuse_grants = True  # the service account was deleted: no new access token
    async with drive_runtime(tmp_path, drive, credentials=service_account) as rt:
        no_token = await drive_op(rt, "list")
    assert no_token.startswith("Drive error (list): cannot get a Drive access token (('invalid_grant: Invalid JWT")
    assert no_token.endswith("the credentials are revoked or expired: renew them")


async def test_unreachable_endpoint_and_untrusted_certificate(tmp_path, drive):
    closed = f"https://127.0.0.1:{free_port()}/drive/v3/"
    async with drive_runtime(tmp_path, drive, base_url=closed) as rt:
        unreachable = await drive_op(rt, "list")
    assert unreachable.startswith(f"Drive error (list): cannot reach Drive at {closed} (ConnectionRefusedError")
    async with drive_runtime(tmp_path, drive, ca_bundle=None) as rt:  # the system CAs do not know the fake
        untrusted = await drive_op(rt, "list")
    assert untrusted.startswith(f"Drive error (list): cannot reach Drive at {drive.endpoint} (SSLCertVerificationError")


async def test_credential_problems_stop_the_plugin_with_a_reason(tmp_path, drive):
    client_file = {"installed": {"client_id": "cid", "client_secret": "cs", "redirect_uris": ["http://localhost"]}}
    async with drive_runtime(tmp_path, drive, credentials=client_file) as rt:
        no_token = report(rt, NAME)
    assert no_token.status == "failed" and "is an OAuth client file" in no_token.reasons[0]
    assert "token.json" in no_token.reasons[0]
    # token.json as google-auth's Credentials.to_json() writes it: no "type" field
    (tmp_path / "cfg" / "token.json").write_text(json.dumps({k: v for k, v in USER_TOKEN.items() if k != "type"}))
    async with drive_runtime(tmp_path, drive, credentials=client_file) as rt:  # token.json next to it is used
        assert (await drive_op(rt, "read", file_id="NOTES")).endswith("line one")
    async with drive_runtime(tmp_path, drive, credentials={"type": "external_account"}) as rt:
        wrong = report(rt, NAME)
    assert wrong.status == "failed" and "\"type\" is 'external_account'" in wrong.reasons[0]
    (tmp_path / "cfg" / "credentials.json").unlink()
    async with drive_runtime(tmp_path, drive, credentials=None) as rt:
        missing = report(rt, NAME)
    assert missing.status == "invalid" and "config file credentials.json not found" in missing.reasons[0]
