"""Every check: its id, its severity, what it finds and how to fix it (the docs' table)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_unique.exceptions import InvalidDeclaration
from celery_unique.stores import STORES
from celery_unique.stores.masking import redacted


class Level(enum.Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Check:
    id: str
    level: Level
    finds: str
    fix: str


@dataclass(frozen=True)
class Finding:
    """One misconfiguration found: which check, about what, and what to do."""

    id: str
    level: Level
    #: The task, setting or worker it is about.
    subject: str
    message: str
    hint: str

    @property
    def is_error(self) -> bool:
        return self.level is Level.ERROR

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "level": self.level.value,
            "subject": self.subject,
            "message": self.message,
            "hint": self.hint,
        }


def _checks(*checks: Check) -> dict[str, Check]:
    return {check.id: check for check in checks}


E, W = Level.ERROR, Level.WARNING

#: The checks every entry point runs (Django adds its own E002-E011 and W001).
CATALOGUE = _checks(
    Check(
        "celery_unique.E001",
        E,
        "`unique_backend` is not a store URL with a known scheme or cannot be used as written "
        "(with `--deploy` or a store check), or it is not set and the broker is not Redis "
        "(whose URL would be the store's): every unique dispatch fails",
        "use a URL of a known scheme: " + ", ".join(f"`{scheme}://`" for scheme in STORES),
    ),
    Check(
        "celery_unique.E012",
        E,
        "the store cannot be reached, or refuses what its settings ask (a database it does "
        "not have, an ACL refusal); fail-closed: unique dispatches fail",
        "start the store or correct `unique_backend` (the URL is shown, password masked)",
    ),
    Check(
        "celery_unique.W012",
        W,
        "the store cannot be reached (fail-open: dispatches go out without uniqueness)",
        "start the store or correct `unique_backend`",
    ),
    Check(
        "celery_unique.E013",
        E,
        "a check could not finish: it raised (the store refused a command, a task module "
        "does not import, ...), so whether what it looks for is wrong is unknown",
        "correct what the message names and check again; a store that refuses a command "
        "(`NOPERM`) must let its user run every command celery-unique sends",
    ),
    Check(
        "celery_unique.E014",
        E,
        "a task's uniqueness options are malformed (`invalid_declaration`): the task cannot "
        "be defined, and a task of `@shared_task` fails at its first dispatch instead",
        "correct the option the message names",
    ),
    Check(
        "celery_unique.E020",
        E,
        "a task has `unique_*` options but is not a `UniqueTask`: Celery keeps unknown "
        "options as attributes and every dispatch publishes",
        "declare it with `base=UniqueTask` (or mix `UniqueMixin` into its class), or set "
        "`task_cls` on the app",
    ),
    Check(
        "celery_unique.W021",
        W,
        "`unique_lease` is shorter than the broker's redelivery window (`visibility_timeout` "
        "on Redis and SQS, one hour by default): the key of a job whose worker was lost "
        "can lapse before the job is delivered again, and a new job takes it",
        "raise `unique_lease` to at least the `visibility_timeout`, or lower the timeout",
    ),
    Check(
        "celery_unique.W022",
        W,
        "an `exists` task keeps its key longer than Celery keeps results (`result_expires`): "
        "the reaper cannot tell whether an old job finished",
        "keep `unique_retention` at most `result_expires`, or keep results longer",
    ),
    Check(
        "celery_unique.W023",
        W,
        "a task with an `active` or `exists` key stores no result (`ignore_result`, or the "
        "app has no result backend): the reaper cannot free keys whose release was lost, "
        "they wait for the lease",
        "configure a result backend and let the task store its state, or accept the lease "
        "as the bound",
    ),
    Check(
        "celery_unique.W025",
        W,
        "another app uses the same key namespace on the same store: equal task names and "
        "shared keys would collide",
        "give each app its own `unique_namespace`",
    ),
    Check(
        "celery_unique.E026",
        E,
        "the Redis store may evict keys (`maxmemory` with an evicting `maxmemory-policy`): "
        "an evicted active key admits a duplicate, an evicted window key forgets a request",
        "set `maxmemory-policy noeviction` on the store (or use a Redis of its own for it)",
    ),
    Check(
        "celery_unique.W027",
        W,
        "a running worker answers without the plugin (a mixed fleet): jobs it runs keep "
        "their keys until the lease",
        "deploy the same code, with celery-unique, to every worker of the app",
    ),
    Check(
        "celery_unique.W028",
        W,
        "the broker is RabbitMQ without publisher confirms: a message published as the "
        "broker stops can be lost without an error, and its key stays with a job that "
        "never runs until the lease",
        "set `broker_transport_options = {'confirm_publish': True}`",
    ),
    Check(
        "celery_unique.W029",
        W,
        "the Redis store refuses `CONFIG GET` (an ACL user without it, or a renamed "
        "command): whether it evicts keys (E026) cannot be checked",
        "make sure the store's `maxmemory-policy` is `noeviction` in the server's or "
        "service's settings",
    ),
    Check(
        "celery_unique.W030",
        W,
        "a task follows its duplicates (`unique_on_duplicate` `latest` or `debounce`) but "
        "`unique_signing_key` is not set (nor, in Django, derived from `SECRET_KEY`): the "
        "arguments its key keeps are signed with a key anyone can derive, so whoever can "
        "write the store can choose the arguments the task runs with",
        "set `unique_signing_key` to the same secret on every producer and worker of the app",
    ),
)


def finding(check_id: str, subject: str, message: str, hint: str | None = None) -> Finding:
    """A finding of the catalogue's check ``check_id``; its fix is the hint unless given."""
    check = CATALOGUE[check_id]
    return Finding(check_id, check.level, subject, message, hint or check.fix.replace("`", ""))


