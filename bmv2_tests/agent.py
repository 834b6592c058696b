"""A test agent inside one Mininet host: UDP sockets driven over stdin/stdout, one JSON per line.

Requests:  {"op": "bind", "key": K, "port": P}
           {"op": "send", "key": K, "to": "ip:port", "payload": HEX}
           {"op": "send_many", "key": K, "to": "ip:port", "payloads": [HEX, ...]}
           {"op": "drain"}            -> {"received": [[K, HEX, "ip:port"], ...]}
Every request is answered with one line ({"ok": true, ...} or {"ok": false, "error": ...}).
It uses plain sockets on purpose: the packets under test are built by the test.
"""

from __future__ import annotations

import json
import socket
import sys


def main() -> None:
    sockets: dict[str, socket.socket] = {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req["op"]
            reply: dict = {"ok": True}
            if op == "bind":
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                s.bind(("0.0.0.0", int(req["port"])))
                s.setblocking(False)
                sockets[req["key"]] = s
            elif op == "send":
                host, port = req["to"].rsplit(":", 1)
                sockets[req["key"]].sendto(bytes.fromhex(req["payload"]), (host, int(port)))
            elif op == "send_many":  # a burst: payloads in order, as fast as the socket takes them
                host, port = req["to"].rsplit(":", 1)
                for payload in req["payloads"]:
                    sockets[req["key"]].sendto(bytes.fromhex(payload), (host, int(port)))
                reply["sent"] = len(req["payloads"])
            elif op == "drain":
                got = []
                for key, s in sockets.items():
                    while True:
                        try:
                            data, src = s.recvfrom(65536)
                        except BlockingIOError:
                            break
                        got.append([key, data.hex(), f"{src[0]}:{src[1]}"])
                reply["received"] = got
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # reported to the test, the agent keeps serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
