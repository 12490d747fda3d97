"""kubetrt.serving: the HTTP server on top of the runtime.

Modules, one job each: app (FastAPI routes), oip (Open Inference Protocol codec), tfserving
(TF Serving REST codec), tensors (datatypes, JSON -> arrays), registry (loaded models, golden
warm-up, readiness), metrics (Prometheus), errors (status + {"error": ...}), server (uvicorn
with graceful shutdown). The dynamic batcher lives in kubetrt.runtime.batcher.
"""
