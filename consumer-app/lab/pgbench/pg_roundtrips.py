#!/usr/bin/env python3
"""A PostgreSQL wire-protocol proxy that counts round trips per transaction.

    python3 pg_roundtrips.py LISTEN_PORT [UPSTREAM_PORT] [SECONDS]

Clients connect to 127.0.0.1:LISTEN_PORT with sslmode=disable. For every
transaction (from the first message sent on an idle session to the
ReadyForQuery that makes it idle again) it records the statements (simple
queries' text, prepared statements' SQL from their Parse) and the round
trips: a round trip starts whenever the client sends after the server has
answered. A Sync sent alone on an idle session (sqlx's ping before a pooled
connection is handed out) counts as one round trip of the next transaction.
After SECONDS (default 60) or Ctrl-C it prints, per kind of transaction,
how many there were and their round trips.
"""
import asyncio
import collections
import struct
import sys

LISTEN = int(sys.argv[1])
UPSTREAM = int(sys.argv[2]) if len(sys.argv) > 2 else 5432
SECONDS = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0

# signature -> [transactions, round trips, pings, ReadyForQuery count]
stats = collections.defaultdict(lambda: [0, 0, 0, 0])


def short(sql):
    sql = " ".join(sql.split())
    for key in ("inbox_messages", "bench_events", "article_inbox"):
        if key in sql:
            verb = sql.split()[0].upper()
            extra = ""
            if "unnest" in sql:
                extra = "(batch)"
            if "current_setting" in sql:
                extra = "(pipelined)"
            if "ON CONFLICT" in sql and not extra:
                extra = "(claim)"
            return f"{verb} {key}{extra}"
    return sql[:40]


class Session:
    def __init__(self):
        self.statements = {}  # prepared name -> sql
        self.unit = []  # statements of the open transaction
        self.turns = 0
        self.pings = 0
        self.rfq = 0
        self.answered = True  # the server spoke since the client last did
        self.busy = False

    def client_chunk(self, messages):
        kinds = [m[0] for m in messages]
        if kinds == [b"S"] and not self.busy and not self.unit:
            self.pings += 1
            self.answered = False
            return
        if self.answered:
            self.turns += 1
            self.answered = False
        for kind, body in messages:
            if kind == b"Q":
                text = body.rstrip(b"\0").decode(errors="replace")
                for part in text.split(";"):
                    if part.strip():
                        self.unit.append(short(part))
                self.busy = True
            elif kind == b"P":
                name, rest = body.split(b"\0", 1)
                sql = rest.split(b"\0", 1)[0].decode(errors="replace")
                self.statements[name] = sql
            elif kind == b"B":
                portal, rest = body.split(b"\0", 1)
                name = rest.split(b"\0", 1)[0]
                self.unit.append(short(self.statements.get(name, "?")))
                self.busy = True

    def server_message(self, kind, body):
        self.answered = True
        if kind == b"Z":
            self.rfq += 1
            if body[:1] == b"I" and self.unit:
                sig = " | ".join(self.unit)
                s = stats[sig]
                s[0] += 1
                s[1] += self.turns + self.pings
                s[2] += self.pings
                s[3] += self.rfq
                self.unit, self.turns, self.pings, self.rfq = [], 0, 0, 0
                self.busy = False
            elif body[:1] == b"I":
                self.turns, self.rfq = 0, 0
                self.busy = False


def split_messages(buf):
    """The complete messages at the start of `buf` as (type, body), and the rest."""
    messages = []
    while len(buf) >= 5:
        (length,) = struct.unpack("!i", buf[1:5])
        if len(buf) < 1 + length:
            break
        messages.append((buf[:1], buf[5 : 1 + length]))
        buf = buf[1 + length :]
    return messages, buf


async def pump_client(reader, writer, session):
    # Startup: untyped messages until the StartupMessage proper.
    while True:
        head = await reader.readexactly(8)
        length, code = struct.unpack("!ii", head)
        rest = await reader.readexactly(length - 8)
        writer.write(head + rest)
        await writer.drain()
        if code == 80877103 or code == 80877104:  # SSL / GSS request: answered by one byte
            session.expect_byte = True
            await session.byte_seen.wait()
            session.byte_seen.clear()
            continue
        if code == 80877102:  # cancel request
            return
        break
    buf = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        writer.write(data)
        messages, buf = split_messages(buf + data)
        if messages:
            session.client_chunk(messages)
        await writer.drain()
    writer.close()


async def pump_server(reader, writer, session):
    buf = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        writer.write(data)
        buf += data
        if buf and getattr(session, "expect_byte", False):
            # The one-byte answer to an SSL / GSS request, before any message.
            session.expect_byte = False
            buf = buf[1:]
            session.byte_seen.set()
        messages, buf = split_messages(buf)
        for kind, body in messages:
            session.server_message(kind, body)
        await writer.drain()
    writer.close()


async def handle(client_reader, client_writer):
    server_reader, server_writer = await asyncio.open_connection("127.0.0.1", UPSTREAM)
    session = Session()
    session.byte_seen = asyncio.Event()
    try:
        await asyncio.gather(
            pump_client(client_reader, server_writer, session),
            pump_server(server_reader, client_writer, session),
        )
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        client_writer.close()
        server_writer.close()


def report():
    print(f"{'transactions':>12} {'round trips each':>16} {'of which pings':>14} {'syncs each':>10}  statements")
    for sig, (n, turns, pings, rfq) in sorted(stats.items(), key=lambda kv: -kv[1][0]):
        if n >= 20:
            print(f"{n:>12} {turns / n:>16.2f} {pings / n:>14.2f} {rfq / n:>10.2f}  {sig}")
    sys.stdout.flush()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", LISTEN)
    async with server:
        try:
            await asyncio.wait_for(server.serve_forever(), SECONDS)
        except asyncio.TimeoutError:
            pass
    report()


asyncio.run(main())
