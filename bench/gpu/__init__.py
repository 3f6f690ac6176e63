"""On a CUDA GPU: conveyor offline and served against transformers, CUDA graphs, GGUF formats."""
