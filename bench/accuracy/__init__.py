"""Accuracy against the float model: perplexity, KL divergence, top-1 agreement."""
