"""A Hugging Face Hub on 127.0.0.1 for the tests of `candlewick.hub` (issue 38): it answers the
requests huggingface_hub makes, as the Hub answers them, so no test reaches the network.

Written by hand, with the standard library's `http.server`: no package serves the Hub's API
for tests, and what huggingface_hub needs is small. What it reads (huggingface_hub's
`hf_api.py`, `file_download.py`, `_snapshot_download.py`, `utils/_http.py`):

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: the model's `sha` (the commit)
  and `siblings` (its files), `gated`, `private` (`HfApi.model_info`, `repo_info`);
- `GET /api/models/{repo}/tree/{rev}`: the files with size, git blob id and LFS sha256
  (`list_repo_tree`, which `snapshot_download` calls in huggingface_hub 1.x and later);
- `HEAD` and `GET /{repo}/resolve/{rev}/{path}`: the file, with `X-Repo-Commit`, `ETag` and
  `Content-Length` (what `hf_hub_download` checks), and `Range` for resuming;
- errors as the Hub reports them, in the `X-Error-Code` header huggingface_hub maps to its
  exceptions: `RepoNotFound` (401 without a token, as the Hub hides private repositories;
  404 with one), `RevisionNotFound`, `EntryNotFound`, `GatedRepo` (401 without a token, 403
  with one that has no access).

Files are served from memory and never redirected to a CDN (the Hub redirects large files;
huggingface_hub follows either way). No Xet headers are sent, so downloads take the plain
HTTP path.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Union
from urllib.parse import unquote, urlsplit

# The token that opens gated and private repositories.
TOKEN = "hf_fake_token_with_access"
# Files the Hub stores in LFS (their ETag is the content's sha256, not the git blob id).
_LFS = (".gguf", ".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".onnx")


def _commit(repo_id: str, revision: str, files: dict[str, bytes]) -> str:
    h = hashlib.sha1(f"{repo_id}@{revision}".encode())
    for name in sorted(files):
        h.update(name.encode() + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """One model repository: files per commit, the branches and tags that name commits."""

    repo_id: str
    gated: bool = False
    private: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def commit_of(self, revision: str) -> Optional[str]:
        """The commit a branch, tag or commit id names, None when the repository has none."""
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


@dataclass
class Cut:
    """A file whose downloads the server cuts off: the first GET sends `after` bytes of its
    body and closes the connection; while `outage` holds, every later GET of it (the client's
    attempts to resume) is closed after its headers. `times` GETs are cut, then it heals."""

    after: int
    outage: bool = True
    times: int = 1_000_000
    seen: int = 0


class FakeHub:
    """The server: `add` repositories, `start`, point `HF_ENDPOINT` at `url`; `requests`
    records every request as `(method, path, headers)`, the header names in lower case."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.cuts: dict[tuple[str, str], Cut] = {}
        #: When set, every request is answered with this status (a Hub that is down: 503).
        self.down: Optional[int] = None
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None

    def add(self, repo_id: str, files: dict[str, Union[bytes, Path]], revision: str = "main",
            gated: bool = False, private: bool = False) -> str:
        """Adds (or, for another `revision`, extends) a repository; returns the commit id."""
        data = {name: (v.read_bytes() if isinstance(v, Path) else v) for name, v in files.items()}
        repo = self.repos.setdefault(repo_id, Repo(repo_id, gated=gated, private=private))
        sha = _commit(repo_id, revision, data)
        repo.commits[sha] = data
        repo.refs[revision] = sha
        return sha

    def cut_off(self, repo_id: str, path: str, after: int, outage: bool = True, times: int = 1_000_000) -> None:
        """Cuts the downloads of `path` (see `Cut`)."""
        self.cuts[repo_id, path] = Cut(after, outage, times)

    def heal(self) -> None:
        """Ends every cut and outage."""
        self.cuts.clear()
        self.down = None

    def paths(self, method: Optional[str] = None) -> list[str]:
        """The paths requested so far (of `method` only, when given)."""
        with self._lock:
            return [p for m, p, _ in self.requests if method is None or m == method]

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-hub").start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the tests read `FakeHub.requests` instead

    # --- answers ---

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", length: Optional[int] = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, value: object) -> None:
        self._send(200, {"Content-Type": "application/json"}, json.dumps(value).encode())

    def _error(self, status: int, code: Optional[str], message: str, commit: Optional[str] = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _token(self) -> Optional[str]:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.lower().startswith("bearer ") else None

    def _repo(self, repo_id: str) -> Optional[Repo]:
        """The repository if this request may see it, else the Hub's answer for a missing one."""
        repo = self.server_hub.repos.get(repo_id)
        token = self._token()
        if repo is None or (repo.private and token != TOKEN):
            # The Hub answers 401 to a request without a token, so as not to tell a private
            # repository from a missing one.
            self._error(404 if token else 401, "RepoNotFound", "Repository not found")
            return None
        return repo

    # --- routes ---

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self._route()

    def do_GET(self) -> None:  # noqa: N802
        self._route()

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.server_hub._lock:
            self.server_hub.requests.append((self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if self.server_hub.down is not None:
            return self._error(self.server_hub.down, None, "Service Unavailable")
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$", path)
        if m:
            return self._api(m.group(1), m.group(2), m.group(3) or "main")
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3))
        self._error(404, None, f"no route {path}")

    def _api(self, repo_id: str, kind: Optional[str], revision: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.commit_of(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[commit]
        if kind == "tree":
            return self._json([
                {"type": "file", "oid": _git_blob(data), "size": len(data), "path": name,
                 **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                    if name.endswith(_LFS) else {})}
                for name, data in sorted(files.items())])
        self._json({
            "_id": commit[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": commit,
            "lastModified": "2025-01-01T00:00:00.000Z", "createdAt": "2025-01-01T00:00:00.000Z",
            "private": repo.private, "gated": "manual" if repo.gated else False, "disabled": False,
            "downloads": 0, "likes": 0, "tags": [], "siblings": [{"rfilename": name} for name in sorted(files)],
        })

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.commit_of(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if repo.gated and self._token() != TOKEN:
            status = 403 if self._token() else 401
            return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                               "access to it and be authenticated to access it. Please log in.")
        data = repo.commits[commit].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found", commit)
        etag = hashlib.sha256(data).hexdigest() if name.endswith(_LFS) else _git_blob(data)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start = 0
        rng = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if rng:
            start = int(rng.group(1))
            end = int(rng.group(2)) if rng.group(2) else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            body, status = data[start:end + 1], 206
        else:
            body, status = data, 200
        cut = self.server_hub.cuts.get((repo_id, name))
        if self.command == "GET" and cut is not None and cut.seen < cut.times:
            cut.seen += 1
            sent = cut.after if cut.seen == 1 or not cut.outage else 0
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:sent])
            self.wfile.flush()
            # The connection drops mid-body: the client sees fewer bytes than Content-Length.
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self._send(status, headers, body)
