"""A preprocessing sidecar's inference through Triton's system shared memory, run inside the serving
pod's sidecar container (`podman exec -i SIDECAR python - REQUEST < this file`): only the standard
library and NumPy, as the sidecar's image has them, over the pod's loopback and its /dev/shm.

REQUEST is JSON: {"server": URL, "model": NAME, "version": V, "inputs": {name: [shape, base64 FP32]},
"outputs": {name: element count}}. Prints one JSON line: each output as read back from shared
memory, the answer's outputs as the server sent them, and the region status it reported.
"""
from __future__ import annotations

import base64
import json
import sys
import urllib.request
from multiprocessing import shared_memory
from typing import Any

import numpy as np


def call(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read()
    return json.loads(text) if text else None


def main(request: dict[str, Any]) -> dict[str, Any]:
    server, model = request["server"], request["model"]
    sizes = {n: int(np.prod(shape)) * 4 for n, (shape, _) in request["inputs"].items()}
    out_sizes = {n: int(count) * 4 for n, count in request["outputs"].items()}
    memory = shared_memory.SharedMemory(name="kubetrt-sidecar", create=True, size=sum(sizes.values()) + sum(out_sizes.values()))
    try:
        regions, offset = {}, 0
        for kind, sized in (("in", sizes), ("out", out_sizes)):
            for name, size in sized.items():
                region = f"{kind}-{name}"
                call(f"{server}/v2/systemsharedmemory/region/{region}/register",
                     {"key": "/" + memory.name, "offset": offset, "byte_size": size})
                regions[name] = (region, offset, size)
                offset += size
        for name, (shape, data) in request["inputs"].items():
            _, at, size = regions[name]
            memory.buf[at:at + size] = base64.b64decode(data)
        status = call(f"{server}/v2/systemsharedmemory/status")
        shm = lambda name: {"shared_memory_region": regions[name][0], "shared_memory_byte_size": regions[name][2]}
        answer = call(f"{server}/v2/models/{model}/versions/{request['version']}/infer", {
            "inputs": [{"name": n, "shape": shape, "datatype": "FP32", "parameters": shm(n)}
                       for n, (shape, _) in request["inputs"].items()],
            "outputs": [{"name": n, "parameters": shm(n)} for n in request["outputs"]]})
        read = {n: np.frombuffer(memory.buf[regions[n][1]:regions[n][1] + regions[n][2]], np.float32).tolist()
                for n in request["outputs"]}
        call(f"{server}/v2/systemsharedmemory/unregister", {})
        return {"read": read, "answer": answer["outputs"], "status": status}
    finally:
        memory.close()
        memory.unlink()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
