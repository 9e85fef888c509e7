#!/usr/bin/env python3
"""A producer that appends its task's result in its own PostgreSQL transaction.

The transactional outbox of orbit-events (docs/outbox.md): the task's own
row and its result commit together or not at all, through the SQL function
orbit_events.append_result, which a producer role may call with no right
on the service's tables. A retried transaction with the same idempotency
key appends once.

    python outbox_producer.py --database postgres://producer@host/db \
        --queue QUEUE_ID --task TASK_ID --revision 2 [--fail]

It writes the task into the table `tasks (id text primary key, revision
bigint, state text)` (yours; the example does not create it), appends a
task.succeeded result for it and commits; with --fail it raises after the
append, so the transaction rolls back and neither exists. Prints one JSON
line: the appended event's id, its sequence and whether the key had
already appended it.
"""

import argparse
import json
import sys
from datetime import datetime, timezone

import psycopg


def result_for(queue_id, task_id, revision, occurred_at):
    """One result, as an element of POST /v1/queues/{id}/results takes it."""
    return {
        "type": "task.succeeded",
        "aggregate_id": task_id,
        "aggregate_revision": str(revision),
        "occurred_at": occurred_at,
        "details": {"state": "SUCCEEDED"},
        "snapshot": {
            "schema_version": 1,
            "task_id": task_id,
            "queue_id": queue_id,
            "state": "SUCCEEDED",
            "revision": str(revision),
            "effect_uncertain": False,
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", required=True, help="PostgreSQL URL of the node's database")
    parser.add_argument("--queue", required=True, help="the queue id (32 hex characters)")
    parser.add_argument("--task", required=True, help="the task id (32 hex characters)")
    parser.add_argument("--revision", type=int, default=1)
    parser.add_argument(
        "--occurred-at",
        default=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        help="when the task finished (RFC 3339; default now); a retry must send the same",
    )
    parser.add_argument("--fail", action="store_true", help="fail after the append (rollback)")
    args = parser.parse_args()

    # The key names this task's revision: running the same transaction
    # again after a lost COMMIT, with the same result, appends nothing new
    # (another result under the key is IDEMPOTENCY_CONFLICT).
    key = f"task-{args.task}-rev-{args.revision}"
    text = json.dumps(result_for(args.queue, args.task, args.revision, args.occurred_at))
    try:
        with psycopg.connect(args.database) as conn:
            with conn.transaction():
                conn.execute(
                    "INSERT INTO tasks (id, revision, state) VALUES (%s, %s, 'SUCCEEDED') "
                    "ON CONFLICT (id) DO UPDATE SET revision = EXCLUDED.revision, state = EXCLUDED.state",
                    (args.task, args.revision),
                )
                event_id, sequence, deduplicated = conn.execute(
                    "SELECT event_id, sequence, deduplicated FROM orbit_events.append_result(%s, %s, %s)",
                    (args.queue, text, key),
                ).fetchone()
                if args.fail:
                    raise RuntimeError("failing after the append, as asked: nothing is committed")
    except psycopg.Error as e:
        # The message starts with the spec's code: INVALID_ARGUMENT: result.…
        print(f"outbox_producer: {e.diag.message_primary}", file=sys.stderr)
        return 3
    except RuntimeError as e:
        print(f"outbox_producer: {e}", file=sys.stderr)
        return 4
    print(json.dumps({"event_id": event_id, "sequence": sequence, "deduplicated": deduplicated}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
