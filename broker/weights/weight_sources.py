"""The learner's answer to `POST /v/{version}/source` (broker/weights/weight_server.py): which holder
the asking generator fetches a version from.

A request is answered only for the generator its headers name, proven by the key that
generator registered with its own Redis credentials, offering as relay nothing or exactly the
`http(s)://host:port` it registered (broker/weights/weight_auth.py): 403 otherwise, 400 for a body that is
not `{"relay": url or null, "failed": [urls]}` within `MAX_FAILED` urls of `MAX_URL` characters,
408 for one that does not arrive within the server's `request_timeout_s`. Then the plan
(broker/weights/weight_plan.py), whose memory is bounded, names the source.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from rollflash.broker.weights.manifest import FORMS
from rollflash.broker.weights.weight_auth import (
    GENERATOR_HEADER,
    KEY_HEADER,
    Registration,
    relay_url_problem,
)
from rollflash.broker.weights.weight_plan import SourcePlanner
from rollflash.http_guard import BadBody, ServerLimits, read_json

log = logging.getLogger(__name__)

MAX_FAILED = 64  # relays one request may name as failed
MAX_URL = 2048  # characters of a URL in a request
Registrations = Callable[[str], Registration | None]  # generator id -> what it registered
Refuse = Callable[[web.Request, int, str], web.HTTPException]  # the 4xx to raise, logged


class SourceDesk:
    def __init__(
        self,
        planner: SourcePlanner,
        registrations: Registrations,
        refuse: Refuse,
        limits: ServerLimits,
    ):
        self.planner, self.registrations = planner, registrations
        self.refuse, self.limits = refuse, limits

    async def answer(self, request: web.Request, version: int) -> web.Response:
        """The source of `version` (which the server holds) for the generator asking."""
        generator = await self._vouched(request)
        relay, failed, form = await self._body(request)
        if relay is not None and (problem := relay_url_problem(relay)) is not None:
            raise self.refuse(request, 400, f"relay {relay[:100]!r}: {problem}")
        refusal = generator.refusal(request.headers[KEY_HEADER], relay)
        if refusal is not None:
            raise self.refuse(request, 403, refusal)
        url = self.planner.assign(version, generator.generator, relay, failed, form)
        if url != self.planner.learner_url:
            log.info("weights v%d: %s fetches from %s", version, generator.generator, url)
        return web.json_response({"url": url})

    async def _vouched(self, request: web.Request) -> Registration:
        """What the generator the request names registered (403 if nothing, 503 if Redis does
        not answer); `answer` checks the key against it. Before the body is read."""
        name, key = request.headers.get(GENERATOR_HEADER), request.headers.get(KEY_HEADER)
        if not name or not key:
            why = f"a source is given only with {GENERATOR_HEADER} and {KEY_HEADER}"
            raise self.refuse(request, 403, why)
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(None, self.registrations, name)
        except Exception as e:  # Redis unreachable: the generator asks again later
            log.warning("weights server: cannot read generator %s's key: %s", name[:80], e)
            raise web.HTTPServiceUnavailable(
                text="cannot check the generator's key now\n"
            ) from None
        if found is None:
            why = f"generator {name[:80]!r} registered no key"
            raise self.refuse(request, 403, why)
        return found

    async def _body(self, request: web.Request) -> tuple[str | None, list[str], str]:
        try:
            body = await read_json(request, self.limits.request_timeout_s)
        except BadBody as e:
            raise self.refuse(request, e.status, str(e)) from None
        if not isinstance(body, dict):
            body = {"relay": 0}  # refused below
        relay, failed, form = body.get("relay"), body.get("failed", []), body.get("form", "full")
        if (
            form not in FORMS
            or not (relay is None or (isinstance(relay, str) and len(relay) <= MAX_URL))
            or not isinstance(failed, list)
            or len(failed) > MAX_FAILED
            or not all(isinstance(u, str) and len(u) <= MAX_URL for u in failed)
        ):
            why = (
                f"expected {{relay: url or null, failed: [at most {MAX_FAILED} urls], "
                f"form: one of {', '.join(FORMS)}}}"
            )
            raise self.refuse(request, 400, why)
        return relay, failed, form
