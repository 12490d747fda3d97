"""kubetrt: TensorFlow SavedModel -> verified per-GPU engines -> async serving on Kubernetes."""

__version__ = "0.1.0"
