"""The OpenAI-compatible endpoints: chat and completions, their schemas, streaming and n choices, logprobs, tokenization."""
