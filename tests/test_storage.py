import optuna
import pytest

from skipsearch.storage import Heartbeat, _redact, load_study, make_storage
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
    assert _redact("postgresql+psycopg2://me:secret@host:5432/db") == "postgresql+psycopg2://me:***@host:5432/db"
    assert _redact("sqlite:///x.db") == "sqlite:///x.db"


def test_existing_study_reads_labels_and_trial_count(tmp_path):
    import optuna

    from skipsearch.storage import existing_study, make_storage

    storage = make_storage(f"sqlite:///{tmp_path}/s.db")
    assert existing_study(storage, "s") is None
    study = optuna.create_study(study_name="s", storage=storage)
    assert existing_study(storage, "s") == ({}, 0)
    study.set_user_attr("k", 1)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert existing_study(storage, "s") == ({"k": 1}, 2)
