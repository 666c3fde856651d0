"""Optuna storages for studies: SQLite by default, PostgreSQL (or any SQLAlchemy URL) for many machines,
Optuna's journal file for many processes on one machine; heartbeats for crash recovery."""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..io.errors import first_line, resource_error
from ..io.files import process_alive, read_json

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


def make_storage(url: str, heartbeat: Heartbeat | None = None, must_exist: bool = False) -> optuna.storages.BaseStorage:
    """An Optuna storage from a URL: any SQLAlchemy URL (sqlite:///..., postgresql+psycopg2://...), or
    `journal:<path>` for Optuna's journal file (several processes on one machine, no heartbeats).

    With `must_exist` (read-only commands) nothing is created: the file or the Optuna tables must be there.
    A database that holds tables other than Optuna's is refused, so that Optuna never adds its tables to it.
    """
    if url.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len(JOURNAL_PREFIX):])
        if path.is_dir():
            raise ValueError(f"journal storage {url!r} is a folder: name a file, e.g. {JOURNAL_PREFIX}study.log")
        if must_exist and not path.is_file():
            raise ValueError(f"journal storage {url!r}: no such file")
        if not path.parent.is_dir():
            raise ValueError(f"journal storage {url!r}: folder {str(path.parent)!r} does not exist")
        if not must_exist:
            _check_writable(path, f"journal storage {url!r}")
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        except ValueError:  # json's errors, which name no line of the file: find the line
            raise ValueError(f"{_damaged_line(path)}: restore the journal from a backup, or delete that line (the "
                             "operation it held is lost)") from None
    if "://" not in url:
        raise ValueError(f"storage {redact_url(url)!r} is not a URL: use sqlite:///path.db, "
                         f"postgresql+psycopg2://user:pw@host/db or {JOURNAL_PREFIX}path.log")
    try:
        _check_database(url, must_exist)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            options: dict[str, Any] = {}
            if heartbeat is not None:
                options = dict(
                    heartbeat_interval=heartbeat.interval_s, grace_period=heartbeat.grace_s,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                        max_retry=heartbeat.max_retries),
                )
            return _open_rdb(url, must_exist, options)
    except ImportError as error:
        raise ValueError(f"storage {redact_url(url)!r} needs a database driver that is not installed "
                         f"({redact_text(str(error), url)})") from None
    except ValueError:
        raise
    except Exception as error:  # SQLAlchemy's errors: bad URL, unreachable server, bad credentials, a full disk
        full = resource_error(error, f"opening storage {redact_url(url)!r}")
        if full is not None:
            raise full from None
        raise ValueError(f"cannot open storage {redact_url(url)!r}: {redact_text(first_line(error), url)}") from None


def _damaged_line(path: Path) -> str:
    """The first line of a journal file that is not JSON, as `read_json` names it (Optuna's reader does not)."""
    try:
        read_json(path, "journal storage", lines=True)
    except ValueError as error:
        return str(error)
    return f"journal storage {str(path)!r} is damaged"


def _check_writable(path: Path, what: str) -> None:
    """A study file that exists must be writable by this process, and its folder too (SQLite writes its journal
    beside it): refused before anything is run, not when the first trial ends."""
    for place in (path, path.parent):
        if place.exists() and not os.access(place, os.W_OK):
            raise ValueError(f"{what}: {str(place)!r} is read-only, and `optimize` adds trials to it: make it "
                             "writable, or copy the study somewhere writable and give that --storage "
                             "(`export` and `plot` read it as it is)")


