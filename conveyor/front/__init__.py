"""The API-side front: admission, detokenizing and stop strings, the async and offline faces."""
