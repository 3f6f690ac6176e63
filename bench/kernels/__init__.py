"""Per-step costs on this machine: compute and bandwidth floors, quantized matmul, attention, host time."""
