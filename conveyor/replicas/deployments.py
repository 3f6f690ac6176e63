"""The Ray Serve application: an ingress, N engine replicas, and a metrics hub.

    Ray's HTTP proxy -> ConveyorIngress --(handle, PrefixAffinityRouter)--> ConveyorEngine x N
                          /metrics: asks each replica the hub knows    <-- its metrics, now
                                    (the hub's copy if one is late)
                          MetricsHub  <-- each replica pushes its /metrics every few seconds

Ray's proxy hands a deployment the request's headers only (the replica pulls the body later), so
a router in front of the engines cannot see the prompt. The ingress reads the body, computes the
prompt's prefix key (prompt_prefix.py) and calls the engines through a handle whose router
(router.py) uses it. Each engine replica runs conveyor's own app in process (http_bridge.py), so
clients get exactly a single server's API, streaming and errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from conveyor.config import EngineConfig, ServerConfig
from conveyor.replicas.config import ReplicaConfig
from conveyor.text.tokenizer_loader import load_tokenizer
from conveyor.errors import ConveyorError, QueueFull, RequestTimeout, RequestTooLarge, Unauthorized
from conveyor.model.checkpoint import resolve_model_path
from conveyor.replicas.http_bridge import ForwardedRequest, RelayResponse, ReplicaLost, call_app
from conveyor.replicas.metrics_merge import MetricsStore, merge_metrics
from conveyor.replicas.prompt_prefix import PromptPrefix
from conveyor.replicas.router import ROUTING_KEY_ARG, PrefixAffinityRouter
from conveyor.replicas.routing import RoutingKey
from conveyor.server.api_server import build_app_over, start_core
from conveyor.server.app import error_response

logger = logging.getLogger(__name__)

_ROUTING_STATS_PERIOD_S = 1.0     # how often replicas report running + waiting to the router
_STATS_TIMEOUT_S = 5.0
_THREAD_KEY_BYTES = 64 * 1024
_INGRESS_MAX_ONGOING = 10_000     # the ingress only relays; the engines' own limits answer overload
# A replica's answer to a scrape: past this (a replica at its max ongoing requests waits for room),
# its last push stands in, at most metrics_push_interval_s old.
_SCRAPE_TIMEOUT_S = 2.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class MetricsHub:
    """The latest /metrics text of every engine replica; `render` merges them."""

    def __init__(self, stale_after_s: float) -> None:
        self.store = MetricsStore(stale_after_s)

    async def push(self, replica_id: str, text: str) -> None:
        self.store.push(replica_id, text)

    async def texts(self) -> dict[str, str]:
        """Each live replica's last pushed text: which replicas to ask, and what stands in for a late one."""
        return self.store.texts()


class ConveyorEngine:
    """One engine and conveyor's app over it; `serve_http` serves one forwarded HTTP request."""

    async def __init__(self, config: EngineConfig, server: ServerConfig, hub: DeploymentHandle,
                       metrics_push_interval_s: float) -> None:
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.server = server
        self.client, tokenizer, model_name = start_core(config, server)
        # The live view is one engine's: behind the ingress it would show whichever replica served the page.
        self.engine, self.app = build_app_over(self.client, tokenizer, model_name,
                                               dataclasses.replace(server, enable_dashboard=False))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self._pusher = asyncio.create_task(self._push_metrics(hub, metrics_push_interval_s))

    async def serve_http(self, request: ForwardedRequest, routing_key: object = None) -> AsyncIterator[list[Message]]:
        async for messages in call_app(self.app, request, self.replica_id):
            yield messages

    async def metrics_text(self, routing_key: object = None) -> tuple[str, str]:
        """(this replica's id, its /metrics text now); routing_key names the replica the scrape asks."""
        return self.replica_id, self.app.state.metrics.render().decode()

    async def record_routing_stats(self) -> dict[str, int]:
        return {"num_running": self.engine.load.num_running, "num_waiting": self.engine.num_waiting}

    async def check_health(self) -> None:
        # A replica whose core died fails its health check, and Ray Serve replaces it.
        if self.engine.dead_reason is not None:
            raise RuntimeError(self.engine.dead_reason)

    async def _push_metrics(self, hub: DeploymentHandle, interval_s: float) -> None:
        metrics = self.app.state.metrics
        while True:
            try:
                await hub.push.remote(self.replica_id, metrics.render().decode())
            except (RayActorError, ActorUnavailableError, RayTaskError) as exc:   # the hub restarts; try again
                logger.warning("could not push metrics: %s", exc)
            await asyncio.sleep(interval_s)

    async def __del__(self) -> None:
        self._pusher.cancel()
        await self.engine.shutdown(self.server.shutdown_grace_s)
        await self._lifespan.__aexit__(None, None, None)
        self.client.kill()


