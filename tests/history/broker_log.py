"""What a Redis broker's append-only file says became of each task message.

kombu's Redis transport delivers a message in two steps: it pops the message
off the queue's list, then records it as unacknowledged (``HSET unacked``)
with a second command. A broker restarted, or a consumer killed or cut off,
between the two loses the message: no worker ever sees it, and nothing is
left in the broker to redeliver. The broker's append-only file (written with
``appendfsync always``, never rewritten) shows it: the message was pushed
and, after its last push, never recorded as unacknowledged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

_PUSHES = {b"LPUSH", b"RPUSH"}


def commands(data: bytes) -> Iterator[list[bytes]]:
    """The commands of an append-only file's RESP stream, in order."""
    at, end = 0, len(data)
    while at < end:
        line_end = data.index(b"\r\n", at)
        line, at = data[at:line_end], line_end + 2
        if not line.startswith(b"*"):
            continue
        args = []
        for _ in range(int(line[1:])):
            size_end = data.index(b"\r\n", at)
            size = int(data[at + 1 : size_end])
            at = size_end + 2
            args.append(data[at : at + size])
            at += size + 2
        yield args


def _task_id(raw: bytes | str) -> str | None:
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    if isinstance(message, list):  # an unacknowledged entry: [message, exchange, routing key]
        message = json.loads(message[0]) if isinstance(message[0], str) else message[0]
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers.get("id") if isinstance(headers, dict) else None


def message_states(aof_dir: Path) -> dict[str, str]:
    """Each task message's last state in the broker's log: pushed, taken or removed.

    ``taken``: recorded as unacknowledged; ``removed``: its unacknowledged
    entry deleted (acknowledged, rejected, or restored, with a push after it).
    """
    last: dict[str, str] = {}
    tags: dict[bytes, str] = {}
    for path in sorted(aof_dir.glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3])):
        for command in commands(path.read_bytes()):
            name = command[0].upper()
            if name in _PUSHES:
                for value in command[2:]:
                    if (job := _task_id(value)) is not None:
                        last[job] = "pushed"
            elif name == b"HSET" and command[1] == b"unacked":
                for tag, value in zip(command[2::2], command[3::2], strict=False):
                    if (job := _task_id(value)) is not None:
                        last[job], tags[tag] = "taken", job
            elif name == b"HDEL" and command[1] == b"unacked":
                for tag in command[2:]:
                    job = tags.pop(tag, None)
                    if job is not None and last.get(job) == "taken":
                        last[job] = "removed"
    return last


def lost_in_transport(states: dict[str, str]) -> set[str]:
    """Ids of task messages last pushed and then never recorded as unacknowledged
    (``states`` from :func:`message_states`).

    Only meaningful once the queues are empty: a message still waiting in a
    list has that shape too.
    """
    return {job for job, state in states.items() if state == "pushed"}


def removed_unacknowledged(states: dict[str, str]) -> set[str]:
    """Ids of task messages whose last delivery left the broker, with no push after it
    (``states`` from :func:`message_states`).

    For a job that ended, that is its acknowledgement. For a job whose last run
    asked for its message to be requeued (``Reject(requeue=True)``), it is a
    requeue the transport never carried out: kombu deleted the unacknowledged
    entry and pushed nothing back.
    """
    return {job for job, state in states.items() if state == "removed"}
