"""Optuna storages for studies: SQLite by default, PostgreSQL (or any SQLAlchemy URL) for many machines,
Optuna's journal file for many processes on one machine; heartbeats for crash recovery."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

JOURNAL_PREFIX = "journal:"


def default_storage(study_name: str, studies_dir: Path) -> str:
    return f"sqlite:///{(studies_dir / f'{study_name}.db').as_posix()}"


@dataclass(frozen=True)
class Heartbeat:
    """RDB storages only: a worker killed mid-trial stops beating; after `grace_s` another worker
    fails its trial and re-enqueues it, at most `max_retries` times."""

    interval_s: int = 60
    grace_s: int = 180
    max_retries: int = 2


def make_storage(url: str, heartbeat: Heartbeat | None = None) -> optuna.storages.BaseStorage:
    """An Optuna storage from a URL: any SQLAlchemy URL (sqlite:///..., postgresql+psycopg2://...), or
    `journal:<path>` for Optuna's journal file (several processes on one machine, no heartbeats)."""
    if url.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len(JOURNAL_PREFIX):])
        if not path.parent.is_dir():
            raise ValueError(f"journal storage {url!r}: folder {str(path.parent)!r} does not exist")
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if "://" not in url:
        raise ValueError(f"storage {url!r} is not a URL: use sqlite:///path.db, postgresql+psycopg2://user:pw@host/db "
                         f"or {JOURNAL_PREFIX}path.log")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            options: dict[str, Any] = {}
            if heartbeat is not None:
                options = dict(
                    heartbeat_interval=heartbeat.interval_s, grace_period=heartbeat.grace_s,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                        max_retry=heartbeat.max_retries),
                )
            return optuna.storages.RDBStorage(url, engine_kwargs=_engine_options(url), **options)
    except ImportError as error:
        raise ValueError(f"storage {_redact(url)!r} needs a database driver that is not installed ({error})") from None
    except Exception as error:  # SQLAlchemy's errors: bad URL, unreachable server, bad credentials
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot open storage {_redact(url)!r}: {reason}") from None


def _engine_options(url: str) -> dict[str, Any]:
    # A wrong host should fail in seconds, not after the driver's default minutes.
    return {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def load_study(study_name: str, storage: str | optuna.storages.BaseStorage, **kwargs: Any) -> optuna.Study:
    if isinstance(storage, str):
        storage = make_storage(storage)
    try:
        return optuna.load_study(study_name=study_name, storage=storage, **kwargs)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        known = f": studies there are {', '.join(names)}" if names else ": that storage holds no study"
        raise ValueError(f"no study named {study_name!r} in that storage{known}") from None
