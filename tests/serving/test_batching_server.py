"""Dynamic batching through the live server. The model is the real runtime model behind a gate
at the compute boundary (GatedModel), so queues fill on cue instead of by timing luck."""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np

from kubetrt.serving.batcher import BatcherConfig
from kubetrt.serving.app import create_app
from kubetrt.serving.registry import ServingConfig
from serving_support import CountingModel, GatedModel, LiveServer, ModelDouble, cnn_input

N = 12


def oip_body(x: np.ndarray, **params) -> dict:
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    if params:
        body["parameters"] = params
    return body


def output(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    o = r.json()["outputs"][0]
    return np.asarray(o["data"], np.float32).reshape(o["shape"])


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def gated_server(cnn_model, **batcher) -> tuple[GatedModel, LiveServer]:
    gated = GatedModel(cnn_model)
    config = ServingConfig(batcher=BatcherConfig(**batcher))
    return gated, LiveServer(create_app(config=config, models=[gated]))


async def test_gated_model_concurrent_requests_share_runtime_calls(cnn_model):
    gated, live = gated_server(cnn_model, max_batch_size=32, max_queue_delay_us=1000)
    with live:
        live.wait_ready()
        batcher = live.registry.get("small_cnn").batcher
        gated.calls.clear()  # drop the golden warm-up's calls
        gated.armed = True
        xs = [cnn_input(1 + i % 2, seed=100 + i) for i in range(N)]
        async with httpx.AsyncClient(base_url=live.url, timeout=30, limits=httpx.Limits(max_connections=N)) as c:
            first = asyncio.ensure_future(c.post("/v2/models/small_cnn/infer", json=oip_body(xs[0])))
            await asyncio.to_thread(gated.entered.wait, 10)
            rest = [asyncio.ensure_future(c.post("/v2/models/small_cnn/infer", json=oip_body(x))) for x in xs[1:]]
            await wait_for(lambda: batcher.queued == N - 1)
            gated.gate.set()
            responses = await asyncio.gather(first, *rest)
    assert len(gated.calls) < N
    assert sum(x.shape[0] for x in xs[1:]) == 17
    # the queued 17 rows run as one batch padded to 32, or, where the sizes' measured run times make
    # the padding cost more than a second run, as 15 rows padded to 16 and then the last 2
    assert gated.calls[0] == xs[0].shape[0] and gated.calls[1:] in ([32], [16, 2]), gated.calls
    for x, r in zip(xs, responses):
        np.testing.assert_allclose(output(r), cnn_model.predict({"image": x})["output_0"], rtol=1e-5, atol=1e-6)


async def test_gated_model_full_queue_answers_503_not_a_hang(cnn_model):
    gated, live = gated_server(cnn_model, max_batch_size=1, max_queue_size=2)
    with live:
        live.wait_ready()
        batcher = live.registry.get("small_cnn").batcher
        gated.armed = True
        x = cnn_input(1)
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            running = asyncio.ensure_future(c.post("/v2/models/small_cnn/infer", json=oip_body(x)))
            await asyncio.to_thread(gated.entered.wait, 10)
            queued = [asyncio.ensure_future(c.post("/v2/models/small_cnn/infer", json=oip_body(x))) for _ in range(2)]
            await wait_for(lambda: batcher.queued == 2)
            r = await asyncio.wait_for(c.post("/v2/models/small_cnn/infer", json=oip_body(x)), 10)
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert "queue is full" in r.json()["error"]
            r = await asyncio.wait_for(c.post("/v1/models/small_cnn:predict", json={"instances": x.tolist()}), 10)
            assert r.status_code == 503
            gated.gate.set()
            for r in await asyncio.gather(running, *queued):
                assert r.status_code == 200


async def test_gated_model_request_deadline_gives_504(cnn_model):
    gated, live = gated_server(cnn_model, max_batch_size=1)
    with live:
        live.wait_ready()
        gated.armed = True
        x = cnn_input(1)
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
            running = asyncio.ensure_future(c.post("/v2/models/small_cnn/infer", json=oip_body(x)))
            await asyncio.to_thread(gated.entered.wait, 10)
            r = await c.post("/v2/models/small_cnn/infer", json=oip_body(x, timeout=50_000))  # 50 ms
            assert r.status_code == 504 and "deadline" in r.json()["error"]
            gated.gate.set()
            assert (await running).status_code == 200


class FailingModel(ModelDouble):
    """Runtime fault injection: any batch containing a NaN pixel raises, as a broken kernel would."""

    def predict(self, feeds):
        if np.isnan(feeds["image"]).any():
            raise FloatingPointError("kernel conv_1 produced garbage")
        return super().predict(feeds)


def test_runtime_error_fails_only_its_request_with_a_clear_message(cnn_model):
    config = ServingConfig(golden_check=False)
    with LiveServer(create_app(config=config, models=[FailingModel(cnn_model)])) as live:
        live.wait_ready()
        with httpx.Client(base_url=live.url, timeout=30) as c:
            bad = cnn_input(1)
            bad[0, 0, 0, 0] = np.nan
            body = oip_body(bad)
            body["inputs"][0]["data"] = [None if np.isnan(v) else v for v in body["inputs"][0]["data"]]
            # JSON null is not a number: rejected as bad input before it reaches the runtime.
            assert c.post("/v2/models/small_cnn/infer", json=body).status_code == 400
            header = b'{"inputs":[{"name":"image","datatype":"FP32","shape":[1,32,32,3],"parameters":{"binary_data_size":12288}}]}'
            r = c.post("/v2/models/small_cnn/infer", content=header + bad.tobytes(),
                       headers={"Inference-Header-Content-Length": str(len(header))})
            assert r.status_code == 500
            assert "kernel conv_1 produced garbage" in r.json()["error"] and "small_cnn" in r.json()["error"]
            good = cnn_input(1, seed=3)
            np.testing.assert_allclose(output(c.post("/v2/models/small_cnn/infer", json=oip_body(good))),
                                       cnn_model.predict({"image": good})["output_0"], rtol=1e-5)


def test_batching_off_runs_every_request_alone(cnn_model):
    counting = CountingModel(cnn_model)
    config = ServingConfig(batcher=BatcherConfig(max_batch_size=1), golden_check=False)
    with LiveServer(create_app(config=config, models=[counting])) as live:
        live.wait_ready()

        async def burst():
            async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
                return await asyncio.gather(*[c.post("/v2/models/small_cnn/infer", json=oip_body(cnn_input(1)))
                                              for _ in range(6)])

        for r in asyncio.run(burst()):
            assert r.status_code == 200
    assert counting.calls == [1] * 6
