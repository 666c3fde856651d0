"""Many workers on one study: PostgreSQL (heartbeats, a worker killed mid-trial) and the journal file."""

import os
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from skipsearch.search.storage import make_storage
from skipsearch.search.study import distinct_trials


@pytest.fixture(scope="module")
def postgres_url():
    url = os.environ.get("SKIPSEARCH_TEST_POSTGRES_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("CI must start PostgreSQL (.ci/postgres.sh) and set SKIPSEARCH_TEST_POSTGRES_URL")
        pytest.skip("no PostgreSQL server: start one with `.ci/postgres.sh start` and set SKIPSEARCH_TEST_POSTGRES_URL")
    return url


def worker(model_dir, storage, study, n_trials, tmp_path, max_new_tokens=24, grace_s=3):
    """An `optimize` process. The short grace lets a killed worker's trial be retried within a test; where no worker
    is killed, a longer one keeps a loaded machine's late heartbeat from failing a live worker's trial."""
    command = [sys.executable, "-m", "skipsearch", "optimize", "--model", str(model_dir), "--storage", storage,
               "--study-name", study, "--n-trials", str(n_trials), "--num-prompts", "2", "--max-new-tokens",
               str(max_new_tokens), "--min-match", "0", "--no-plots", "--no-progress", "--no-pruning",
               "--studies-dir", str(tmp_path / "studies"), "--heartbeat-interval", "1", "--heartbeat-grace",
               str(grace_s), "--max-retries", "2"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process, timeout=240, code=0):
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == code, out
    return out


def stopped_when(victim: subprocess.Popen, condition, timeout: float = 120) -> bool:
    """Whether `victim` could be stopped (SIGSTOP) while `condition()` holds: it is read again once the worker is
    stopped, since on a loaded machine a trial can end between a read and a kill, and the kill then finds no trial to
    orphan. False if the worker ended first."""
    def holds():
        try:
            return bool(condition())
        except Exception:  # the study is not created yet, or its file is being written (or was, when stopped)
            return False

    deadline = time.monotonic() + timeout
    while victim.poll() is None and time.monotonic() < deadline:
        if holds():
            victim.send_signal(signal.SIGSTOP)
            if holds():
                return True
            victim.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    return False


def check_complete(study, n_trials):
    trials = study.get_trials(deepcopy=False)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len(distinct_trials(study)) == n_trials  # repeated proposals are answered without decoding
    return trials


@pytest.mark.parametrize("backend", ["postgres", "journal"])
def test_two_workers_share_one_study(backend, tiny_model_dir, tmp_path, request):
    storage = (request.getfixturevalue("postgres_url") if backend == "postgres"
               else f"journal:{tmp_path / 'study.log'}")
    name = f"two-{uuid.uuid4().hex[:8]}"
    workers = [worker(tiny_model_dir, storage, name, 8, tmp_path, grace_s=60) for _ in range(2)]
    outputs = [finish(w) for w in workers]
    study = optuna.load_study(study_name=name, storage=make_storage(storage))
    trials = check_complete(study, 8)
    ran = {t.user_attrs["worker"] for t in trials if t.state == TrialState.COMPLETE}
    assert len(ran) == 2, outputs  # both workers did trials
    assert all("exported" in out for out in outputs)
    assert not any("stays so" in out or "stopped:" in out for out in outputs)  # waiting on a live worker is no fault
    # Failures are only trials that found the budget spent when they started.
    assert all(t.user_attrs["fail_reason"].startswith("not run") for t in trials if t.state == TrialState.FAIL)


def test_a_killed_worker_trial_is_failed_and_retried(postgres_url, tiny_model_dir, tmp_path):
    name = f"kill-{uuid.uuid4().hex[:8]}"
    survivor = worker(tiny_model_dir, postgres_url, name, 8, tmp_path, max_new_tokens=48)
    victim = worker(tiny_model_dir, postgres_url, name, 8, tmp_path, max_new_tokens=48)
    storage = make_storage(postgres_url)
    victim_tag = f":{victim.pid}"

    def victims_trials():
        running = optuna.load_study(study_name=name, storage=storage).get_trials(states=(TrialState.RUNNING,))
        return [t for t in running if str(t.user_attrs.get("worker", "")).endswith(victim_tag)]

    assert stopped_when(victim, victims_trials), "the victim never ran a trial"
    killed_trial = victims_trials()[0].number  # read while it is stopped
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    finish(survivor)

    study = optuna.load_study(study_name=name, storage=make_storage(postgres_url))
    trials = check_complete(study, 8)
    dead = trials[killed_trial]
    assert dead.state == TrialState.FAIL
    retries = [t for t in trials if RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == killed_trial]
    assert len(retries) == 1 and retries[0].params == dead.params
    assert retries[0].state in (TrialState.COMPLETE, TrialState.PRUNED)


def test_ctrl_c_finishes_the_running_trial_then_exports(tiny_model_dir, tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    process = worker(tiny_model_dir, storage, "interrupted", 50, tmp_path, max_new_tokens=48)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            study = optuna.load_study(study_name="interrupted", storage=storage)
            if len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))) >= 2 and study.get_trials(
                    states=(TrialState.RUNNING,)):
                break
        except (KeyError, Exception):  # not created yet, or the database is busy
            pass
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out = finish(process, timeout=120, code=130)  # an interrupted command's code, after the export
    assert "stopping after the running trial" in out and "exported" in out
    study = optuna.load_study(study_name="interrupted", storage=storage)
    trials = study.get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]  # the running trial was finished
    assert 2 <= len([t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]) < 50
    assert (tmp_path / "studies" / "interrupted" / "best.json").is_file()
