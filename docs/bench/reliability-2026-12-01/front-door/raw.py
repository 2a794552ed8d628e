"""Floor below uvicorn: an asyncio Protocol on uvloop that answers 503 as soon as a request's head arrived."""
import asyncio, sys, uvloop
RESP = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 2\r\n"
        b"content-length: 2\r\nconnection: close\r\n\r\n{}")
class P(asyncio.Protocol):
    def connection_made(self, t): self.t = t; self.buf = b""
    def data_received(self, d):
        self.buf += d
        if b"\r\n\r\n" in self.buf:
            self.t.write(RESP); self.t.close()
async def main():
    srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    await srv.serve_forever()
uvloop.run(main())
