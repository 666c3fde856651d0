import optuna
import pytest

from skipsearch.search.storage import Heartbeat, load_study, make_storage, redact_url
from test_export import fake_study


def test_load_study_names_the_studies_that_exist(tmp_path):
    fake_study(tmp_path, [1.0])
    with pytest.raises(ValueError, match="studies there are fake"):
        load_study("other", f"sqlite:///{tmp_path}/fake.db")


def test_storages_from_urls(tmp_path):
    assert isinstance(make_storage(f"sqlite:///{tmp_path}/a.db"), optuna.storages.RDBStorage)
    assert isinstance(make_storage(f"journal:{tmp_path}/a.log"), optuna.storages.JournalStorage)
    beating = make_storage(f"sqlite:///{tmp_path}/b.db", Heartbeat(interval_s=5, grace_s=20, max_retries=1))
    assert beating.get_heartbeat_interval() == 5


@pytest.mark.parametrize("url, message", [
    ("studies/x.db", "is not a URL"),
    ("journal:/no/such/folder/x.log", "does not exist"),
    ("nosuchdialect://host/db", "cannot open storage"),
])
def test_bad_storage_urls_are_clear_errors(url, message):
    with pytest.raises(ValueError, match=message):
        make_storage(url)


def test_passwords_are_redacted():
    assert redact_url("postgresql+psycopg2://me:secret@host:5432/db") == "postgresql+psycopg2://me:***@host:5432/db"
    assert redact_url("sqlite:///x.db") == "sqlite:///x.db"  # every other form: tests/test_hostile.py


def test_existing_study_reads_labels_and_trial_count(tmp_path):
    import optuna

    from skipsearch.search.storage import existing_study, make_storage

    storage = make_storage(f"sqlite:///{tmp_path}/s.db")
    assert existing_study(storage, "s") is None
    study = optuna.create_study(study_name="s", storage=storage)
    assert existing_study(storage, "s") == ({}, 0)
    study.set_user_attr("k", 1)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert existing_study(storage, "s") == ({"k": 1}, 2)


def test_a_stale_trial_failed_by_optuna_itself_says_why(tmp_path):
    """Optuna fails stale trials at the start of every trial, through the caching wrapper it puts around a study's
    storage: the trial still gets its fail_reason."""
    import time

    from optuna.trial import TrialState

    from skipsearch.search.storage import explain_stale_trials, heartbeat_enabled

    storage = make_storage(f"sqlite:///{tmp_path}/s.db", Heartbeat(interval_s=1, grace_s=1, max_retries=0))
    study = optuna.create_study(study_name="s", storage=storage)
    assert heartbeat_enabled(study._storage) and study._storage is not storage  # the wrapper
    for worker in ("elsewhere:1", "elsewhere:2"):
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        storage.record_heartbeat(trial._trial_id)
    time.sleep(2.5)  # past the grace period, in SQLite's whole seconds
    optuna.storages.fail_stale_trials(study)
    reasons = {t.user_attrs["worker"]: t.user_attrs.get("fail_reason") for t in study.get_trials()}
    assert reasons == {f"elsewhere:{n}": f"worker lost: elsewhere:{n} sent no heartbeat for 1 s (killed?)"
                       for n in (1, 2)}
    assert not study.get_trials(states=(TrialState.RUNNING,))
    explain_stale_trials(study)  # nothing left to fail; the reasons stay
    assert {t.user_attrs.get("fail_reason") for t in study.get_trials()} == set(reasons.values())


def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_stale_too(tmp_path):
    """A worker killed between creating its trial and its first heartbeat left the trial running forever (Optuna
    skips trials without a heartbeat), and a re-run waited on it: once it began longer ago than the grace period, it
    is failed with a reason like any stale trial. A trial that beats, or began within the grace, is left alone."""
    import time

    from optuna.trial import TrialState

    storage = make_storage(f"sqlite:///{tmp_path}/s.db", Heartbeat(interval_s=1, grace_s=1, max_retries=0))
    study = optuna.create_study(study_name="s", storage=storage)
    silent = study.ask()  # ask() records no heartbeat: the killed worker's trial
    silent.set_user_attr("worker", "elsewhere:1")
    beating = study.ask()
    time.sleep(2.5)
    storage.record_heartbeat(beating._trial_id)
    fresh = study.ask()
    optuna.storages.fail_stale_trials(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {silent.number: TrialState.FAIL, beating.number: TrialState.RUNNING,
                      fresh.number: TrialState.RUNNING}
    [lost] = study.get_trials(states=(TrialState.FAIL,))
    assert lost.user_attrs["fail_reason"] == "worker lost: elsewhere:1 sent no heartbeat for 1 s (killed?)"
