"""Batch jobs: the JSONL lines, the Batches API, its SQLite store, and conveyor run-batch."""