class _RDBStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage whose stale trials say why they failed: whoever fails them (Optuna, at the start of each
    trial, or a worker waiting on the study's last trials) asks for their ids first, and is answered after each
    got a `fail_reason`."""

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        grace = self.grace_period or 2 * self.get_heartbeat_interval()
        stale = super()._get_stale_trial_ids(study_id)
        stale += [i for i in self._never_beating(study_id, grace) if i not in stale]
        for trial_id in stale:
            worker = self.get_trial_user_attrs(trial_id).get(WORKER_ATTR, "an unknown worker")
            try:
                self.set_trial_user_attr(trial_id, "fail_reason",
                                         f"worker lost: {worker} sent no heartbeat for {grace} s (killed?)")
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another worker failed it first
        return stale

    def _never_beating(self, study_id: int, grace: float) -> list[int]:
        """Running trials that began over `grace` seconds ago and never sent a heartbeat: their worker was killed
        between creating the trial and its first beat. Optuna never counts a trial without a heartbeat stale, so a
        re-run would wait on it forever (seen under load in tests/test_faults.py). A live worker beats within
        moments of creating its trial, so the creating worker's clock (`datetime_start`) is precise enough here."""
        from optuna.storages._rdb.models import TrialHeartbeatModel

        began_before = datetime.now() - timedelta(seconds=grace)
        old = [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
               if t.datetime_start is not None and t.datetime_start < began_before]
        if not old:
            return []
        session = self.scoped_session()
        try:
            beating = {row.trial_id for row in session.query(TrialHeartbeatModel.trial_id)
                       .filter(TrialHeartbeatModel.trial_id.in_(old))}
        finally:
            session.close()
        return [i for i in old if i not in beating]


def _begin_immediately(engine: Any) -> None:
    """On SQLite, make every transaction take the write lock when it begins (BEGIN IMMEDIATE, SQLAlchemy's recipe for
    pysqlite). The driver otherwise begins a transaction only at the first write, so two processes could both read a
    trial as WAITING and both run it ("Cannot tell a COMPLETE trial"): Optuna's SELECT ... FOR UPDATE, which
    prevents that on other databases, means nothing to SQLite."""
    import sqlalchemy

    def on_connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # no implicit BEGIN from the driver: ours below instead

    def on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    sqlalchemy.event.listen(engine, "connect", on_connect)
    sqlalchemy.event.listen(engine, "begin", on_begin)
    engine.dispose()  # the connections Optuna opened while creating its tables predate the hooks


def _open_rdb(url: str, must_exist: bool, options: dict[str, Any], attempts: int = 5) -> optuna.storages.RDBStorage:
    """Workers started together on a new database all create Optuna's tables at once; the losers of that race get
    a unique-key error (PostgreSQL) or "table ... already exists" (SQLite). The tables exist by then, so a short
    wait and a retry opens them."""
    import sqlalchemy.exc

    for attempt in range(attempts):
        try:
            storage = _RDBStorage(url, engine_kwargs=_engine_options(url), skip_table_creation=must_exist, **options)
            if storage.engine.dialect.name == "sqlite" and not must_exist:  # readers take no lock
                _begin_immediately(storage.engine)
            return storage
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError) \
                as error:
            racing = not isinstance(error, sqlalchemy.exc.OperationalError) or "already exists" in str(error)
            if not racing or attempt == attempts - 1:
                raise
            time.sleep(0.5 + random.random())


def _check_database(url: str, must_exist: bool) -> None:
    """Refuse, before Optuna creates anything, a missing database (when it must exist) or one holding other tables."""
    import sqlalchemy
    from optuna.storages._rdb.models import BaseModel

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except ValueError as error:  # a port that is not a number, say: the message must not echo the URL
        raise ValueError(f"storage {redact_url(url)!r} is not a valid URL ({redact_text(first_line(error), url)})") \
            from None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        path = Path(parsed.database)
        if path.is_dir():
            raise ValueError(f"storage {redact_url(url)!r} names a folder, not a database file")
        if not path.exists():
            if must_exist:
                raise ValueError(f"no study database at {path}")
            return  # Optuna will create it
        _check_sqlite_file(path)
        if not must_exist:
            _check_writable(path, f"study database {str(path)!r}")
    engine = sqlalchemy.create_engine(url, **_engine_options(url))
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    others = tables - set(BaseModel.metadata.tables) - {"alembic_version"}
    if others:
        raise ValueError(f"storage {redact_url(url)!r} holds tables that are not Optuna's "
                         f"({', '.join(sorted(others)[:4])}): give skipsearch a database of its own")
    if must_exist and "studies" not in tables:
        raise ValueError(f"storage {redact_url(url)!r} holds no Optuna study")


