"""HTTP request -> `RoutingKey`: the token ids of the prompt's first blocks, as the replica will run them.

Runs in the ingress for every request, so it tokenizes only the prompt's first characters. It
never refuses anything: a body it cannot read gets an empty key (least loaded replica), and the
replica, running the same app as a single server, answers it with the error a single server gives.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jinja2
import pydantic

from conveyor.text.tokenizer import Tokenizer
from conveyor.errors import ConveyorError
from conveyor.replicas.routing import ROUTING_BLOCKS, RoutingKey, prefix_key
from conveyor.server.parsing.chat_tools import template_input
from conveyor.server.openai_api.request_schemas import ChatCompletionRequest

logger = logging.getLogger(__name__)

# Batch jobs and uploaded files live in one replica's store, so these go where the first one went.
_STICKY_PATHS = ("/v1/batches", "/v1/files")
_STICKY_KEY = RoutingKey((b"batches-and-files",), sticky=True)


class PromptPrefix:
    def __init__(self, tokenizer: Tokenizer, block_size: int, max_blocks: int = ROUTING_BLOCKS) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks
        # Every token is at most this long, so this many characters hold at least the tokens hashed.
        self.max_chars = block_size * max_blocks * tokenizer.max_token_chars

    def key(self, path: str, body: bytes) -> RoutingKey:
        if path.startswith(_STICKY_PATHS):
            return _STICKY_KEY
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return RoutingKey()
        try:
            payload = json.loads(body)
            token_ids = self._chat_prefix(payload) if path == "/v1/chat/completions" else self._prompt_prefix(payload)
        except (ValueError, TypeError, RecursionError, pydantic.ValidationError, ConveyorError,
                jinja2.TemplateError) as exc:
            logger.debug("no routing key for %s: %s", path, exc)
            return RoutingKey()
        return prefix_key(token_ids, self.block_size, self.max_blocks) if token_ids else RoutingKey()

    def _prompt_prefix(self, payload: Any) -> list[int]:
        prompt = payload.get("prompt") if isinstance(payload, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch: the first prompt stands for the request
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []

    def _chat_prefix(self, payload: Any) -> list[int]:
        body = ChatCompletionRequest.model_validate(payload)
        messages, tools = template_input(body.messages, body.tools, body.effective_tool_choice,
                                         self.tokenizer.template_takes_tools)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                  tools=tools)
        return self._encode(text, add_special_tokens=False)   # the template has the BOS

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= self.max_chars:
            return self.tokenizer.encode(text, add_special_tokens)
        # The last token of a cut text may differ from the whole text's token there: drop it.
        return self.tokenizer.encode(text[:self.max_chars], add_special_tokens)[:-1]
