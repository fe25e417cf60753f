"""The baseline for bench_tokenize: uvicorn (uvloop + httptools) and a tokenizer, nothing else.

Run: ``python bench/bare_tokenize_app.py MODEL_DIR PORT``.
"""

from __future__ import annotations

import sys

import orjson
import uvicorn
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file(f"{sys.argv[1]}/tokenizer.json")


async def app(scope, receive, send) -> None:  # noqa: ANN001 - raw ASGI
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
    ids = tokenizer.encode(orjson.loads(body)["prompt"]).ids
    payload = orjson.dumps({"count": len(ids), "tokens": ids})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), loop="uvloop", http="httptools",
                log_level="warning", access_log=False)