def _check_sqlite_file(path: Path) -> None:
    """Refuse a file that is not SQLite, or a database with a damaged page (SQLite's quick_check, read-only), before
    Optuna meets it halfway through a command."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            problems = [row[0] for row in db.execute("PRAGMA quick_check(3)")]
    except sqlite3.DatabaseError as error:
        raise ValueError(f"study database {str(path)!r} cannot be read: {error}: is it a study database?") from None
    if problems != ["ok"]:
        detail = " ".join(re.sub(r"\*\*\* in database \w+ \*\*\*", "", " ".join(problems)).split())
        raise ValueError(f"study database {str(path)!r} is damaged (SQLite: {detail[:160]}): restore it from a backup, "
                         "or start a new study (another --study-name or --storage)")


def _engine_options(url: str) -> dict[str, Any]:
    # A wrong host should fail in seconds, not after the driver's default minutes.
    return {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}


_HIDDEN = "***"
# Query parameters that carry credentials (libpq's password and sslpassword, tokens and keys of cloud drivers).
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key|auth|credential", re.I)


def redact_url(url: str) -> str:
    """`url` with its password and secret query parameters replaced by ***, wherever a storage URL is shown: messages,
    logs, exported metadata, repr. SQLAlchemy parses it (user and password, password only, percent-encoded); a URL it
    cannot parse loses everything between "://" and "@", and every secret-looking query value, by pattern."""
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except Exception:  # noqa: BLE001 - a URL SQLAlchemy refuses (a bad port, say) is still shown in messages
        # Credentials sit before the last "@" of the authority; without "://", anything before an "@" may be one.
        hidden = re.sub(r"(?<=://)[^/?#]*@" if "://" in url else r"^[^/?#]*@", f"{_HIDDEN}@", url)
        return re.sub(r"(?<=[?&;])([^=&;#]*)=([^&;#]*)",
                      lambda m: f"{m[1]}={_HIDDEN}" if _SECRET_KEY.search(m[1]) else m[0], hidden)
    query = {key: _HIDDEN if _SECRET_KEY.search(key) else value for key, value in parsed.query.items()}
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", _HIDDEN)


def redact_text(text: str, url: str | None) -> str:
    """`text` (an error message, a summary) with storage URL `url` redacted, and each of its secrets, raw or
    percent-encoded, replaced wherever a driver's message repeats one."""
    if not url:
        return text
    text = text.replace(url, redact_url(url))
    for secret in sorted(_secrets(url), key=len, reverse=True):
        text = text.replace(secret, _HIDDEN)
    return text


def _secrets(url: str) -> set[str]:
    """The password and secret query values of `url`, as written and percent-decoded."""
    from urllib.parse import unquote

    userinfo = re.search(r"(?:^|://)([^/?#]*)@", url)  # the credentials, also where the URL has no scheme
    found = {userinfo[1].partition(":")[2]} if userinfo else set()
    found |= {m[2] for m in re.finditer(r"[?&;]([^=&;#]*)=([^&;#]*)", url) if _SECRET_KEY.search(m[1])}
    found |= {unquote(secret) for secret in found}
    return {secret for secret in found if secret}


def load_study(study_name: str, storage: str | optuna.storages.BaseStorage, **kwargs: Any) -> optuna.Study:
    """Load an existing study; a URL is opened read-only (nothing created when there is no study)."""
    if isinstance(storage, str):
        storage = make_storage(storage, must_exist=True)
    try:
        return optuna.load_study(study_name=study_name, storage=storage, **kwargs)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        known = f": studies there are {', '.join(names)}" if names else ": that storage holds no study"
        raise ValueError(f"no study named {study_name!r} in that storage{known}") from None


def existing_study(storage: optuna.storages.BaseStorage, study_name: str) -> tuple[dict[str, Any], int] | None:
    """The user attributes and the number of trials of study `study_name`, or None when the storage holds no
    such study (reads only)."""
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        return None
    # Trials first: a worker labels a study before it adds any trial, so attributes read after a count of trials
    # include the label of whoever added them (read the other way round, a label written between the two reads is
    # missed, and a study being started beside this one looks like another tool's).
    n_trials = storage.get_n_trials(study_id)
    return storage.get_study_user_attrs(study_id), n_trials


