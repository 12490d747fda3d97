"""`serve()` tunes the allocator whatever the model's device: a server whose app never loads the
host runtime (a GPU model's) still answers megabyte bodies without a page fault per page."""
from __future__ import annotations

import os
from pathlib import Path

import httpx

from serving_support import ServerProcess

HERE = Path(__file__).resolve().parent
BODY = os.urandom(2 << 20)
REQUESTS = 30


def minor_faults(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[7])  # minflt, the 10th field


def faults_per_request(tuning: str) -> float:
    server = ServerProcess([str(HERE / "echo_server_main.py"), tuning])
    try:
        with httpx.Client(base_url=server.url) as client:
            for _ in range(5):  # the heap grows to its working set first
                client.post("/", content=BODY)
            before = minor_faults(server.proc.pid)
            for _ in range(REQUESTS):
                assert client.post("/", content=BODY).text.split()[0] == str(len(BODY))
            return (minor_faults(server.proc.pid) - before) / REQUESTS
    finally:
        server.close()


def test_serve_keeps_freed_memory_for_the_next_request_without_the_host_runtime():
    pages = len(BODY) // 4096
    tuned, untuned = faults_per_request("1"), faults_per_request("0")
    assert tuned < pages / 10, f"{tuned:.0f} page faults a request with the allocator tuned"
    assert untuned > pages, f"{untuned:.0f} page faults a request untuned: the test would not see the tuning"
