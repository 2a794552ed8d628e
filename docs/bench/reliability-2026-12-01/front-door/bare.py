"""Floor: an ASGI app that answers every request 503 + Retry-After at once, no body read (uvicorn, httptools, uvloop)."""
import sys
import uvicorn

BODY = b'{"error":{"message":"busy","type":"server_overloaded"}}'

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"}); return
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"2")]})
    await send({"type": "http.response.body", "body": BODY})

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
                log_level="warning", backlog=4096, access_log=False)
