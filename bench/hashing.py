"""How long deriving a key from a ~1 MiB payload takes, against json.dumps + SHA-256.

Run: ``python bench/hashing.py [--rounds N]``. Each case takes N turns with
the baseline; its row gives both medians and the median of the per-turn
ratios. The target for ``Payload().key`` is a ratio of at most 2.0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_unique.keys.payload import Payload

TARGET_BYTES = 1 << 20


def build_payload(target_bytes: int = TARGET_BYTES) -> dict[str, Any]:
    """An order import: a few scalars, nested objects, and a long list of line items."""
    rng = random.Random(20240101)
    items: list[dict[str, Any]] = []
    payload: dict[str, Any] = {
        "tenant_id": 7,
        "import_id": "imp-4f1c2a",
        "requested_at": "2024-01-01T12:00:00.000000+00:00",
        "source": {"kind": "csv", "file": "orders-2024-01.csv", "rows": None},
        "customer": {
            "id": 421,
            "email": "buyer@example.com",
            "name": "Zoë Brontë",
            "roles": ["buyer", "approver"],
            "address": {"street": "1 Rue de l'Église", "city": "Zürich", "zip": "8001"},
        },
        "items": items,
    }
    size = len(json.dumps(payload))
    while size < target_bytes:
        number = len(items)
        item = {
            "sku": f"SKU-{number:07d}",
            "name": f"Widget {number} — {rng.choice(['red', 'blue', 'green'])}",
            "quantity": rng.randint(1, 50),
            "unit_price": round(rng.uniform(0.5, 500), 2),
            "discount": rng.choice([None, 0.05, 0.1]),
            "in_stock": rng.random() > 0.2,
            "tags": [f"tag-{rng.randint(0, 99)}" for _ in range(rng.randint(0, 4))],
            "attributes": {
                "weight_kg": round(rng.uniform(0.1, 20), 3),
                "dimensions_cm": [rng.randint(1, 100) for _ in range(3)],
                "note": 'fragile, "this side up"\n' if number % 7 == 0 else "",
            },
        }
        items.append(item)
        size += len(json.dumps(item)) + 2
    return payload


def _timed(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def compare(
    baseline: Callable[[], object], function: Callable[[], object], rounds: int
) -> tuple[float, float, float]:
    """Median seconds of ``baseline`` and of ``function``, and the median of their ratio.

    The two take turns (which goes first alternates), after one untimed warm-up
    call each, so a busy moment of the machine falls on both and the ratio is
    taken within each turn.
    """
    baseline()
    function()
    base_times, times = [], []
    for turn in range(rounds):
        if turn % 2:
            times.append(_timed(function))
            base_times.append(_timed(baseline))
        else:
            base_times.append(_timed(baseline))
            times.append(_timed(function))
    ratios = [timed / base for timed, base in zip(times, base_times, strict=True)]
    return statistics.median(base_times), statistics.median(times), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31, help="timed rounds per row")
    rounds = parser.parse_args().rounds

    payload = build_payload()
    whole = Payload()
    some = Payload(only=[".tenant_id", ".customer.id", ".items[0].sku", ".items[-1].sku"])
    most = Payload(exclude=[".requested_at", ".import_id"])
    cases: list[tuple[str, Callable[[], object]]] = [
        (
            "json.dumps + sha256 (baseline)",
            lambda: hashlib.sha256(json.dumps(payload).encode()).hexdigest(),
        ),
        ("Payload().key", lambda: whole.key(payload, "orders.import")),
        ("Payload(exclude=[2 paths]).key", lambda: most.key(payload, "orders.import")),
        ("Payload(only=[4 paths]).key", lambda: some.key(payload, "orders.import")),
    ]

    size = len(json.dumps(payload).encode())
    print(f"payload: {size:,} bytes of JSON, {len(payload['items']):,} items; {rounds} rounds")
    print(f"{'case':<34} {'median ms':>10} {'ratio':>7}  (each case in turns with the baseline)")
    (_, baseline), *rest = cases
    for name, function in rest:
        base_seconds, seconds, ratio = compare(baseline, function, rounds)
        print(f"{'  baseline, in these turns':<34} {base_seconds * 1e3:>10.3f}")
        print(f"{name:<34} {seconds * 1e3:>10.3f} {ratio:>7.2f}")


if __name__ == "__main__":
    main()
