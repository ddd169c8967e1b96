"""What a Redis broker's append-only file says became of each task message.

kombu's Redis transport delivers a message in two steps: it pops the message
off the queue's list, then records it as unacknowledged (``HSET unacked``)
with a second command. A broker restarted, or a consumer killed or cut off,
between the two loses the message: no worker ever sees it, and nothing is
left in the broker to redeliver. The broker's append-only file (written with
``appendfsync always``, never rewritten) shows it: replaying its pushes and
pops, the message was taken off its list after its last push and never
recorded as unacknowledged. Replayed, not guessed from the last command that
names the message: a message still waiting in a list at the end is not lost
(a run whose queue never empties must not hide the messages lost meanwhile).
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Iterator
from pathlib import Path

_PUSHES = {b"LPUSH", b"RPUSH"}
#: How a blocking pop (BRPOP) is written to the append-only file, too.
_POPS = {b"RPOP", b"LPOP"}


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
    """Each task message's last state in the broker's log: pushed, popped, taken or removed.

    ``pushed``: waiting in its list; ``popped``: taken off its list and not
    (yet) recorded as unacknowledged; ``taken``: recorded as unacknowledged;
    ``removed``: its unacknowledged entry deleted (acknowledged, rejected, or
    restored, with a push after it).
    """
    last: dict[str, str] = {}
    tags: dict[bytes, str] = {}
    # Each list as the broker holds it: the id of each message, head first (kombu
    # pushes at the head and pops from the tail; a restore pushes at either end).
    lists: dict[bytes, deque[str | None]] = defaultdict(deque)
    for path in sorted(aof_dir.glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3])):
        for command in commands(path.read_bytes()):
            name = command[0].upper()
            if name in _PUSHES:
                for value in command[2:]:
                    job = _task_id(value)
                    if name == b"LPUSH":
                        lists[command[1]].appendleft(job)
                    else:
                        lists[command[1]].append(job)
                    if job is not None:
                        last[job] = "pushed"
            elif name in _POPS:
                held = lists[command[1]]
                for _ in range(int(command[2]) if len(command) > 2 else 1):
                    job = (held.pop() if name == b"RPOP" else held.popleft()) if held else None
                    if job is not None and last.get(job) == "pushed":
                        last[job] = "popped"
            elif name == b"DEL":
                for key in command[1:]:
                    lists.pop(key, None)
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
    """Ids of task messages taken off their list after their last push and never recorded
    as unacknowledged (``states`` from :func:`message_states`)."""
    return {job for job, state in states.items() if state == "popped"}


def removed_unacknowledged(states: dict[str, str]) -> set[str]:
    """Ids of task messages whose last delivery left the broker, with no push after it
    (``states`` from :func:`message_states`).

    For a job that ended, that is its acknowledgement. For a job whose last run
    asked for its message to be requeued (``Reject(requeue=True)``), it is a
    requeue the transport never carried out: kombu deleted the unacknowledged
    entry and pushed nothing back.
    """
    return {job for job, state in states.items() if state == "removed"}