# Trial attributes of crash recovery (records.py reads them with the rest of a trial's record).
WORKER_ATTR = "worker"  # "host:pid" of the process running a trial, set when the trial starts
FAIL_REASON_ATTR = "fail_reason"  # why a trial failed, in words
RETRY_ATTR = "retry_of"  # on a re-enqueued trial: the number of the failed trial it re-runs


def worker_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def shared_storage(storage: str | optuna.storages.BaseStorage) -> bool:
    """Whether several processes may run trials of one study in `storage` at once: a journal file or a database
    server do; a SQLite file (one process, as the README says) and memory do not."""
    if isinstance(storage, optuna.storages.InMemoryStorage):
        return False
    url = storage if isinstance(storage, str) else getattr(storage, "url", None)
    return url is None or not url.startswith("sqlite:")  # a storage object without a URL: a journal


def dead_worker(trial: FrozenTrial, grace_s: float, now: datetime | None = None) -> str | None:
    """Why a RUNNING trial's worker is taken for dead, or None while it may be alive.

    Its worker ran on this host and its process is gone; or it never said which worker it is
    (it died before its first step) and it started more than `grace_s` ago. A worker on
    another host cannot be checked from here and is left alone.
    """
    worker = str(trial.user_attrs.get(WORKER_ATTR, ""))
    host, _, pid = worker.rpartition(":")
    if worker and pid.isdigit():
        if host == socket.gethostname() and not process_alive(int(pid)):
            return f"its worker {worker} died (process gone)"
        return None
    started = trial.datetime_start
    if started is not None and ((now or datetime.now()) - started).total_seconds() > grace_s:
        return f"it named no worker and has been running for more than {grace_s:g} s"
    return None


def recover_dead_workers_trials(study: optuna.Study, grace_s: float) -> list[int]:
    """Journal storage (no heartbeats): fail the RUNNING trials whose worker is dead (see `dead_worker`), with a
    `fail_reason`, and enqueue each once more with the same parameters. Returns the failed trial numbers."""
    storage = study._storage
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        reason = dead_worker(trial, grace_s)
        if reason is None:
            continue
        try:
            storage.set_trial_user_attr(trial._trial_id, FAIL_REASON_ATTR, f"worker lost: {reason}")
            if not storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished, or another worker failed it first
        failed.append(trial.number)
        if RETRY_ATTR not in trial.user_attrs and trial.params:
            study.enqueue_trial(trial.params, user_attrs={RETRY_ATTR: trial.number})
    return failed


def explain_stale_trials(study: optuna.Study) -> None:
    """RDB storages with heartbeats: fail the trials whose worker stopped beating (Optuna's `fail_stale_trials`,
    which also runs the retry callback); each gets a `fail_reason` (see `_RDBStorage`). Works through the caching
    wrapper Optuna puts around a study's storage; does nothing on storages without heartbeats."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def heartbeat_enabled(storage: optuna.storages.BaseStorage) -> bool:
    """Whether `storage` (or the storage that Optuna's wrapper holds) records heartbeats."""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return interval is not None and interval() is not None


def storage_place(storage: str | optuna.storages.BaseStorage) -> str:
    """The storage as the one-line errors name it: the file of a SQLite or journal storage, else its URL redacted."""
    url = storage if isinstance(storage, str) else getattr(storage, "url", None)
    if url is None:  # a storage object without a URL: a journal's backend knows its file
        path = getattr(getattr(storage, "_backend", None), "_file_path", None)
        return f"journal {str(path)!r}" if path else f"storage {type(storage).__name__}"
    if url.startswith(JOURNAL_PREFIX):
        return f"journal {url[len(JOURNAL_PREFIX):]!r}"
    if url.startswith("sqlite:///"):
        return f"study database {url[len('sqlite:///'):].partition('?')[0]!r}"
    return f"storage {redact_url(url)!r}"
