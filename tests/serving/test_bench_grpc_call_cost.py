"""bench/grpc_call_cost.py: the server fed a grpc-go client's frames answers every call, rightly."""
from __future__ import annotations

from pathlib import Path

import pytest

import file_modules

REPO = Path(__file__).resolve().parents[2]
call_cost = file_modules.load("kubetrt_bench_grpc_call_cost", REPO / "bench" / "grpc_call_cost.py")


@pytest.mark.parametrize("package", ["cnn_package", "two_package"])
async def test_every_call_runs_the_model_once_and_the_last_answer_is_the_models(package, request):
    out = await call_cost.measure(request.getfixturevalue(package), calls=40, warmup=5)  # raises otherwise
    assert 0 < out["run_us"] < out["mean_us"], "a call takes its run and more"


async def test_a_model_that_answers_wrongly_fails_the_check(cnn_package, monkeypatch):
    """The check compares the answer with the model's own output: a server answering other values fails it."""
    from kubetrt.serving.oip_grpc import codec

    encode = codec.encode_infer_response
    monkeypatch.setattr(codec, "encode_infer_response",
                        lambda name, version, req, results, regions=None: encode(
                            name, version, req, {k: v + 1 for k, v in results.items()}, regions))
    with pytest.raises(AssertionError):
        await call_cost.measure(cnn_package, calls=3, warmup=1)
