"""Triton's system shared memory extension, driven by tritonclient (HTTP and gRPC) and its own
shared memory utilities against the live server: inputs read from registered regions, outputs
written into them, regions listed and dropped, bad regions refused with what was wrong, and the
extension off unless the server was started with it."""
from __future__ import annotations

import os
import uuid
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kubetrt.serving.app import create_app
from kubetrt.serving.registry import ServingConfig
from serving_support import MAX_BODY, LiveServer, cnn_input, two_inputs

CLIENTS = {"http": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def shm_server(cnn_package, two_package) -> Iterator[LiveServer]:
    config = ServingConfig(device="host", max_body_bytes=MAX_BODY, grpc_port=0, shared_memory=True)
    with LiveServer(create_app([cnn_package, two_package], config)) as s:
        yield s.wait_ready()


def _client(kind: str, server: LiveServer) -> Any:
    url = server.host if kind == "http" else f"127.0.0.1:{server.app.state.grpc_port}"
    return CLIENTS[kind].InferenceServerClient(url)


class Regions:
    """Shared memory objects made by tritonclient's utilities, destroyed (and unregistered) at the end."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def make(self, size: int) -> tuple[str, str, Any]:
        name = f"kt-{uuid.uuid4().hex[:12]}"
        key = f"/{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        self.handles.append(handle)
        return name, key, handle

    def close(self) -> None:
        for h in self.handles:
            shm.destroy_shared_memory_region(h)


@pytest.fixture
def regions() -> Iterator[Regions]:
    r = Regions()
    yield r
    r.close()


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_inputs_and_outputs_travel_in_shared_memory(kind, shm_server, cnn_model, regions):
    client = _client(kind, shm_server)
    mod = CLIENTS[kind]
    x = cnn_input(3, seed=11)
    want = cnn_model.predict({"image": x})["output_0"]
    # one object holds the input and, after it, the output, as two regions at their offsets
    out_bytes = want.nbytes
    name, key, handle = regions.make(x.nbytes + out_bytes)
    shm.set_shared_memory_region(handle, [x])
    client.register_system_shared_memory(f"{name}-in", key, x.nbytes)
    client.register_system_shared_memory(f"{name}-out", key, out_bytes, offset=x.nbytes)
    try:
        inp = mod.InferInput("image", list(x.shape), "FP32")
        inp.set_shared_memory(f"{name}-in", x.nbytes)
        out = mod.InferRequestedOutput("output_0")
        out.set_shared_memory(f"{name}-out", out_bytes)
        result = client.infer("small_cnn", [inp], outputs=[out])
        answered = result.get_output("output_0")
        params = answered["parameters"] if kind == "http" else {k: v for k, v in answered.parameters.items()}
        size = params["shared_memory_byte_size"] if kind == "http" else params["shared_memory_byte_size"].int64_param
        assert size == out_bytes
        got = shm.get_contents_as_numpy(handle, np.float32, list(want.shape), offset=x.nbytes)
        np.testing.assert_array_equal(got, want)

        # the server reads the region at each request: new contents, same request, new answer
        x2 = cnn_input(3, seed=12)
        shm.set_shared_memory_region(handle, [x2])
        client.infer("small_cnn", [inp], outputs=[out])
        got2 = shm.get_contents_as_numpy(handle, np.float32, list(want.shape), offset=x.nbytes)
        np.testing.assert_array_equal(got2, cnn_model.predict({"image": x2})["output_0"])
        assert not np.array_equal(got2, want)

        status = client.get_system_shared_memory_status()
        listed = status if kind == "http" else [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in status.regions.values()]
        mine = sorted((r["name"], r["key"], int(r["offset"]), int(r["byte_size"])) for r in listed
                      if r["name"].startswith(name))
        assert mine == [(f"{name}-in", key, 0, x.nbytes), (f"{name}-out", key, x.nbytes, out_bytes)]
    finally:
        client.unregister_system_shared_memory(f"{name}-in")
        client.unregister_system_shared_memory(f"{name}-out")
    listed = client.get_system_shared_memory_status()
    names = [r["name"] for r in listed] if kind == "http" else list(listed.regions)
    assert not [n for n in names if n.startswith(name)]


def test_grpc_raw_contents_go_to_the_inputs_not_in_shared_memory(shm_server, two_model, regions):
    """One input from a region, the other as raw contents: the raw buffer is the second input's."""
    client = _client("grpc", shm_server)
    feeds = two_inputs(2, seed=4)
    name, key, handle = regions.make(feeds["features"].nbytes)
    shm.set_shared_memory_region(handle, [feeds["features"]])
    client.register_system_shared_memory(name, key, feeds["features"].nbytes)
    try:
        a = grpcclient.InferInput("features", list(feeds["features"].shape), "FP32")
        a.set_shared_memory(name, feeds["features"].nbytes)
        b = grpcclient.InferInput("ids", list(feeds["ids"].shape), "INT32")
        b.set_data_from_numpy(feeds["ids"])
        result = client.infer("two_in_two_out", [a, b])
        for out, want in two_model.predict(feeds).items():
            np.testing.assert_array_equal(result.as_numpy(out), want)
    finally:
        client.unregister_system_shared_memory(name)


def _infer_body(region: str, byte_size: int, offset: int = 0, output: dict[str, Any] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"shared_memory_region": region, "shared_memory_byte_size": byte_size}
    if offset:
        params["shared_memory_offset"] = offset
    body: dict[str, Any] = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3],
                                        "parameters": params}]}
    if output is not None:
        body["outputs"] = [{"name": "output_0", "parameters": output}]
    return body


