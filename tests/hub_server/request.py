"""One request to the loopback Hub, below its endpoint: who asks, the faults and the log, reading the body, sending
the answer, and the Hub's permission checks. The endpoints (admin_endpoints, read_endpoints, upload_endpoints)
build on Request; routes.Handler picks the endpoint for a URL (`_route`)."""

from __future__ import annotations

import json
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from .errors import HubError
from .faults import RequestRecord

if TYPE_CHECKING:
    from .server import HubServer

_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


class Request(BaseHTTPRequestHandler):
    """The plumbing of every endpoint: a request's user, query and path segments, its body, and its answer."""

    protocol_version = "HTTP/1.1"
    server_version = "LoopbackHub/1.0"
    hub: HubServer  # set on the subclass bound to a server

    # quiet
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    # entry points ---------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # plumbing -------------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        self._status = 0
        self._body_consumed = False
        self._user, self._bad_token = self._authenticate()
        raw_path, _, query = self.path.partition("?")
        self._query = urllib.parse.parse_qs(query, keep_blank_values=True)
        self._segments = [urllib.parse.unquote(s) for s in raw_path.split("/")[1:]]
        faulted = False
        generation = self.hub.log.begin()  # before any answer can reach the client (see faults.RequestLog)
        try:
            rule = self.hub.faults.take(method, self.path)
            if rule is not None:
                if rule.delay:
                    time.sleep(rule.delay)
                if rule.reset:
                    faulted = True
                    self._drain_body()
                    self._reset_connection()
                    return
                if rule.status is not None:
                    faulted = True
                    self._drain_body()
                    raise HubError(rule.status, rule.message)
            self._route(method)
        except HubError as e:
            self._drain_body()
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a server bug: answer 500 so the client does not hang
            import traceback

            traceback.print_exc()
            try:
                self._drain_body()
                self._send_error(HubError(500, f"Internal error in loopback Hub: {e!r}"))
            except Exception:
                self.close_connection = True
        finally:
            self.hub._record(RequestRecord(
                method=method, path=self.path, status=self._status, user=self._user,
                user_agent=self.headers.get("User-Agent", ""), client=tuple(self.client_address),
                faulted=faulted, client_pid=self._client_pid() if self.hub.identify_clients else None,
            ), generation)

    def _route(self, method: str) -> None:
        """Answer the request with its endpoint: routes.Handler."""
        raise NotImplementedError

    def _client_pid(self) -> int | None:
        """The pid of the process whose socket is this connection's other end (the same machine: loopback); found
        once per connection, while it is open."""
        if not hasattr(self, "_client_pid_found"):
            import psutil

            client = tuple(self.client_address)
            self._client_pid_found = next((c.pid for c in psutil.net_connections("tcp")
                                           if c.laddr and tuple(c.laddr) == client), None)
        return self._client_pid_found

    def _reset_connection(self) -> None:
        """Close the socket with SO_LINGER 0, so the kernel sends a TCP reset and no answer reaches the client."""
        import socket
        import struct

        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _authenticate(self) -> tuple[str | None, bool]:
        """(the token's user, whether a token was sent that is not valid)."""
        auth = self.headers.get("Authorization")
        if not auth:
            return None, False
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, True
        with self.hub.lock:
            user = self.hub.tokens.get(token.strip())
        return user, user is None

    def _base_url(self) -> str:
        host = self.headers.get("Host") or f"{self.hub.host}:{self.hub.port}"
        return f"http://{host}"

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self._base_url()}/{_URL_PREFIX[repo_type]}{repo_id}"

    # body reading ---------------------------------------------------------------------------------
    def _iter_body(self, chunk_size: int = 1 << 20):
        if self._body_consumed:
            return
        self._body_consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                remaining = size
                while remaining:
                    data = self.rfile.read(min(remaining, chunk_size))
                    if not data:
                        raise ConnectionResetError("client closed mid-chunk")
                    remaining -= len(data)
                    yield data
                self.rfile.readline()  # CRLF after each chunk
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                data = self.rfile.read(min(remaining, chunk_size))
                if not data:
                    raise ConnectionResetError("client closed mid-body")
                remaining -= len(data)
                yield data

    def _read_body(self) -> bytes:
        return b"".join(self._iter_body())

    def _drain_body(self) -> None:
        try:
            for _ in self._iter_body():
                pass
        except Exception:
            self.close_connection = True

    def _json_body(self) -> Any:
        body = self._read_body()
        ctype = self.headers.get("Content-Type", "")
        if "application/x-www-form-urlencoded" in ctype:
            return urllib.parse.parse_qs(body.decode(), keep_blank_values=True)
        if not body:
            return {}
        try:
            return json.loads(body)
        except ValueError:
            raise HubError(400, "Invalid JSON body")

    # responses ------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json; charset=utf-8", head_only: bool = False,
              content_length: int | None = None) -> None:
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.send_header("Access-Control-Expose-Headers", "X-Repo-Commit, X-Error-Code, X-Error-Message, ETag")
        for k, v in (headers or {}).items():
            if v is not None:
                self.send_header(k, str(v))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if body and not head_only:
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers, head_only=self.command == "HEAD")

    def _send_error(self, e: HubError) -> None:
        headers = dict(e.headers)
        if e.error_code:
            headers["X-Error-Code"] = e.error_code
        headers["X-Error-Message"] = e.message.replace("\n", " ")[:500]
        body = e.body if e.body is not None else {"error": e.message}
        self._send_json(e.status, body, headers=headers)

    # permission checks ----------------------------------------------------------------------------
    def _require_token(self) -> None:
        if self._bad_token:
            raise HubError(401, "Invalid credentials in Authorization header")
        if self._user is None:
            raise HubError(401, "You must be authenticated to access this endpoint (missing bearer token)")

    def _repo_for_read(self, repo_type: str, repo_id: str) -> dict:
        """The repo, or the same 401/404 + RepoNotFound answers the Hub gives."""
        if self._bad_token:
            raise HubError(401, "Invalid credentials in Authorization header")
        repo = self.hub.store.get(repo_type, repo_id)
        if repo is None or (repo["private"] and self._user is None):
            status = 401 if self._user is None else 404
            raise HubError(status, "Repository not found", "RepoNotFound")
        return repo

    def _repo_for_write(self, repo_type: str, repo_id: str) -> dict:
        self._require_token()
        return self._repo_for_read(repo_type, repo_id)
