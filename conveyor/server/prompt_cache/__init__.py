"""Named prompt caches a client manages: llama-server's /slots save and restore, QVAC's per-request cache key."""
