"""The HTTP entry of the Ray Serve deployment: computes each request's route and forwards it.

For ``POST /v1/completions`` and ``/v1/chat/completions`` the ingress renders and tokenizes the
prompt as the replicas do (the same tokenizer, chat template and salt rules), hashes its blocks
with ``PromptHasher`` and sends the request through the engine deployment's handle with that route;
``PrefixCacheRequestRouter`` picks the replica. The replica answers with the single server's own
application, so status codes, error bodies and streams are unchanged. A body the ingress cannot
read is forwarded without a route (the replica answers it with its 4xx). A request whose
``model`` names a LoRA adapter is hashed with the adapter's content id (the replicas report
their adapters in their routing stats), so its route matches the blocks the replica caches.

``GET /metrics`` scrapes every replica (each call pinned to one replica) and merges the texts,
adding a ``replica`` label to every sample. ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` go to every replica; the ingress keeps the adapters loaded so and
loads them onto replicas that start later (autoscaling, a restart) before it routes the next
generation request. An ingress that Ray Serve started after another died reads them back from
the replicas, which keep what they took. ``GET /router/replicas`` (an admin action) is answered
here: the replicas the router knows, with their pid, requests in flight, event stream position,
indexed blocks and adapters, the ids it removed, and the run-time adapters the ingress replays
(``runtime_adapters``). Other paths go to any replica. With
``--routing-override``, a path under ``/routing/<policy>/`` is served as the rest of the path,
routed by that policy instead of ``--routing``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, get_args

from fastapi.security import HTTPAuthorizationCredentials
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from prefixserve.router import ROUTING_POLICIES, PromptHasher
from prefixserve.serve_ray import request_router as router_module
from prefixserve.serve_ray.front import error_body, stream_error_event

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OVERRIDE_PREFIX = "/routing/"
"""With ``--routing-override``, ``/routing/<policy>/v1/...`` routes by that policy (A/B runs of
policies on one deployment, e.g. ``prefixserve bench --base-url .../routing/round-robin/v1``)."""
ROUTER_STATE_PATH = "/router/replicas"
"""What the router knows of each replica (an admin action; see ``router_state``)."""
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""Sent to every replica, so that each serves the same adapters."""
REPLICA_TRIES = 5
"""Replicas a request is sent to when each dies before answering (``Ingress._forward``)."""
REPLICA_RETRY_DELAY_S = 0.5

logger = logging.getLogger(__name__)
SESSION_HEADER = "x-session-id"
"""Header naming a session for the ``session`` policy (else the body's ``user``)."""