def unfinished(
    covers: str, subject: str, error: BaseException, url: str | None, hint: str | None = None
) -> Finding:
    """E013: the check for ``covers`` (its ids) raised ``error``; ``url``'s password is masked."""
    return finding(
        "celery_unique.E013",
        subject,
        f"the check for {covers} could not finish, so whether it applies is unknown: "
        f"{type(error).__name__}: {redacted(str(error), url)}",
        hint,
    )


def invalid_declaration(error: InvalidDeclaration) -> Finding:
    """E014: a task's declaration was refused as it was defined; named if the task is known."""
    task = declaring_task(error)
    return finding(
        "celery_unique.E014",
        task or "tasks",
        f"task {task or '(name unknown)'} is declared with invalid uniqueness options "
        f"({error.code}): {error}",
        "correct the option the message names in the task's declaration "
        "(@app.task(...) or @shared_task(...)); the task cannot be defined until then",
    )


def declaring_task(error: BaseException) -> str | None:
    """The name of the task whose class was being created when ``error`` was raised.

    Celery creates a task's class when the app is finalized (for ``@shared_task``, or
    ``@app.task`` before it); the class refuses its options as it is created, in
    ``__init_subclass__``, whose frame still holds the class.
    """
    tb = error.__traceback__
    name = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init_subclass__":
            name = getattr(frame.f_locals.get("cls"), "name", None) or name
        tb = tb.tb_next
    return name if isinstance(name, str) else None


def isolated(
    covers: str,
    subject: str,
    check: Callable[..., list[Finding]],
    *args: Any,
    url: str | None = None,
) -> list[Finding]:
    """``check(*args)``; one that raises is a finding of its own (E013), so the others report."""
    try:
        return check(*args)
    except InvalidDeclaration as exc:  # A task defined as the check read the app's tasks.
        return [invalid_declaration(exc)]
    except Exception as exc:  # A bug, a refused command: never the end of every other check.
        return [unfinished(covers, subject, exc, url)]