class ConveyorIngress:
    """The HTTP entry: reads the body, keys it by prompt prefix, relays the engine replica's answer."""

    def __init__(self, engine: DeploymentHandle, hub: DeploymentHandle, config: EngineConfig,
                 server: ServerConfig) -> None:
        tokenizer = load_tokenizer(resolve_model_path(config.model.model), config.model.chat_template)
        self.prefix = PromptPrefix(tokenizer, config.cache.block_size)
        self.engine = engine.options(stream=True)
        self.engine_calls = engine
        self.hub = hub
        self.server = server
        self.expected_auth = f"Bearer {server.api_key}".encode()   # used only with protect_metrics, which needs a key

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics":
            given = request.headers.get("authorization", "").encode()
            if self.server.protect_metrics and not hmac.compare_digest(given, self.expected_auth):
                return error_response(Unauthorized("missing or invalid API key; send 'Authorization: Bearer <key>'"))
            return Response(await self._scrape(), media_type=CONTENT_TYPE_LATEST)
        try:
            body = await self._read_body(request)
        except (RequestTooLarge, RequestTimeout) as exc:
            response = error_response(exc)
            response.headers["Connection"] = "close"
            return response
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     list(request.scope["headers"]), body,
                                     tuple(request.client) if request.client else None)
        # A big body, or any chat (its template came with the model and renders on a budget of
        # seconds), is keyed off the event loop.
        key = (self.prefix.key(path, body) if len(body) <= _THREAD_KEY_BYTES and path != "/v1/chat/completions"
               else await asyncio.to_thread(self.prefix.key, path, body))
        stream = _replica_errors(self.engine.serve_http.remote(forwarded, **{ROUTING_KEY_ARG: key}))
        try:
            first = await anext(stream)
        except ConveyorError as exc:
            return error_response(exc)
        except StopAsyncIteration:
            return error_response(ReplicaLost("the replica ended the request without a response"))
        return RelayResponse(first, stream)

    async def _scrape(self) -> bytes:
        """Every replica's metrics as of now, merged. A replica that does not answer in time is
        represented by its last push; one the router no longer has (another answered) is left out."""
        pushed: dict[str, str] = await self.hub.texts.remote()

        async def ask(replica_id: str) -> tuple[str, str] | None:
            call = self.engine_calls.metrics_text.remote(**{ROUTING_KEY_ARG: RoutingKey(replica_id=replica_id)})
            try:
                return await asyncio.wait_for(call, _SCRAPE_TIMEOUT_S)
            except (TimeoutError, RayActorError, ActorUnavailableError, RayTaskError, BackPressureError) as exc:
                call.cancel()
                logger.info("replica %s did not answer the scrape (%s); its last push stands in", replica_id,
                            type(exc).__name__)
                return None

        asked = list(pushed)
        answers = await asyncio.gather(*(ask(replica_id) for replica_id in asked))
        texts = dict(pushed)
        for replica_id, answer in zip(asked, answers):
            if answer is not None and answer[0] != replica_id:
                texts.pop(replica_id, None)   # gone: the router sent the call elsewhere
        texts.update(answer for answer in answers if answer is not None)
        return merge_metrics(dict(sorted(texts.items())))

    async def _read_body(self, request: Request) -> bytes:
        """The whole body, up to the same size limit and deadline a single server applies."""
        limit = self.server.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = RequestTooLarge(f"the request body is larger than the server's limit of {limit} bytes")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(self.server.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise too_large
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {self.server.body_timeout_s:g} s") from None
        return bytes(body)


async def _replica_errors(stream: DeploymentResponseGenerator) -> AsyncIterator[list[Message]]:
    """The replica's messages; its death (or a failure of the call itself) becomes `ReplicaLost`."""
    finished = False
    try:
        async for messages in stream:
            yield messages
        finished = True
    except BackPressureError:
        finished = True
        raise QueueFull("every replica is at capacity and the router's queue is full (--max-waiting-requests); "
                        "retry later") from None
    except (RayActorError, ActorUnavailableError) as exc:
        finished = True
        raise ReplicaLost(f"the replica serving this request died: {type(exc).__name__}") from exc
    except RayTaskError as exc:
        finished = True
        logger.error("the replica failed this request: %s", exc)
        raise ReplicaLost(f"the replica failed this request: {exc.cause!r}") from exc
    finally:
        if not finished:
            stream.cancel()   # the client left: the replica's call ends, which aborts the engine request


def build_application(config: EngineConfig, server: ServerConfig, replicas: ReplicaConfig) -> Application:
    """The bound application: `serve.run` it (launch.py), or build it from a `serve run` config."""
    max_num_seqs = config.scheduler.max_num_seqs
    scaling: dict = {"num_replicas": replicas.num_replicas}
    if replicas.is_autoscaling:
        scaling = {"num_replicas": "auto", "autoscaling_config": AutoscalingConfig(
            min_replicas=replicas.lower_bound, max_replicas=replicas.upper_bound,
            initial_replicas=replicas.num_replicas,
            target_ongoing_requests=replicas.target_ongoing_requests or max_num_seqs)}
    hub = MetricsHub.bind(stale_after_s=3 * replicas.metrics_push_interval_s + _STATS_TIMEOUT_S)
    engine = serve.deployment(ConveyorEngine).options(
        name="ConveyorEngine",
        # A batch's worth running and as many waiting in the engine; more wait in the ingress's router.
        max_ongoing_requests=2 * max_num_seqs,
        ray_actor_options={"num_cpus": config.model.threads or 1},
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_routing_stats_period_s=_ROUTING_STATS_PERIOD_S,
                                                  request_routing_stats_timeout_s=_STATS_TIMEOUT_S),
        # --max-waiting-requests bounds the router's queue too (Serve's least is 1); past it a 429.
        max_queued_requests=-1 if server.max_waiting_requests is None else max(1, server.max_waiting_requests),
        graceful_shutdown_timeout_s=server.shutdown_grace_s + 5,
        **scaling,
    ).bind(config, server, hub, replicas.metrics_push_interval_s)
    ingress = serve.deployment(ConveyorIngress).options(
        name="ConveyorIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=_INGRESS_MAX_ONGOING)
    return ingress.bind(engine, hub, config, server)
