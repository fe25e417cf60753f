"""Baselines for bench_tokenize: uvicorn (uvloop + httptools) and a tokenizer, nothing else.

``raw``: a plain ASGI callable; its ``/echo`` answers a POSTed JSON body with itself (parsed
and serialised again: the floor of one JSON call over HTTP, for bench_derender_http).
``fastapi``: one FastAPI route (the framework tokenwire is built on) that parses the body and
calls the tokenizer: what remains above it is tokenwire's own cost (validation, auth, metrics,
request ids, error mapping).

Run: ``python bench/bare_tokenize_app.py MODEL_DIR PORT raw|fastapi``.
"""

from __future__ import annotations

import sys

import orjson
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file(f"{sys.argv[1]}/tokenizer.json")


async def raw_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["path"] == "/echo":
        payload = orjson.dumps(orjson.loads(body))
    else:
        ids = tokenizer.encode(orjson.loads(body)["prompt"]).ids
        payload = orjson.dumps({"count": len(ids), "tokens": ids})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


fastapi_app = FastAPI()


@fastapi_app.get("/health")
async def health() -> Response:
    return Response()


@fastapi_app.post("/tokenize")
async def tokenize(request: Request) -> Response:
    ids = tokenizer.encode(orjson.loads(await request.body())["prompt"]).ids
    return Response(orjson.dumps({"count": len(ids), "tokens": ids}), media_type="application/json")


if __name__ == "__main__":
    app = raw_app if sys.argv[3] == "raw" else fastapi_app
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[2]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
