"""A stand-in Hugging Face Hub for tests: the HTTP routes ``huggingface_hub`` calls to
resolve and download model repos, served from local directories.

Routes: ``GET /api/models/{repo}/revision/{rev}`` (repo info), ``GET
/api/models/{repo}/tree/{rev}`` (file listing), ``HEAD``/``GET
/{repo}/resolve/{rev}/{file}`` with ``ETag``/``X-Repo-Commit``/``Content-Length`` and
``Range`` support. Errors carry the ``X-Error-Code`` headers the Hub sends (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo). Every request is recorded (``requests``), and
``drop_after[filename] = n`` makes the next GET of that file send n bytes of the body and
close the connection (a dropped download); a name in ``corrupt`` is served with one byte
changed (same size and ETag).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors",)


@dataclass
class Repo:
    files: Dict[str, bytes]
    commit: str
    gated: bool = False

    def etag(self, name: str) -> str:
        data = self.files[name]
        if name.endswith(LFS_SUFFIXES):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob id


@dataclass
class Request:
    method: str
    path: str
    range: Optional[str]
    authorization: Optional[str] = None
    bytes_sent: int = 0


@dataclass
class StandInHub:
    repos: Dict[str, Repo] = field(default_factory=dict)
    requests: List[Request] = field(default_factory=list)
    drop_after: Dict[str, int] = field(default_factory=dict)
    corrupt: Set[str] = field(default_factory=set)
    url: str = ""

    def add_repo(self, repo_id: str, directory: Path, gated: bool = False,
                 files: Optional[Set[str]] = None) -> Repo:
        """Serve the files of ``directory`` (recursively) as ``repo_id`` at branch main."""
        directory = Path(directory)
        data = {str(p.relative_to(directory)): p.read_bytes()
                for p in sorted(directory.rglob("*")) if p.is_file()}
        if files is not None:
            data = {k: v for k, v in data.items() if k in files}
        commit = hashlib.sha1(repo_id.encode() + b"".join(sorted(data.values()))).hexdigest()
        self.repos[repo_id] = Repo(data, commit, gated)
        return self.repos[repo_id]

    def downloads(self, repo_id: Optional[str] = None) -> List[str]:
        """Files fetched with GET (resolve route), in order."""
        out = []
        for r in self.requests:
            m = _RESOLVE.match(r.path)
            if r.method == "GET" and m and (repo_id is None or m.group(1) == repo_id):
                out.append(m.group(3))
        return out

    def bytes_served(self) -> int:
        return sum(r.bytes_sent for r in self.requests)


_API = re.compile(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/?]+)(?:/.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: StandInHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _error(self, status: int, code: str, message: str = ""):
            body = json.dumps({"error": message or code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message or code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload) -> int:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return len(body)

        def _repo(self, repo_id: str, revision: str) -> Optional[Repo]:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            elif repo.gated and "authorization" not in {k.lower() for k in self.headers}:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
            elif revision not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            else:
                return repo
            return None

        def _record(self) -> Request:
            r = Request(self.command, urlparse(self.path).path, self.headers.get("Range"),
                        self.headers.get("Authorization"))
            hub.requests.append(r)
            return r

        def do_HEAD(self):
            self._serve(self._record(), body=False)

        def do_GET(self):
            record = self._record()
            m = _API.match(record.path)
            if m:
                repo_id, kind, revision = m.group(1), m.group(2), unquote(m.group(3))
                repo = self._repo(repo_id, revision)
                if repo is not None:
                    record.bytes_sent = self._json(self._api(repo_id, repo, kind))
                return
            self._serve(record, body=True)

        def _api(self, repo_id: str, repo: Repo, kind: str):
            if kind == "revision":
                return {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                        "gated": repo.gated, "siblings": [{"rfilename": f} for f in repo.files]}
            out = []
            for name, data in repo.files.items():
                entry = {"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest()}
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": repo.etag(name), "size": len(data), "pointerSize": 134}
                out.append(entry)
            return out

        def _serve(self, record: Request, body: bool):
            m = _RESOLVE.match(record.path)
            if not m:
                return self._error(404, "NotFound")
            repo_id, revision, name = m.group(1), unquote(m.group(2)), unquote(m.group(3))
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            if name not in repo.files:
                return self._error(404, "EntryNotFound", f"{name} does not exist")
            data = repo.files[name]
            start, status = _range_start(record.range, len(data))
            self.send_response(status)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            payload = data[start:]
            if name in hub.corrupt and payload:  # damaged in transit: same size, ETag
                payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
            cut = hub.drop_after.pop(name, None)
            if cut is not None:  # a dropped connection half-way through the body
                self.wfile.write(payload[:cut])
                self.wfile.flush()
                record.bytes_sent = cut
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(payload)
            record.bytes_sent = len(payload)

    return Handler


def _range_start(header: Optional[str], size: int) -> Tuple[int, int]:
    m = re.match(r"bytes=(\d+)-$", header or "")
    if m and int(m.group(1)) < size:
        return int(m.group(1)), 206
    return 0, 200


def start(hub: StandInHub) -> Tuple[ThreadingHTTPServer, threading.Thread]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
