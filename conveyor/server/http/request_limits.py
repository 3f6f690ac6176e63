"""Per-request bounds of the HTTP API that the offline API does not need, each checked before the work it bounds.

SamplingParams bounds what both APIs share (stop lists, n, top logprobs); here are the server's
own: who the request is for (a tenant name becomes a metrics label and a scheduler key), how many
messages a chat may have (each is parsed and templated), how many choices one request may start,
and how many logprob entries a response may carry (each is tens of bytes of JSON, built before the
response goes out).
"""

from __future__ import annotations

from starlette.requests import Request

from conveyor.errors import InvalidRequest
from conveyor.sampling_params import SamplingParams

TENANT_HEADER = "x-tenant"
MAX_TENANT_CHARS = 256
MAX_CHAT_MESSAGES = 4096
MAX_CHOICES_PER_REQUEST = 2048   # prompts x n: each is an engine request, started and tracked on the loop
# Sampled and top tokens over all choices and output tokens of one response: about 5 MB of JSON.
MAX_LOGPROB_ENTRIES = 65_536


def tenant_of(request: Request, user: str | None) -> str:
    """Whose request: the X-Tenant header (set by a gateway that knows its callers) over the body's user."""
    header = request.headers.get(TENANT_HEADER)
    for value, where, param in ((header, "the X-Tenant header", None), (user, "user", "user")):
        if value is not None and len(value) > MAX_TENANT_CHARS:
            raise InvalidRequest(f"{where} has {len(value)} characters; a tenant name has at most {MAX_TENANT_CHARS}",
                                 param=param)
    return header or user or ""


def check_message_count(num_messages: int) -> None:
    if num_messages > MAX_CHAT_MESSAGES:
        raise ValueError(f"a chat has at most {MAX_CHAT_MESSAGES} messages, got {num_messages}")


def bounded_messages(messages: object) -> object:
    """A `messages` field's "before" validator: the list is counted before any message is parsed."""
    if isinstance(messages, list):
        check_message_count(len(messages))
    return messages


def check_choice_count(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES_PER_REQUEST:
        raise InvalidRequest(f"this request asks for {num_prompts} prompts x n={n} = {num_prompts * n} choices; "
                             f"at most {MAX_CHOICES_PER_REQUEST} are allowed", param="prompt" if n == 1 else "n")


def check_logprobs_budget(params: SamplingParams, prompts: list[list[int]], max_model_len: int, param: str) -> None:
    """400 when the logprobs asked for could pass MAX_LOGPROB_ENTRIES: prompts x n x output tokens x
    (top + 1), plus prompt tokens x (top + 2) with prompt logprobs (each may be shown twice, with echo).
    Output tokens are max_tokens, or what the model length leaves when it is not set."""
    num_entries = 0
    for prompt in prompts:
        max_tokens = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - len(prompt))
        if params.logprobs is not None:
            num_entries += params.n * max_tokens * (params.logprobs + 1)
        if params.prompt_logprobs is not None:   # every choice shows its prompt's scores
            num_entries += params.n * len(prompt) * (params.prompt_logprobs + 2)
    if num_entries > MAX_LOGPROB_ENTRIES:
        raise InvalidRequest(
            f"this request could return {num_entries} logprob entries (choices x (max_tokens x (top logprobs + 1) "
            f"+ prompt tokens x (top prompt logprobs + 2))); the limit is {MAX_LOGPROB_ENTRIES}: lower max_tokens, "
            f"n, the prompt or the top logprobs", param=param)
