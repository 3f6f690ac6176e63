"""A small mixed load for watching the live view (/dashboard) of a running `conveyor serve`.

    python scripts/live_view_load.py [--url http://127.0.0.1:8000] [--clients 12] [--seconds 120]

Each client sends chat requests back to back, as one of three tenants: short questions, long
documents (chunked prefill), a shared system prompt (prefix-cache hits), and a low-priority batch
tenant, with output lengths from 16 to 160 tokens, so requests join and leave the batch every step.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import httpx

SYSTEM = ("You are the support assistant of a railway company. Answer briefly and politely, in plain "
          "English, and never invent timetables. ") * 3
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Name three rivers in Europe.",
             "How does a steam engine work?", "Write a haiku about trains.", "What is continuous batching?"]
DOCUMENT = ("Continuous batching gathers one token from every running sequence, plus chunks of new "
            "prompts, into one forward pass over a paged KV cache. ") * 12
TENANTS = [("alice", 0), ("bob", 0), ("nightly-batch", 10)]   # (tenant, priority: lower runs first)


def client(base_url: str, model: str, until_s: float, seed: int, api_key: str | None) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, timeout=600, headers=headers) as http:
        while time.monotonic() < until_s:
            tenant, priority = rng.choice(TENANTS)
            kind = rng.random()
            if kind < 0.3:
                messages = [{"role": "user", "content": f"Summarize this text: {DOCUMENT[:rng.randint(300, 1800)]}"}]
            elif kind < 0.7:
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rng.choice(QUESTIONS)}]
            else:
                messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
            try:
                http.post("/v1/chat/completions", headers={"X-Tenant": tenant}, json={
                    "model": model, "messages": messages, "max_tokens": rng.choice([16, 32, 64, 96, 160]),
                    "temperature": 0.7, "priority": priority, "ignore_eos": True})
            except httpx.TransportError:
                time.sleep(1)   # the server restarts or is gone: try again


def run_load(base_url: str, clients: int, seconds: float, api_key: str | None = None) -> list[threading.Thread]:
    """Start the clients on threads; they stop by themselves after `seconds`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=client, args=(base_url, model, until, i, api_key), daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    print(f"{args.clients} clients for {args.seconds:g} s; watch {args.url}/dashboard")
    for thread in run_load(args.url, args.clients, args.seconds, args.api_key):
        thread.join()


if __name__ == "__main__":
    main()
