"""The decide call's own command packer says exactly what redis-py's would."""

from __future__ import annotations

import redis
from hypothesis import given
from hypothesis import strategies as st

from celery_unique.stores.redis import resp_command

# Keys and arguments are validated text (no lone surrogates) and integers.
parts = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",))),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@given(st.sampled_from(["EVALSHA", "EVAL"]), st.lists(parts, max_size=30))
def test_packs_like_redis_py(command: str, arguments: list[str | int]) -> None:
    expected = b"".join(redis.Connection().pack_command(command, *arguments))
    assert resp_command(command, *arguments) == expected


def test_a_large_argument_is_one_bulk_string() -> None:
    """redis-py splits big values into several buffers; the bytes on the wire are the same."""
    big = "x" * 100_000
    assert resp_command("SET", "k", big) == b"".join(
        redis.Connection().pack_command("SET", "k", big)
    )
