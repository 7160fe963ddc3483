"""specdeploy: speculative decoding from HF model dirs to ONNX/TensorRT and a lean runtime."""

__version__ = "0.1.0"