def test_bad_regions_are_refused_with_what_was_wrong(shm_server, regions, tmp_path):
    x = cnn_input(1)
    name, key, handle = regions.make(x.nbytes + 64)
    shm.set_shared_memory_region(handle, [x])
    with httpx.Client(base_url=shm_server.url, timeout=30) as c:
        def register(region: str, doc: Any) -> httpx.Response:
            return c.post(f"/v2/systemsharedmemory/region/{region}/register", json=doc)

        assert register(name, {"key": key, "offset": 0, "byte_size": x.nbytes + 64}).status_code == 200
        try:
            refused = {
                "already registered": register(name, {"key": key, "offset": 0, "byte_size": 8}),
                "no path": register("r2", {"key": "/../etc/passwd", "offset": 0, "byte_size": 8}),
                "cannot open": register("r3", {"key": f"/{name}-missing", "offset": 0, "byte_size": 8}),
                "runs past the end of": register("r4", {"key": key, "offset": 64, "byte_size": x.nbytes + 1}),
                "non-negative integers": register("r5", {"key": key, "offset": -1, "byte_size": 8}),
            }
            infer = "/v2/models/small_cnn/infer"
            refused.update({
                "no shared memory region 'nope'": c.post(infer, json=_infer_body("nope", x.nbytes)),
                f"needs {x.nbytes} bytes, its shared_memory_byte_size is 12": c.post(infer, json=_infer_body(name, 12)),
                f"region '{name}' ({x.nbytes + 64} bytes)": c.post(infer, json=_infer_body(name, x.nbytes, offset=128)),
                "do not fit": c.post(infer, json=_infer_body(name, x.nbytes, output={
                    "shared_memory_region": name, "shared_memory_byte_size": 8})),
                "expected one of the two": c.post(infer, json=_infer_body(name, x.nbytes, output={
                    "shared_memory_region": name, "shared_memory_byte_size": 40, "binary_data": True})),
                "also carries its data": c.post(infer, json={"inputs": [{
                    "name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3], "data": x.ravel().tolist(),
                    "parameters": {"shared_memory_region": name, "shared_memory_byte_size": x.nbytes}}]}),
            })
            for said, r in refused.items():
                assert r.status_code == 400 and said in r.json()["error"], (said, r.status_code, r.text)
            assert not [r for r in os.listdir("/dev/shm") if r.startswith(f"{name}-missing")]  # nothing made
            # the object's bytes are those the client wrote: no refused output wrote into it
            np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, list(x.shape)), x)
            # and the server goes on answering from the region
            ok = c.post(infer, json=_infer_body(name, x.nbytes))
            assert ok.status_code == 200, ok.text
        finally:
            c.post("/v2/systemsharedmemory/unregister")
        assert c.get("/v2/systemsharedmemory/status").json() == []
        missing = c.get(f"/v2/systemsharedmemory/region/{name}/status")
        assert missing.status_code == 404 and name in missing.json()["error"]


def test_grpc_refusals_carry_their_status_code(shm_server):
    client = _client("grpc", shm_server)
    with pytest.raises(InferenceServerException) as e:
        client.register_system_shared_memory("r", "/a/b", 8)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "no path" in e.value.message()
    inp = grpcclient.InferInput("image", [1, 32, 32, 3], "FP32")
    inp.set_shared_memory("nope", 12288)
    with pytest.raises(InferenceServerException) as e:
        client.infer("small_cnn", [inp])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "no shared memory region 'nope'" in e.value.message()


def test_off_unless_the_server_is_started_with_it(server, regions):
    """The session server runs without --shared-memory: nothing registers, no request reads a region."""
    x = cnn_input(1)
    name, key, handle = regions.make(x.nbytes)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert "system_shared_memory" not in c.get("/v2").json()["extensions"]
        r = c.post(f"/v2/systemsharedmemory/region/{name}/register", json={"key": key, "offset": 0, "byte_size": x.nbytes})
        assert r.status_code == 400 and "--shared-memory" in r.json()["error"]
        r = c.post("/v2/models/small_cnn/infer", json=_infer_body(name, x.nbytes))
        assert r.status_code == 400 and "--shared-memory" in r.json()["error"]


def test_the_server_says_it_has_the_extension(shm_server):
    assert "system_shared_memory" in httpx.get(shm_server.url + "/v2").json()["extensions"]


def test_a_shrunk_object_is_refused_not_read_past_its_end(shm_server, cnn_model, regions):
    """A client that truncates a registered object: the request is refused (reading the mapping past
    the object's end would kill the server with SIGBUS), and the server goes on."""
    x = cnn_input(1, seed=2)
    name, key, handle = regions.make(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    with httpx.Client(base_url=shm_server.url, timeout=30) as c:
        assert c.post(f"/v2/systemsharedmemory/region/{name}/register",
                      json={"key": key, "offset": 0, "byte_size": x.nbytes}).status_code == 200
        try:
            os.truncate(f"/dev/shm/{name}", 4096)
            r = c.post("/v2/models/small_cnn/infer", json=_infer_body(name, x.nbytes))
            assert r.status_code == 400 and "has shrunk to 4096" in r.json()["error"], r.text
            os.truncate(f"/dev/shm/{name}", x.nbytes)  # grown back: read again (the lost pages read as zeros)
            r = c.post("/v2/models/small_cnn/infer", json=_infer_body(name, x.nbytes))
            assert r.status_code == 200, r.text
        finally:
            c.post(f"/v2/systemsharedmemory/region/{name}/unregister")
