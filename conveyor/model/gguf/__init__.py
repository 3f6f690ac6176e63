"""GGUF files: the container, its metadata, validation, the model it holds, formats kept quantized."""
