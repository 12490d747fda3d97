"""kubetrt.serving: the HTTP server on top of the runtime.

Modules, one job each: app (FastAPI routes), oip (Open Inference Protocol codec), tfserving
(TF Serving REST codec), tensors (datatypes, JSON -> arrays), registry (loaded models, golden
warm-up, readiness), batcher (dynamic batching onto the runtime's futures), metrics
(Prometheus), errors (status + {"error": ...}), server (uvicorn with graceful shutdown).
"""
