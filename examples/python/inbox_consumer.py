#!/usr/bin/env python3
"""A consumer of one orbit-events subscription, in Python, with a SQLite Inbox.

It speaks orbit.events.v1 (docs/protocol.md) with the `websockets` library.
Each delivered event is stored in the Inbox, keyed by its event id, and
processed in the same local transaction; only then is it ACKed. An event the
Inbox already holds (a redelivery) is ACKed with its new proof and not
processed again. Each ACK proof is kept in the Inbox, by that same
transaction, until the server confirms it, and is sent again on the next
connection, also after a crash. `events.ping` keeps the session alive; a lost
connection is made again after an exponential backoff with jitter.

    export ORBIT_EVENTS_URL=http://127.0.0.1:8080 ORBIT_EVENTS_TOKEN=oe_...
    python inbox_consumer.py --subscription SUBSCRIPTION_ID --inbox inbox.db

Ctrl-C or SIGTERM stops it cleanly. Exit status: 0 after a stop, 2 for bad
usage, 3 when the server refuses it for good (a bad token, a missing
permission, an unknown subscription, a purged history).
"""

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sqlite3
import sys
from decimal import Decimal

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

# Error codes after which reconnecting cannot help (docs/protocol.md §5).
REFUSALS = {"UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "EVENT_HISTORY_EXPIRED"}
SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (
    event_id TEXT PRIMARY KEY, sequence INTEGER NOT NULL, type TEXT NOT NULL,
    task_id TEXT NOT NULL, event TEXT NOT NULL, stored_at TEXT NOT NULL,
    redeliveries INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS task_results (
    task_id TEXT PRIMARY KEY, task_revision INTEGER NOT NULL, type TEXT NOT NULL,
    event_id TEXT NOT NULL, results_seen INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS unconfirmed_acks (
    delivery_id TEXT PRIMARY KEY, epoch TEXT NOT NULL, lease_secret TEXT NOT NULL);
"""


def log(message):
    print(f"inbox_consumer: {message}", file=sys.stderr, flush=True)


class Refused(Exception):
    """The server refused this consumer for good."""


class Inbox:
    def __init__(self, path):
        # Autocommit mode: each transaction is an explicit BEGIN IMMEDIATE.
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before the ACK that follows it leaves.
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def store(self, event, proof):
        """Stores and processes `event` unless the Inbox has it, and keeps its
        ACK proof, in one transaction. True when the event was new."""
        with self.db:  # commits, or rolls back on an exception
            self.db.execute("BEGIN IMMEDIATE")
            new = self.db.execute(
                "INSERT INTO inbox (event_id, sequence, type, task_id, event, stored_at)"
                " VALUES (?, ?, ?, ?, ?, strftime('%Y-%m-%dT%H:%M:%fZ'))"
                " ON CONFLICT (event_id) DO NOTHING",
                (event["id"], int(event["sequence"]), event["type"],
                 event["aggregate_id"], to_json(event)),
            ).rowcount == 1
            if new:
                process(self.db, event)
            else:
                self.db.execute("UPDATE inbox SET redeliveries = redeliveries + 1"
                                " WHERE event_id = ?", (event["id"],))
            # A newer lease's proof replaces an older one, which could only be refused.
            self.db.execute("INSERT OR REPLACE INTO unconfirmed_acks VALUES (?, ?, ?)", proof)
        return new

    def unconfirmed(self):
        return self.db.execute("SELECT * FROM unconfirmed_acks").fetchall()

    def settled(self, proof):
        """The server answered the ACK of `proof`: no need to send it again."""
        self.db.execute("DELETE FROM unconfirmed_acks WHERE delivery_id = ? AND epoch = ?",
                        proof[:2])


def process(db, event):
    """The application's processing, in the Inbox transaction: the latest result
    of each task. A redelivery may come after a later result of its task, so a
    result only replaces one of a lower task revision."""
    db.execute(
        "INSERT INTO task_results VALUES (?, ?, ?, ?, 1) ON CONFLICT (task_id) DO UPDATE SET"
        " results_seen = results_seen + 1,"
        " type = iif(excluded.task_revision >= task_revision, excluded.type, type),"
        " event_id = iif(excluded.task_revision >= task_revision, excluded.event_id, event_id),"
        " task_revision = max(excluded.task_revision, task_revision)",
        (event["aggregate_id"], int(event["aggregate_revision"]), event["type"], event["id"]),
    )


def to_json(value):
    # Frames are parsed with Decimal floats, so that no number of a result is
    # rounded (1E400 would become inf); written back here at full value.
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k) + ":" + to_json(v) for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(to_json, value)) + "]"
    return str(value) if isinstance(value, Decimal) else json.dumps(value)


class Consumer:
    def __init__(self, args, token, inbox, stop):
        base = os.environ.get("ORBIT_EVENTS_URL", "http://127.0.0.1:8080").rstrip("/")
        self.url = base.replace("http", "ws", 1) + "/v1/events/connect"  # no query string
        self.args, self.token, self.inbox, self.stop = args, token, inbox, stop
        self.failures = 0  # connections in a row that got no welcome

    async def run(self):
        """Connects again and again until stopped; returns the exit status."""
        while not self.stop.is_set():
            retry_after = 0
            try:
                async with connect(
                    self.url, subprotocols=["orbit.events.v1"], compression=None,
                    additional_headers={"Authorization": f"Bearer {self.token}"},
                    # WebSocket pings do not keep a session alive (events.ping does);
                    # an event is at most a 512 KiB request body.
                    ping_interval=None, max_size=2**20, open_timeout=10, close_timeout=2,
                ) as ws:
                    await self.session(ws)
                continue
            except Refused as e:
                log(f"refused by the server: {e}")
                return 3
            except InvalidStatus as e:
                status, body = e.response.status_code, e.response.body or b""
                # The body is the API's error envelope: its code and message.
                reason = f"upgrade refused with {status} {body.decode(errors='replace')}"
                if status != 429 and status < 500:  # 400, 401, 403, 426: fix it first
                    log(reason)
                    return 3
                retry_after = int(e.response.headers.get("Retry-After") or 0)
            except (OSError, TimeoutError, WebSocketException) as e:
                reason = str(e) or type(e).__name__
            # 100 ms doubling to 10 s, each drawn between half and all of it, so
            # that consumers cut off together do not all come back together.
            ceiling = min(10.0, 0.1 * 2**self.failures)
            delay = max(random.uniform(ceiling / 2, ceiling), retry_after)
            self.failures += 1
            log(f"{reason}; reconnecting in {delay:.1f} s")
            try:
                await asyncio.wait_for(self.stop.wait(), delay)
            except TimeoutError:
                pass
        return 0

    async def session(self, ws):
        """Binds one session and serves it until it ends or the consumer stops."""
        await send(ws, "events.hello", None,
                   {"subscription_id": self.args.subscription, "capacity": self.args.capacity})
        welcome = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if welcome["type"] == "error":
            error = welcome["error"]
            if error["code"] == "UNAVAILABLE":  # the node's database: worth another try
                raise ConnectionError(f"hello: {error['message']}")
            raise Refused(f"{error['code']}: {error['message']}")
        body = welcome["body"]
        sid, interval = body["session_id"], body["heartbeat_interval_ms"] / 1000
        self.failures = 0
        log(f"connected (session {sid}, capacity {body['capacity']}"
            f"{'' if body['enabled'] else ', subscription paused'})")
        sent = {}  # proofs of the ACKs awaiting their reply here, by message id
        for proof in self.inbox.unconfirmed():  # from a lost connection or an earlier run
            sent[await ack(ws, sid, proof)] = proof
        tasks = [asyncio.create_task(heartbeat(ws, sid, interval)),
                 asyncio.create_task(self.close_on_stop(ws, sent))]
        close_expected = False
        try:
            while True:
                try:
                    text = await asyncio.wait_for(ws.recv(), 2 * interval)
                except TimeoutError:  # not even a ping reply: the connection is dead
                    raise ConnectionError("nothing received for two heartbeat intervals") from None
                except ConnectionClosed as e:
                    if self.stop.is_set():
                        return
                    if e.rcvd and e.rcvd.code in (1008, 1009) and not close_expected:
                        raise Refused(f"closed with {e.rcvd.code} ({e.rcvd.reason}): this consumer"
                                      " broke the protocol; fix it first") from None
                    raise
                frame = json.loads(text, parse_float=Decimal)
                kind, body = frame["type"], frame.get("body", {})
                if kind == "event.deliver":
                    if self.stop.is_set():
                        continue  # neither stored nor ACKed: it comes again after its lease
                    event, d = body["event"], body["delivery"]
                    proof = (d["id"], d["lease_epoch"], body["lease_secret"])
                    new = self.inbox.store(event, proof)
                    sent[await ack(ws, sid, proof)] = proof
                    if self.args.verbose:
                        print("stored" if new else "already stored", event["id"], "sequence",
                              event["sequence"], "type", event["type"], flush=True)
                elif kind == "ack" and frame.get("reply_to") in sent:
                    self.inbox.settled(sent.pop(frame["reply_to"]))
                elif kind == "error":
                    code, proof = frame["error"]["code"], sent.pop(frame.get("reply_to"), None)
                    message = f"{code}: {frame['error']['message']}"
                    if proof and code in ("DELIVERY_LEASE_LOST", "NOT_FOUND", "INVALID_ARGUMENT"):
                        # This proof can never succeed. A lost lease's event comes again
                        # with a new proof; a NOT_FOUND closes the connection with 1008.
                        self.inbox.settled(proof)
                        close_expected = code == "NOT_FOUND"
                        log(f"ACK of delivery {proof[0]} refused: {message}")
                    elif code in REFUSALS:
                        raise Refused(message)
                    else:  # UNAVAILABLE: 1011 follows, then a reconnection
                        log(message)
        finally:
            for task in tasks:
                task.cancel()

    async def close_on_stop(self, ws, sent):
        await self.stop.wait()
        # Give the ACKs on their way 5 s to be confirmed (their proofs stay kept).
        for _ in range(50):
            if not sent:
                break
            await asyncio.sleep(0.1)
        await ws.close(1000, "the consumer is stopping")


async def heartbeat(ws, sid, interval):
    # Deliveries do not keep a session alive: 60 s without a frame from us ends it.
    try:
        while True:
            await asyncio.sleep(interval)
            await send(ws, "events.ping", sid, {})
    except ConnectionClosed:
        pass  # the session's reader sees the close


async def send(ws, kind, sid, body):
    """Sends one frame; returns its message id."""
    message_id = secrets.token_hex(16)
    frame = {"protocol_version": "1", "type": kind, "message_id": message_id, "body": body}
    if sid:
        frame["session_id"] = sid
    await ws.send(json.dumps(frame))
    return message_id


async def ack(ws, sid, proof):
    delivery_id, epoch, lease_secret = proof
    body = {"delivery_id": delivery_id, "epoch": epoch, "lease_secret": lease_secret}
    return await send(ws, "event.ack", sid, body)


async def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=(
        "The node's URL comes from ORBIT_EVENTS_URL (default http://127.0.0.1:8080), the "
        "token of a credential with events:consume from ORBIT_EVENTS_TOKEN."))
    parser.add_argument("--subscription", required=True, help="the subscription's id")
    parser.add_argument("--inbox", default="inbox.db", help="the SQLite Inbox file (inbox.db)")
    parser.add_argument("--capacity", type=int, default=8, choices=range(1, 33), metavar="1-32",
                        help="deliveries held at once (8)")
    parser.add_argument("--verbose", action="store_true", help="one line per event on stdout")
    args = parser.parse_args()
    token = os.environ.get("ORBIT_EVENTS_TOKEN")
    if not token:
        parser.error("set ORBIT_EVENTS_TOKEN to the token of a credential with events:consume")
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    inbox = Inbox(args.inbox)
    log(f"subscription {args.subscription} into {args.inbox} (Ctrl-C stops)")
    status = await Consumer(args, token, inbox, stop).run()
    log(f"stopped; {len(inbox.unconfirmed())} unconfirmed ACKs kept for the next start")
    return status


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
