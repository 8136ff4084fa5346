"""Does a Kafka broker answer on HOST:PORT? Standard library only (runs before any virtualenv).

Sends one Metadata v4 request (the oldest version Kafka 4.x still accepts) and reads the broker
list from the answer. A broker only serves it once it has joined the cluster metadata, so a
non-empty list means "ready for clients", not merely "port open".

Usage: python3 probe.py [HOST [PORT [TIMEOUT_S]]]
Exit codes: 0 ready; 1 nothing listens (connection refused, timeout); 2 something listens but
does not answer like a Kafka broker (or not yet: no broker in the metadata).
"""

from __future__ import annotations

import socket
import struct
import sys

API_METADATA, VERSION, CORRELATION_ID = 3, 4, 0x1F1F
CLIENT_ID = b"inferline-probe"


def metadata_request() -> bytes:
    # Request header v1: api_key, api_version, correlation_id, client_id (nullable string).
    header = struct.pack(">hhih", API_METADATA, VERSION, CORRELATION_ID, len(CLIENT_ID)) + CLIENT_ID
    # Metadata v4 body: topics = empty array (no topics: never auto-creates one),
    # allow_auto_topic_creation = false.
    body = struct.pack(">i?", 0, False)
    payload = header + body
    return struct.pack(">i", len(payload)) + payload


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        data += chunk
    return data


def num_brokers(host: str, port: int, timeout: float) -> int:
    """The number of brokers in the metadata answer; raises OSError when nothing listens."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(metadata_request())
        (size,) = struct.unpack(">i", read_exactly(sock, 4))
        if not 12 <= size <= 64 * 1024 * 1024:
            raise ValueError(f"answer of {size} bytes is not a Kafka response")
        answer = read_exactly(sock, size)
        # Response header v0: correlation_id; Metadata v4: throttle_time_ms, brokers array length.
        correlation_id, _throttle_ms, count = struct.unpack(">iii", answer[:12])
        if correlation_id != CORRELATION_ID:
            raise ValueError("correlation id mismatch: not a Kafka broker")
        return count


def main(argv: list[str]) -> int:
    host = argv[1] if len(argv) > 1 else "localhost"
    port = int(argv[2]) if len(argv) > 2 else 9092
    timeout = float(argv[3]) if len(argv) > 3 else 2.0
    try:
        count = num_brokers(host, port, timeout)
    except (ConnectionRefusedError, socket.timeout, socket.gaierror) as exc:
        print(f"no broker on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, struct.error) as exc:
        print(f"{host}:{port} does not answer like a Kafka broker: {exc}", file=sys.stderr)
        return 2
    if count < 1:
        print(f"{host}:{port} answers but lists no broker yet", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
