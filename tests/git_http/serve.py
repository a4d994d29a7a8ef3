#!/usr/bin/env python3
"""Git's smart HTTPS for tests/git_source.rs: Debian's `git http-backend` (CGI) behind a
small HTTP/1.1 server with TLS on 127.0.0.1 that lets a request through only with HTTP Basic
credentials whose password equals the token in TOKEN_FILE (read at each request, so the
test can rotate it). Without them the answer is 401 with a Basic challenge, which is
what makes a git client ask its credential helper (the operator's `--git-token-file`).

TLS because gitoxide will not send credentials over plain http; the certificate is the
test's own, which the operator trusts through SSL_CERT_FILE.

Usage: serve.py PORT PROJECT_ROOT TOKEN_FILE CERT_PEM KEY_PEM
It prints "listening" once the socket is bound. Each request is one CGI run of
`git http-backend` (GIT_PROJECT_ROOT, GIT_HTTP_EXPORT_ALL); request bodies may be
chunked (gitoxide streams upload-pack requests); the answer is sent with a length.
"""

import base64
import http.server
import os
import ssl
import subprocess
import sys


def read_body(handler):
    """The request body, de-chunked when Transfer-Encoding is chunked."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                # trailers, up to the empty line
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += handler.rfile.read(size)
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    backend = ""
    root = ""
    token_file = ""

    def authorized(self):
        header = self.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return False
        try:
            _, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return False
        with open(self.token_file, encoding="utf-8") as f:
            return password == f.read().strip()

    def send(self, status, headers, body):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def cgi(self):
        body = read_body(self)
        if not self.authorized():
            self.send(401, [("WWW-Authenticate", 'Basic realm="rules"')], b"token required\n")
            return
        path, _, query = self.path.partition("?")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": self.root,
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_USER": "operator",
            "REMOTE_ADDR": "127.0.0.1",
        }
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        out = subprocess.run([self.backend], input=body, env=env, capture_output=True, check=False).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.partition(b"\n\n")
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send(status, headers, payload)

    do_GET = cgi
    do_POST = cgi

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        sys.stderr.write("%s %s\n" % (self.requestline, args[1] if len(args) > 1 else ""))


def main():
    port, root, token_file, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    exec_path = subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True).stdout.strip()
    Handler.backend = os.path.join(exec_path, "git-http-backend")
    Handler.root = root
    Handler.token_file = token_file
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
