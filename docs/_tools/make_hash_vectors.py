"""Write docs/hash-vectors.json from the cases below: ``python docs/_tools/make_hash_vectors.py``.

The vectors test re-derives every field and checks this script still writes
the committed file byte for byte, so the file can only change through here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(DOCS.parent))

from celery_unique.keys.canonical import canonical_bytes  # noqa: E402
from celery_unique.keys.paths import Selection, parse_path  # noqa: E402
from celery_unique.keys.payload import Payload  # noqa: E402

TARGET = DOCS / "hash-vectors.json"

ORDER = {"order": {"id": 9, "lines": [{"sku": "A-1", "qty": 1}, {"sku": "B-2", "qty": 2}]}}
NAMES = {"first name": "Ada", "e-mail": "ada@example.com", "id": 1, "a.b": "dotted"}
USER = {"user_id": 42, "template": "welcome"}
FLOATS = [0.1, 1.5, 1.0, -0.0, 0.0, 1e16, 1e15, 1.5e-07, 0.0001, 1e-05, 123456789.125, 1e300]
MARKER = {"__type__": "datetime", "__value__": "2024-01-02T03:04:05"}


def case(
    name: str,
    payload: dict[str, Any],
    only: list[str] | None = None,
    exclude: list[str] | None = None,
    task_name: str | None = "t",
    prefix: bool = True,
) -> dict[str, Any]:
    return {
        "name": name,
        "payload": payload,
        "only": only,
        "exclude": exclude,
        "task_name": task_name,
        "prefix": prefix,
    }


CASES = [
    case("whole payload", USER, task_name="shop.send_email"),
    case("key order is irrelevant", dict(reversed(USER.items())), task_name="shop.send_email"),
    case("prefix=False", USER, task_name="shop.send_email", prefix=False),
    case("no task name", USER, task_name=None),
    case("empty payload", {}, task_name="reports.rebuild"),
    case("empty containers and null", {"list": [], "object": {}, "null": None, "string": ""}),
    case("unicode", {"name": "Zoë", "city": "東京", "emoji": "😀", "math": "∑"}),
    case("escapes", {"text": 'quote " backslash \\ / newline \n tab \t nul \u0000 del \u007f'}),
    case("keys sort by code point", {"😀": 1, "\uff5e": 2, "a": 3, "": 4, "B": 5, "é": 6}),
    case("nested objects and lists", ORDER, task_name="orders.ship"),
    case("only a nested key", ORDER, [".order.id"]),
    case("only an element's key", ORDER, [".order.lines[0].sku"]),
    case("negative index", ORDER, [".order.lines[-1]"]),
    case("indexes listed out of order", ORDER, [".order.lines[1].qty", ".order.lines[0].sku"]),
    case("index out of range is skipped", ORDER, [".order.lines[5]", ".order.id"]),
    case("0 and -1 reach one element", {"steps": ["only"]}, [".steps[0]", ".steps[-1]"]),
    case("quoted keys", NAMES, ['."first name"', '.["e-mail"]', '."a.b"']),
    case("missing optional path is skipped", {"user_id": 42}, [".user_id", ".coupon"]),
    case("no path matches", {"user_id": 42}, [".coupon", ".user_id.x", ".user_id[0]"]),
    case(
        "exclude a timestamp",
        {**USER, "requested_at": "2024-05-01T10:00Z"},
        None,
        [".requested_at"],
    ),
    case("exclude a list element", {"tags": ["tmp", "a", "b"], "id": 3}, None, [".tags[0]", ".x"]),
    case(
        "only then exclude",
        {"user": {"id": 1, "session": "s-9"}, "ts": 5},
        [".user"],
        [".user.session"],
    ),
    case("floats", {"values": [*FLOATS, 5e-324, -2.5e-300]}),
    case("big integers", {"big": 123456789012345678901234567890, "u64": 18446744073709551615}),
    case("true", {"value": True}),
    case("integer 1", {"value": 1}),
    case("float 1.0", {"value": 1.0}),
    case("string '1'", {"value": "1"}),
    case("*args list and kombu markers", {"args": [1, "two"], "when": MARKER}, [".args", ".when"]),
]


def build_vectors() -> dict[str, Any]:
    """The whole document: a header and one vector per case."""
    vectors = []
    for fields in CASES:
        only, exclude = fields["only"], fields["exclude"]
        spec = Payload(only=only, exclude=exclude, prefix=fields["prefix"])
        selection = Selection(
            None if only is None else [parse_path(text) for text in only],
            None if exclude is None else [parse_path(text) for text in exclude],
        )
        selected = selection.apply(fields["payload"])
        vectors.append(
            {
                **fields,
                "canonical": canonical_bytes(selected).decode("ascii"),
                "digest": spec.digest(fields["payload"]),
                "key": spec.key(fields["payload"], fields["task_name"]),
            }
        )
    return {
        "algorithm": "cu1",
        "about": "Test vectors for celery-unique payload keys; see keys-and-hashing.md.",
        "vectors": vectors,
    }


def render() -> str:
    """The file's text: two-space indented JSON, non-ASCII characters as themselves."""
    return json.dumps(build_vectors(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render(), encoding="utf-8")
    print(f"wrote {len(CASES)} vectors to {TARGET}")
