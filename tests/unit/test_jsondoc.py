"""jsondoc: the API server's JSON decoded (orjson) and copied (copied) as the standard library does it, and kopf's
decoding pointed at it (kopf_mends.decode_with), checked against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import copy
import json
from datetime import datetime, timezone

import aiohttp
import pytest
from aiohttp import web

from ddp_operator import jsondoc, kopf_mends

from test_jobs_memory import PODS

DOCS = [
    *PODS,
    {"kind": "Status", "message": "pods \"job-0\" is forbidden: \u00fcber \u2603 \"quoted\" \\ back\nslash",
     "code": 403, "details": {"causes": [], "retryAfterSeconds": 0}},
    {"big": 2**63 - 1, "small": -(2**63), "float": 0.1, "exp": 1e-7, "neg": -3.5, "t": True, "f": False, "n": None},
    [], {}, [[[]]], "text", 7, None,
]


@pytest.mark.parametrize("doc", DOCS, ids=range(len(DOCS)))
def test_loads_gives_what_the_standard_decoder_gives(doc):
    text = json.dumps(doc)
    assert jsondoc.loads(text) == json.loads(text)
    assert jsondoc.loads(text.encode()) == json.loads(text)
    assert type(jsondoc.loads(text)) is type(json.loads(text))


@pytest.mark.parametrize("bad", ["{", "", b"", "{'a': 1}", "[1,]", "NaN-ish", b"\xff\xfe"])
def test_a_document_that_is_not_json_is_a_value_error(bad):
    with pytest.raises(json.JSONDecodeError):
        jsondoc.loads(bad)


def _containers(value, path=()):
    if isinstance(value, (dict, list)):
        yield path, value
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from _containers(v, path + (k,))


@pytest.mark.parametrize("doc", DOCS, ids=range(len(DOCS)))
def test_copied_is_equal_and_shares_no_container(doc):
    doc = json.loads(json.dumps(doc))
    out = jsondoc.copied(doc)
    assert out == doc
    theirs = {id(c) for _, c in _containers(doc)}
    assert not any(id(c) in theirs for _, c in _containers(out))


def test_copied_deep_copies_what_is_not_json():
    class Held(dict):  # a Mapping subclass (kopf's views are not plain dicts)
        pass
    inner = Held(a=[1, 2])
    when = datetime(2025, 1, 1, tzinfo=timezone.utc)
    out = jsondoc.copied({"x": inner, "at": when})
    assert out == {"x": {"a": [1, 2]}, "at": when}
    assert out["x"] is not inner and out["x"]["a"] is not inner["a"]
    assert copy.deepcopy(inner) == out["x"]


def test_kopf_and_aiohttp_decode_with_the_operators_loads(monkeypatch):
    from kopf._cogs.clients import api

    monkeypatch.setattr(api, "json", api.json)
    monkeypatch.setitem(aiohttp.ClientResponse.json.__kwdefaults__, "loads",
                        aiohttp.ClientResponse.json.__kwdefaults__["loads"])
    seen = []

    def spy(text):
        seen.append(text)
        return jsondoc.loads(text)

    kopf_mends.decode_with(spy)
    assert api.json.loads is spy  # kopf's watch stream: json.loads(line) of its api module

    async def answer(_request):
        return web.json_response({"kind": "PodList", "items": [PODS[0]]})

    async def get() -> dict:
        app = web.Application()
        app.router.add_get("/api/v1/pods", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/api/v1/pods") as response:
                    return await response.json()  # as kopf's api.get reads a listing's page
        finally:
            await runner.cleanup()

    assert asyncio.run(get()) == {"kind": "PodList", "items": [json.loads(json.dumps(PODS[0]))]}
    assert len(seen) == 1


def test_the_operator_decodes_with_orjson():
    """requirements.txt installs it: the standard decoder is the fallback, not what runs."""
    assert jsondoc.orjson is not None
