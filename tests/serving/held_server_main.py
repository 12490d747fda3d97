"""Subprocess entry for the shutdown test: serve small_cnn through the same `serve()` the CLI
uses, with the real model held at the compute boundary while a marker file exists."""
from __future__ import annotations

import os
import sys
import time

from kubetrt.runtime import load_model
from kubetrt.serving.app import create_app
from kubetrt.serving.server import serve, uvicorn_config
from serving_support import ModelDouble


class HeldModel(ModelDouble):
    def __init__(self, model, hold: str) -> None:
        super().__init__(model)
        self.hold = hold

    def predict(self, feeds):
        while os.path.exists(self.hold):
            time.sleep(0.005)
        return super().predict(feeds)


if __name__ == "__main__":
    package, hold = sys.argv[1], sys.argv[2]
    app = create_app(models=[HeldModel(load_model(package, "host"), hold)])
    sys.exit(serve(uvicorn_config(app, "127.0.0.1", 0, verbose=1)))
