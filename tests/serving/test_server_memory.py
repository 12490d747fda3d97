"""`serve()` tunes the allocator whatever the model's device: a server whose app never loads the
host runtime (a GPU model's) still answers megabyte bodies without a page fault per page."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

ECHO_SERVER = textwrap.dedent("""
    import sys
    from kubetrt.serving.server import serve, uvicorn_config

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        answer = str(len(b"".join(chunks))).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    sys.exit(serve(uvicorn_config(app, "127.0.0.1", int(sys.argv[1]))))
""")
BODY = os.urandom(2 << 20)
REQUESTS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minor_faults(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[7])  # minflt, the 10th field


def faults_per_request(tuning: str) -> float:
    port = free_port()
    env = dict(os.environ, KUBETRT_MALLOC_TUNING=tuning)
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, str(port)], env=env)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 30
        with httpx.Client() as client:
            while True:
                try:
                    client.get(url)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None, "the echo server did not start"
                    time.sleep(0.05)
            for _ in range(5):  # the heap grows to its working set first
                client.post(url, content=BODY)
            before = minor_faults(proc.pid)
            for _ in range(REQUESTS):
                assert client.post(url, content=BODY).text == str(len(BODY))
            return (minor_faults(proc.pid) - before) / REQUESTS
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_keeps_freed_memory_for_the_next_request_without_the_host_runtime():
    pages = len(BODY) // 4096
    tuned, untuned = faults_per_request("1"), faults_per_request("0")
    assert tuned < pages / 10, f"{tuned:.0f} page faults a request with the allocator tuned"
    assert untuned > pages, f"{untuned:.0f} page faults a request untuned: the test would not see the tuning"