def _first_prompt(prompt: Any) -> str | list[int]:
    """The first prompt of a completion request's ``prompt`` (which routes the request)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else [int(t) for t in prompt]


class Ingress:
    """The ingress deployment class (``serve.deployment`` is applied by ``app``)."""

    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]) -> None:
        from prefixserve.model.text.tokenizer import load_tokenizer
        from prefixserve.server.app import KeyParameters
        from prefixserve.server.launch import server_config

        namespace = argparse.Namespace(**args)
        self.engine = engine
        self.config = server_config(namespace)
        self.tokenizer = load_tokenizer(namespace.model)
        self.hasher = PromptHasher(namespace.block_size or 16, namespace.prefix_caching_hash_algo)
        self.routing_override = bool(namespace.routing_override)
        self.admin_check = get_args(KeyParameters.for_config(self.config).admin)[1].dependency
        self.adapters: dict[str, dict[str, Any]] = {}
        """Adapters loaded or unloaded at run time through the ingress: name -> the latest load
        or unload request as it was forwarded (the admin's credentials included), for replicas
        that start later."""
        self.replicas_with_adapters: set[str] = set()
        """Replicas that have seen every request of ``adapters``."""
        self.adapters_restored = False
        """Whether ``adapters`` was read back from the replicas (``_restore_adapters``)."""
        self.adapter_lock = asyncio.Lock()

    # ----------------------------------------------------------------- routes
    def route_for(self, path: str, body: bytes, headers: dict[str, str],
                  loras: dict[str, str] | None = None) -> dict[str, Any]:
        """The route of a generation request: hex block hashes, session key and, for a request
        whose ``model`` names a LoRA adapter of ``loras`` (name -> content id), the adapter's
        id, which is in its blocks' hashes as the replica computes them. Empty when the body is
        not a request the replica would accept."""
        from pydantic import ValidationError

        from prefixserve.server.errors import ApiError
        from prefixserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
        from prefixserve.server.openai.serving import cache_salt, chat_prompt

        try:
            data = json.loads(body)
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(data)
                ids = chat_prompt(self.tokenizer, chat)
                salt = chat.cache_salt
            else:
                completion = CompletionRequest.model_validate(data)
                first = _first_prompt(completion.prompt)
                ids = self.tokenizer.encode(first) if isinstance(first, str) else first
                salt = completion.cache_salt
        except (ValueError, ValidationError, ApiError, TypeError):
            return {}
        api_key = _bearer(headers.get("authorization"))
        salt = cache_salt(self.config, salt, api_key)
        model = data.get("model") if isinstance(data, dict) else None
        lora = (loras or {}).get(model) if isinstance(model, str) else None
        hashes = self.hasher.hash_values(ids, salt, lora)
        session = headers.get(SESSION_HEADER) or (data.get("user") if isinstance(data, dict)
                                                  else None)
        return {"hashes": [h.hex() if isinstance(h, bytes) else h for h in hashes],
                "session": session, "lora": lora}

    async def lora_ids(self, body: bytes) -> dict[str, str]:
        """The adapters the replicas serve (name -> content id) when ``body`` names a model
        that is not the base model; empty otherwise. From the replicas' routing stats, or asked
        of a replica when those do not know the name yet."""
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return {}
        if not isinstance(model, str) or model in self.config.served_model_names:
            return {}
        loras = router_module.known_loras()
        if model not in loras:
            loras = {**loras, **await self.engine.lora_ids.remote()}
        return loras

    def _policy_prefix(self, path: str) -> tuple[str | None, str]:
        """``/routing/<policy>/rest`` -> (policy, ``/rest``) when ``--routing-override`` is on."""
        if not (self.routing_override and path.startswith(OVERRIDE_PREFIX)):
            return None, path
        policy, _, rest = path[len(OVERRIDE_PREFIX):].partition("/")
        return policy, "/" + rest

    async def __call__(self, request: Request) -> Response:
        """The answer to one HTTP request. An unexpected exception is a 500 in the API's own
        error shape (``internal_error``), as one server answers it: Ray Serve would answer it
        with its plain-text 500, which the front (``front.py``) takes for a dead ingress and
        sends again until its deadline. Ray's own errors (a replica that died or failed) still
        go to Ray Serve's 500, which the front sends again."""
        try:
            return await self._answer(request)
        except RayError:
            raise
        except Exception as exc:
            logger.exception("unexpected error in %s %s", request.method, request.url.path)
            body = error_body(request.url.path, "internal_error",
                              f"internal server error: {type(exc).__name__}")
            return Response(body, status_code=500, media_type="application/json")

    async def _answer(self, request: Request) -> Response:
        body = await request.body()
        policy, path = self._policy_prefix(request.url.path)
        if policy is not None and policy not in ROUTING_POLICIES:
            return Response(json.dumps({"error": {
                "message": f"unknown routing policy {policy!r}", "type": "not_found_error",
                "param": None, "code": "not_found"}}), status_code=404,
                media_type="application/json")
        if request.method == "GET" and path == "/metrics":
            return await self.metrics(request, body, path)
        if request.method == "GET" and path == ROUTER_STATE_PATH:
            return await self.router_state(request)
        if request.method == "POST" and path in LORA_ADMIN_PATHS:
            return await self.on_every_replica(request, body, path)
        forwarded = _forwarded(request, body, path)
        kwargs: dict[str, Any] = {}
        if request.method == "POST" and path in GENERATION_PATHS:
            await self._replay_adapters()
            headers = {k.lower(): v for k, v in request.headers.items()}
            loras = await self.lora_ids(body)
            kwargs["route"] = {**self.route_for(path, body, headers, loras), "policy": policy}
        return await self._forward(forwarded, kwargs, path)

    async def _forward(self, forwarded: dict[str, Any], kwargs: dict[str, Any],
                       path: str) -> Response:
        """The replica's answer, streamed. A replica that dies before its answer starts (the
        request waited in it, or it was gone when chosen) costs nothing the client saw: the
        request goes to a replica again, up to ``REPLICA_TRIES`` times, a little later each
        time (Ray Serve stops choosing a dead replica once its controller notices); then a 503
        with ``Retry-After``. One that dies after its answer started ends the stream with an
        error event (``_rest``)."""
        from ray.exceptions import RayActorError

        for attempt in range(REPLICA_TRIES):
            stream: Any = self.engine.options(stream=True).handle_http.remote(forwarded,
                                                                               **kwargs)
            try:
                start = await stream.__anext__()
            except RayActorError as exc:
                logger.warning("a replica died before answering %s (try %d of %d): %s", path,
                               attempt + 1, REPLICA_TRIES, type(exc).__name__)
                if attempt + 1 < REPLICA_TRIES:
                    await asyncio.sleep(REPLICA_RETRY_DELAY_S * (attempt + 1))
                continue
            headers = _response_headers(start["headers"])
            events = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                         for k, v in headers.items())
            return StreamingResponse(_rest(stream, path, events), status_code=start["status"],
                                     headers=headers)
        return Response(json.dumps({"error": {
            "message": "no replica could take the request: the replicas chosen stopped before "
                       "answering; try again", "type": "server_error", "param": None,
            "code": "replica_unavailable"}}), status_code=503, headers={"Retry-After": "2"},
            media_type="application/json")

    async def metrics(self, request: Request, body: bytes, path: str) -> Response:
        """Every replica's ``/metrics``, merged with a ``replica`` label."""
        forwarded = _forwarded(request, body, path)
        replicas = await self._replicas()
        texts: list[tuple[str, str]] = []
        status = 200
        for rid in replicas:
            stream: Any = self.engine.options(stream=True).handle_http.remote(forwarded,
                                                                               replica=rid)
            start = await stream.__anext__()
            chunks = [chunk async for chunk in stream]
            if start["status"] != 200:
                status = start["status"]
                return Response(b"".join(chunks), status_code=status,
                                headers=_response_headers(start["headers"]))
            texts.append((rid, b"".join(chunks).decode()))
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")


    async def router_state(self, request: Request) -> Response:
        """``GET /router/replicas`` (an admin action): the replicas as the router sees them."""
        from prefixserve.server.errors import ApiError, error_response

        try:
            # the server's own admin check (a FastAPI dependency: no parameter when open)
            given = (_credentials(request.headers.get("authorization")),) \
                if inspect.signature(self.admin_check).parameters else ()
            await self.admin_check(*given)
        except ApiError as error:
            return error_response(error)
        await self._replicas()
        states = router_module.routers_state()
        state = states[0] if len(states) == 1 else {"routers": states}
        return Response(json.dumps({**state, "runtime_adapters": sorted(self.adapters)}),
                        media_type="application/json")

    async def on_every_replica(self, request: Request, body: bytes, path: str) -> Response:
        """A LoRA load/unload sent to every replica (each keeps its own adapters), answered
        with the first error, else the last answer. Once every replica took it, the ingress
        remembers it (``adapters``), for replicas that start later."""
        forwarded = _forwarded(request, body, path)
        answer = Response(status_code=503)
        async with self.adapter_lock:
            replicas = await self._replicas()
            await self._restore_adapters(replicas)
            for rid in replicas:
                answer = await self._on_replica(forwarded, rid)
                if answer.status_code >= 400:
                    return answer
            if replicas:
                self.adapters[str(json.loads(body).get("lora_name"))] = forwarded
                self.replicas_with_adapters = set(replicas)
        return answer

    async def _on_replica(self, forwarded: dict[str, Any], rid: str) -> Response:
        """The answer of replica ``rid`` to ``forwarded``, read whole."""
        stream: Any = self.engine.options(stream=True).handle_http.remote(forwarded, replica=rid)
        start = await stream.__anext__()
        chunks = [chunk async for chunk in stream]
        return Response(b"".join(chunks), status_code=start["status"],
                        headers=_response_headers(start["headers"]))

    async def _replay_adapters(self) -> None:
        """Sends the run-time loads and unloads to the replicas that started after them
        (autoscaling, a restart: a new replica starts with the ``--lora-modules`` adapters). A
        load a replica refuses (its file gone) is logged and not asked again; an unload of an
        adapter the replica never had is nothing to do. A new ingress first reads them back
        from the replicas (``_restore_adapters``)."""
        if self.adapters_restored and (not self.adapters or set(
                router_module.known_replicas()) <= self.replicas_with_adapters):
            return
        async with self.adapter_lock:
            await self._restore_adapters(await self._replicas())
            for rid in router_module.known_replicas():
                if rid in self.replicas_with_adapters:
                    continue
                for name, forwarded in self.adapters.items():
                    answer = await self._on_replica(forwarded, rid)
                    unload = forwarded["path"] == LORA_ADMIN_PATHS[1]
                    if answer.status_code >= 400 and not (unload and answer.status_code == 404):
                        logger.warning("replica %s refused adapter %r: %s", rid, name,
                                       bytes(answer.body)[:200].decode(errors="replace"))
                self.replicas_with_adapters.add(rid)

    async def _restore_adapters(self, replicas: list[str]) -> None:
        """Once per ingress process (under ``adapter_lock``): the run-time loads and unloads
        the live replicas took (``EngineReplica.adapter_requests``), so that an ingress Ray
        Serve started after another died still loads them onto replicas that start later. Per
        adapter the first replica's request is kept (every replica took the same ones, in the
        order the ingress sent them); a replica that holds exactly these is up to date, the
        others get them replayed."""
        from ray.exceptions import RayActorError

        if self.adapters_restored or not replicas:
            return
        held: dict[str, dict[str, Any]] = {}
        for rid in replicas:
            try:
                held[rid] = await self.engine.adapter_requests.remote(replica=rid)
            except RayActorError:  # died meanwhile: Ray Serve's replacement gets the replays
                continue
        for requests in held.values():
            for name, forwarded in requests.items():
                self.adapters.setdefault(name, forwarded)
        self.replicas_with_adapters |= {rid for rid, requests in held.items()
                                        if requests == self.adapters}
        self.adapters_restored = True
        if self.adapters:
            logger.info("run-time adapters read back from the replicas: %s",
                        ", ".join(sorted(self.adapters)))

    async def _replicas(self) -> list[str]:
        """The engine replicas' ids, from this process's request routers (made with the first
        request through the handle; one is sent here if none was)."""
        for _ in range(50):
            replicas = router_module.known_replicas()
            if replicas:
                return replicas

            await self.engine.ready.remote()
            await asyncio.sleep(0.1)
        return []


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of several replicas as one: HELP/TYPE once per family, every sample
    labelled ``replica="<id>"``."""
    seen: set[str] = set()
    families: dict[str, list[str]] = {}
    order: list[str] = []
    current = ""
    for rid, text in texts:
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                current = parts[2] if len(parts) > 2 else ""
                if current not in families:
                    families[current] = []
                    order.append(current)
                if line not in seen:
                    seen.add(line)
                    families[current].append(line)
            elif line.strip():
                families.setdefault(current, []).append(_with_replica(line, rid))
                if current not in order:
                    order.append(current)
    return "\n".join(line for name in order for line in families[name]) + "\n"


def _with_replica(sample: str, rid: str) -> str:
    label = f'replica="{rid}"'
    name_end = min((i for i in (sample.find("{"), sample.find(" ")) if i >= 0), default=-1)
    if name_end < 0:
        return sample
    if sample[name_end] == "{":
        closing = sample[name_end + 1:name_end + 2]
        sep = "" if closing == "}" else ","
        return f"{sample[:name_end + 1]}{label}{sep}{sample[name_end + 1:]}"
    return f"{sample[:name_end]}{{{label}}}{sample[name_end:]}"


def _credentials(value: str | None) -> HTTPAuthorizationCredentials | None:
    token = _bearer(value)
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token) if token else None


def _bearer(value: str | None) -> str | None:
    if value and value.lower().startswith("bearer "):
        return value[7:].strip() or None
    return None


def _forwarded(request: Request, body: bytes, path: str) -> dict[str, Any]:
    return {"method": request.method, "path": path,
            "query": request.url.query, "body": body,
            "headers": [(k, v) for k, v in request.headers.items()
                        if k.lower() not in ("content-length", "host")]
            + [("host", "prefixserve")]}


def _response_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in headers if k.lower() != "content-length"}


async def _rest(stream: Any, path: str, events: bool) -> AsyncIterator[bytes]:
    """The rest of a replica's answer. When the replica dies after the answer started (its
    status is sent), an event stream (``events``) ends with an error event in the API's own
    shape (Anthropic's ``event: error`` under ``/v1/messages``, else ``data: {"error": ...}``
    and ``data: [DONE]``) instead of a cut connection; another body just ends, incomplete."""
    from ray.exceptions import RayActorError

    try:
        async for chunk in stream:
            yield chunk
    except asyncio.CancelledError:
        stream.cancel()
        raise
    except RayActorError as exc:
        logger.warning("the replica serving %s died while it answered: %s", path,
                       type(exc).__name__)
        if events:
            yield _replica_died_event(path)


def _replica_died_event(path: str) -> bytes:
    return stream_error_event(path, "replica_died", "the replica serving this request stopped; "
                              "the answer is incomplete")
