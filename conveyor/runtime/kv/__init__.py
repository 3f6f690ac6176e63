"""The KV cache and what keeps it: the tensors, the prefix cache's disk tier (its files, their fingerprint, named prompts)."""
