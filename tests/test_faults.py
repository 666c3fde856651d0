"""Faults a study must survive: a second Ctrl-C, SIGTERM (what batch schedulers send before they kill) during the
trials, a stop signal during the confirmation, a killed worker on journal storage, a worker killed in the last trial
(SQLite, heartbeats), two workers started together on a new SQLite file, a full disk."""

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from skipsearch.cli import main
from skipsearch.io.errors import RESOURCE_EXIT
from skipsearch.search.evaluation import Evaluator
from skipsearch.search import records
from skipsearch.search.records import read_confirmation
from skipsearch.search.storage import dead_worker, make_storage, recover_dead_workers_trials
from skipsearch.search.study import distinct_trials
from skipsearch.search.worker import Interrupted, StopRequest, stop_on_signals
from test_workers import finish, stopped_when, worker

SMALL = ["--num-prompts", "2", "--max-new-tokens", "16", "--min-match", "0", "--no-progress", "--no-pruning",
         "--no-plots"]


def finished(study):
    """Distinct skip sets evaluated (what --n-trials counts; repeated proposals are not decoded)."""
    return distinct_trials(study)


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except Exception:  # the study is not created yet, or the file is being written
            pass
        time.sleep(0.05)
    return False


def read_until(process: subprocess.Popen, text: str) -> str:
    """The process's output up to the line that holds `text` (all of it, if the process ends first)."""
    lines = []
    for line in iter(process.stdout.readline, ""):
        lines.append(line)
        if text in line:
            break
    return "".join(lines)


def test_a_second_ctrl_c_abandons_the_trial_and_still_exports(tiny_model_dir, tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    process = worker(tiny_model_dir, storage, "twice", 50, tmp_path, max_new_tokens=64)

    def two_done_one_running():
        study = optuna.load_study(study_name="twice", storage=storage)
        return len(finished(study)) >= 2 and study.get_trials(states=(TrialState.RUNNING,))

    def one_running():
        return optuna.load_study(study_name="twice", storage=storage).get_trials(states=(TrialState.RUNNING,))

    # Each Ctrl-C is sent while the worker is frozen in a running trial. With a pause between the two instead, a
    # fast trial ended in it, the command exported and exited, and the second Ctrl-C found only its exit (CI,
    # twenty-fourth session).
    assert stopped_when(process, two_done_one_running)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGCONT)
    before = read_until(process, "again to stop now")  # handled: a second Ctrl-C now is not merged with the first
    assert stopped_when(process, one_running), before
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGCONT)
    out = before + finish(process, timeout=120, code=130)
    assert "Traceback" not in out, out
    assert "interrupted twice" in out and "exported" in out
    study = optuna.load_study(study_name="twice", storage=storage)
    assert len(finished(study)) >= 2
    assert not study.get_trials(states=(TrialState.RUNNING,))
    abandoned = [t for t in study.get_trials(states=(TrialState.FAIL,))
                 if "second Ctrl-C" in t.user_attrs.get("fail_reason", "")]
    # the second Ctrl-C landed in a running trial (the trials' states and reasons say where it came, if it fails)
    assert len(abandoned) == 1, (out, [(t.number, t.state.name, t.user_attrs.get("fail_reason")) for t in study.trials])
    assert (tmp_path / "studies" / "twice" / "best.json").is_file()


def test_sigterm_finishes_the_running_trial_and_exports(tiny_model_dir, tmp_path):
    """What Slurm and Kubernetes send before they kill: handled as Ctrl-C, the trial is finished, not left RUNNING."""
    storage = f"sqlite:///{tmp_path}/study.db"
    process = worker(tiny_model_dir, storage, "term", 50, tmp_path)

    def one_done_one_running():
        study = optuna.load_study(study_name="term", storage=storage)
        return len(finished(study)) >= 1 and study.get_trials(states=(TrialState.RUNNING,))

    assert wait_for(one_done_one_running)
    process.send_signal(signal.SIGTERM)
    out = finish(process, timeout=120, code=130)  # exported, then the code of an interrupted command
    assert "Traceback" not in out, out
    assert "SIGTERM: stopping after the running trial" in out
    [line] = [line for line in out.splitlines() if line.startswith("python -m skipsearch optimize: ")]
    assert line.startswith("python -m skipsearch optimize: stopped by SIGTERM during the trials"), line
    assert "exported" in line and str(tmp_path / "studies" / "term" / "best.json") in line
    study = optuna.load_study(study_name="term", storage=storage)
    assert 2 <= len(finished(study)) < 50  # the running trial was finished
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert (tmp_path / "studies" / "term" / "best.json").is_file()


def _signals_at_the_first_confirmation(monkeypatch, signals):
    """Sends `signals` to this process when the confirmation starts measuring its first candidate (the confirmation
    measures with `repeats`, the trials without): each is handled during the sleep after it, in order."""
    real, sent = Evaluator.evaluate, []

    def evaluate(self, skip, report=None, objective="speed_x_acceptance", repeats=None):
        if repeats is not None and not sent:
            sent.append(skip)
            for signum in signals:
                os.kill(os.getpid(), signum)
                time.sleep(0.5)
        return real(self, skip, report, objective, repeats)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    return sent


@pytest.mark.parametrize("signals, confirmed", [((signal.SIGTERM,), 1), ((signal.SIGINT, signal.SIGINT), 0),
                                                ((signal.SIGTERM, signal.SIGTERM), 0)],
                         ids=["SIGTERM", "Ctrl-C twice", "SIGTERM twice"])
def test_a_stop_signal_during_the_confirmation_still_exports(signals, confirmed, tiny_model_dir, tmp_path, capsys,
                                                             monkeypatch):
    """A first signal ends the confirmation after the candidate being measured, a second abandons it: the export
    decides by the candidates confirmed (none: plain decoding), one line on stderr says so, and a re-run confirms."""
    storage = f"sqlite:///{tmp_path}/study.db"
    argv = ["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "confirm",
            "--n-trials", "4", "--confirm-top", "3", "--studies-dir", str(tmp_path / "studies"), *SMALL]
    sent = _signals_at_the_first_confirmation(monkeypatch, signals)
    code = main(argv)
    captured = capsys.readouterr()
    assert sent and code == 130, captured
    name = "SIGTERM" if signals[0] == signal.SIGTERM else "Ctrl-C"
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"python -m skipsearch optimize: stopped by {name} during the confirmation, after "
                           f"{confirmed} of "), line
    best = tmp_path / "studies" / "confirm" / "best.json"
    assert f"exported {best}" in line and "Traceback" not in captured.out + captured.err
    study = optuna.load_study(study_name="confirm", storage=storage)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    config = json.loads(best.read_text())
    confirmation = read_confirmation(study)
    if confirmed:  # the export decides by the one candidate confirmed and says the rest were not
        assert [c.skip for c in confirmation.candidates] == sent and confirmation.wanted >= 2
        assert not confirmation.complete and "stopped after 1 of" in config["metrics"]["verdict"]
        assert main(argv) == 0  # the same command confirms them all
        assert read_confirmation(study).complete and len(read_confirmation(study).candidates) >= 2
    else:  # the one being measured was abandoned: nothing confirmed, plain decoding exported
        assert confirmation is None and config["skip"] == {"attn": [], "mlp": []}
        assert "no skip set has been confirmed yet" in config["metrics"]["verdict"]


def test_stop_signals_are_handled_in_the_main_thread_only():
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopRequest()
    with stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        assert (stop.interrupts, stop.signal_name) == (1, "SIGTERM")
        with pytest.raises(Interrupted, match="stopped by a second Ctrl-C"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert stop.signal_name == "SIGTERM" and "interrupted twice (Ctrl-C)" in stop.reason
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == previous
    import threading

    outcome = []

    def in_a_thread():
        with stop_on_signals(StopRequest()):  # Python sets handlers in the main thread only: none set, no error
            outcome.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert outcome == [previous[0]]


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGINT, signal.SIGINT)], ids=["once", "twice"])
def test_ctrl_c_while_the_vocabulary_is_ranked_still_exports(signals, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A first run ranks the vocabulary before its first trial (a prompt a second on the default model): Ctrl-C there
    lets the ranking finish and stops before the trials, twice abandons it; either way plain decoding is exported,
    and the same command then runs the study."""
    from skipsearch.search import heads

    real, sent = heads.rank_vocabulary, []

    def rank_vocabulary(*args, **kwargs):
        if not sent:
            for signum in signals:
                sent.append(signum)
                os.kill(os.getpid(), signum)
                time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(heads, "rank_vocabulary", rank_vocabulary)
    storage = f"sqlite:///{tmp_path}/study.db"
    argv = ["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "ranked",
            "--n-trials", "2", "--head-rows", "512", "--studies-dir", str(tmp_path / "studies"), *SMALL]
    code = main(argv)
    captured = capsys.readouterr()
    assert sent and code == 130, captured
    [line] = captured.err.strip().splitlines()
    assert line.startswith("python -m skipsearch optimize: stopped by Ctrl-C before the first trial, while ranking")
    best = tmp_path / "studies" / "ranked" / "best.json"
    assert json.loads(best.read_text())["skip"] == {"attn": [], "mlp": []} and f"exported {best}" in line
    assert "Ctrl-C: stopping after the vocabulary ranking" in captured.out
    assert "0 distinct skip sets evaluated; 2 warm starts queued, none evaluated yet" in captured.out
    study = optuna.load_study(study_name="ranked", storage=storage)
    assert not finished(study) and (records.read_vocabulary(study) is None) == (len(signals) == 2)
    assert main(argv) == 0 and len(distinct_trials(optuna.load_study(study_name="ranked", storage=storage))) == 2


def test_sigterm_outside_a_study_ends_the_command_as_ctrl_c(monkeypatch, capsys):
    """By default SIGTERM ends a process at once and silently; the CLI makes it a KeyboardInterrupt, as Ctrl-C."""
    from skipsearch import cli

    previous = signal.getsignal(signal.SIGTERM)

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    monkeypatch.setattr(cli, "cmd_plot", terminated)
    assert main(["plot"]) == 130
    assert capsys.readouterr().err.strip() == "python -m skipsearch plot: interrupted"
    assert signal.getsignal(signal.SIGTERM) == previous


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_dead_worker_rules():
    import socket
    from datetime import datetime, timedelta

    host = socket.gethostname()
    start = datetime.now() - timedelta(seconds=10)

    def trial(worker=None):
        attrs = {"worker": worker} if worker else {}
        return optuna.trial.FrozenTrial(number=0, state=TrialState.RUNNING, value=None, datetime_start=start,
                                        datetime_complete=None, params={}, distributions={}, user_attrs=attrs,
                                        system_attrs={}, intermediate_values={}, trial_id=0)

    assert "died" in dead_worker(trial(f"{host}:{dead_pid()}"), grace_s=60)
    assert dead_worker(trial(f"{host}:{os.getpid()}"), grace_s=60) is None  # alive
    assert dead_worker(trial(f"elsewhere:{dead_pid()}"), grace_s=60) is None  # another host: not checkable
    assert dead_worker(trial(), grace_s=60) is None  # no worker yet, within the grace period
    assert "more than 5 s" in dead_worker(trial(), grace_s=5)


def test_journal_study_recovers_a_killed_workers_trial(tiny_model_dir, tmp_path, capsys):
    storage = f"journal:{tmp_path / 'study.log'}"
    victim = worker(tiny_model_dir, storage, "killed", 4, tmp_path, max_new_tokens=64)
    tag = f":{victim.pid}"

    def victim_runs_a_trial():
        study = optuna.load_study(study_name="killed", storage=make_storage(storage))
        return [t for t in study.get_trials(states=(TrialState.RUNNING,))
                if str(t.user_attrs.get("worker", "")).endswith(tag)]

    assert stopped_when(victim, victim_runs_a_trial)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    study = optuna.load_study(study_name="killed", storage=make_storage(storage))
    [orphan] = [t for t in study.get_trials(states=(TrialState.RUNNING,))]

    code = main(["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "killed",
                 "--n-trials", "4", "--studies-dir", str(tmp_path / "studies"), *SMALL,
                 "--max-new-tokens", "64"])  # as the killed worker measured: a resumed study keeps its settings
    out = capsys.readouterr().out
    assert code == 0 and "exported" in out
    study = optuna.load_study(study_name="killed", storage=make_storage(storage))
    trials = study.get_trials()
    assert len(finished(study)) == 4 and not study.get_trials(states=(TrialState.RUNNING,))
    lost = trials[orphan.number]
    assert lost.state == TrialState.FAIL and lost.user_attrs["fail_reason"].startswith("worker lost:")
    assert [t.params for t in trials if t.user_attrs.get("retry_of") == orphan.number] == [orphan.params]
    assert recover_dead_workers_trials(study, grace_s=60) == []  # nothing left to recover


def test_a_full_disk_mid_study_ends_in_one_line_and_keeps_finished_trials(tiny_model_dir, tmp_path, capsys,
                                                                           monkeypatch):
    storage = f"journal:{tmp_path / 'study.log'}"
    real_append = JournalFileBackend.append_logs
    completed = []

    def append_until_full(self, logs):
        if len(completed) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_append(self, logs)
        completed.extend(log for log in logs if log.get("state") == TrialState.COMPLETE.value)

    monkeypatch.setattr(JournalFileBackend, "append_logs", append_until_full)
    code = main(["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "full",
                 "--n-trials", "8", "--studies-dir", str(tmp_path / "studies"), *SMALL[:-1]])
    captured = capsys.readouterr()
    assert code == RESOURCE_EXIT
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert (f"out of disk space: writing journal '{tmp_path / 'study.log'}' failed (No space left on device); the "
            "trials that finished are kept") in captured.err
    assert "Traceback" not in captured.err + captured.out
    monkeypatch.setattr(JournalFileBackend, "append_logs", real_append)
    study = optuna.load_study(study_name="full", storage=make_storage(storage))
    assert len([t for t in study.get_trials() if t.state == TrialState.COMPLETE]) == 2  # kept
    assert not (tmp_path / "studies" / "full" / "plots").exists()  # no plotting on a full disk


def test_a_worker_killed_in_the_last_trial_is_recovered_by_running_the_command_again(tiny_model_dir, tmp_path,
                                                                                      capsys):
    """SQLite with heartbeats: the re-run waits on the killed worker's trial only until its heartbeat is stale, then
    fails it with a reason, retries it and finishes the study."""
    storage = f"sqlite:///{tmp_path}/study.db"
    for attempt in range(3):
        name = f"last{attempt}"

        def in_its_last_trial():  # and the trial says which worker runs it (set just after the trial starts: killed
            # between, the trial is recovered all the same, but its reason cannot name the worker)
            study = optuna.load_study(study_name=name, storage=storage)
            running = study.get_trials(states=(TrialState.RUNNING,))
            return len(finished(study)) == 1 and running and all("worker" in t.user_attrs for t in running)

        victim = worker(tiny_model_dir, storage, name, 2, tmp_path, max_new_tokens=64)
        if stopped_when(victim, in_its_last_trial):
            break
        finish(victim)  # it finished its last trial before it could be stopped in it: again, with a new study
    else:
        pytest.fail("no worker was stopped in its last trial in 3 studies")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    [orphan] = optuna.load_study(study_name=name, storage=storage).get_trials(states=(TrialState.RUNNING,))

    def waited_too_long(signum, frame):
        raise TimeoutError("the re-run still waits on the killed worker's trial")

    previous = signal.signal(signal.SIGALRM, waited_too_long)
    signal.alarm(180)
    try:
        code = main(victim.args[3:])  # the same command: `python -m skipsearch` + its arguments
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 0 and "exported" in capsys.readouterr().out
    study = optuna.load_study(study_name=name, storage=storage)
    assert len(finished(study)) == 2 and not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    lost = study.trials[orphan.number]
    assert lost.state == TrialState.FAIL
    assert lost.user_attrs["fail_reason"].startswith(f"worker lost: {orphan.user_attrs['worker']} sent no heartbeat")
    [retry] = [t for t in study.trials if t.system_attrs.get("failed_trial") == orphan.number]  # Optuna's retry
    assert retry.params == orphan.params and retry.state == TrialState.COMPLETE


def _fail_the_running_trial_as_a_peer_would(storage_url, study_name):
    """What another worker's stale check does to a trial whose heartbeat came late: fail it with a reason, and queue
    a retry (Optuna's retry callback)."""
    study = optuna.load_study(study_name=study_name, storage=make_storage(storage_url))
    [running] = study.get_trials(states=(TrialState.RUNNING,))
    study._storage.set_trial_user_attr(running._trial_id, "fail_reason", "worker lost: a peer saw no heartbeat")
    assert study._storage.set_trial_state_values(running._trial_id, TrialState.FAIL)
    study.enqueue_trial(running.params)
    return running.number


@pytest.fixture
def optuna_records():
    """What Optuna logs during the test (its handler writes to the stderr it found at import, which capsys misses)."""
    import logging

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    keep = Keep()
    logging.getLogger("optuna").addHandler(keep)
    yield keep.records
    logging.getLogger("optuna").removeHandler(keep)


def _peer_fails_decoded_trials(monkeypatch, storage, study_name, when, lost, every=False):
    """Patch this process so that a peer fails its decoded trials (the first only, unless `every`) `when`: while the
    trial decodes, after its last record, or just after the worker checked that no peer had ended it (Optuna's tell
    comes after that check). `lost` gets the trial numbers."""
    from skipsearch.search import study as study_module

    def peer(trial_number):
        if trial_number >= 1 and (every or not lost):  # trial 0 is plain decoding's
            lost.append(_fail_the_running_trial_as_a_peer_would(storage, study_name))

    if when == "while it decodes":
        real_evaluate, real_run, running = Evaluator.evaluate, study_module.TrialRunner._run, [0]

        def run(self, trial):
            running[0] = trial.number
            return real_run(self, trial)

        def evaluate(self, skip, report=None, objective="speed_x_acceptance", repeats=None):
            peer(running[0])
            return real_evaluate(self, skip, report, objective, repeats)

        monkeypatch.setattr(study_module.TrialRunner, "_run", run)
        monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    elif when == "after its last record":
        real_run = study_module.TrialRunner._run

        def run(self, trial):
            value = real_run(self, trial)
            peer(trial.number)
            return value

        monkeypatch.setattr(study_module.TrialRunner, "_run", run)
    else:
        real_check, checked = study_module._finished_elsewhere, set()

        def check_then_peer(trial):
            answer = real_check(trial)
            if answer is None and trial.number not in checked:
                checked.add(trial.number)
                peer(trial.number)
            return answer

        monkeypatch.setattr(study_module, "_finished_elsewhere", check_then_peer)


@pytest.mark.parametrize("when", ["while it decodes", "after its last record", "after its check"])
def test_a_worker_whose_trial_a_peer_failed_goes_on(when, tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                    optuna_records):
    """A paused or starved worker's trial can be failed as stale by another worker (and retried there); the worker,
    alive after all, must drop that trial's result and go on, not end on Optuna's "Cannot tell a FAIL trial" (or,
    where the peer comes after the worker's own check, on the assertion Optuna's tell then trips)."""
    storage, lost = f"sqlite:///{tmp_path}/study.db", []
    _peer_fails_decoded_trials(monkeypatch, storage, "peer", when, lost)
    code = main(["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "peer",
                 "--n-trials", "3", "--confirm-top", "0", "--studies-dir", str(tmp_path / "studies"), *SMALL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (f"trial {lost[0]} was ended by another worker while this one ran it (FAIL: worker lost: a peer saw no "
            "heartbeat); its result is dropped and the study goes on") in captured.out
    assert "Traceback" not in captured.err + captured.out
    assert not [r for r in optuna_records if r.exc_info or "failed" in r.getMessage()]  # no traceback logged
    assert optuna.logging.get_verbosity() < optuna.logging.ERROR  # quieted for the lost trial only
    study = optuna.load_study(study_name="peer", storage=make_storage(storage))
    assert len(finished(study)) == 3 and not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    retried = [t for t in study.trials if t.number > lost[0] and t.params == study.trials[lost[0]].params]
    assert retried and retried[0].state == TrialState.COMPLETE


def test_an_error_after_a_lost_trial_is_still_an_error(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The lost trial is said once: a ValueError of Optuna's own after it (here from `ask`) ends the command."""
    storage, lost = f"sqlite:///{tmp_path}/study.db", []
    _peer_fails_decoded_trials(monkeypatch, storage, "later", "while it decodes", lost)
    real_ask = optuna.Study.ask

    def ask(self, *args, **kwargs):
        if lost:
            raise ValueError("the sampler broke")
        return real_ask(self, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "ask", ask)
    code = main(["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "later",
                 "--n-trials", "3", "--confirm-top", "0", "--studies-dir", str(tmp_path / "studies"), *SMALL])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.strip().endswith("the sampler broke"), captured.err
    assert captured.out.count("was ended by another worker") == 1


def test_trials_lost_in_a_row_stop_the_worker_with_advice(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Workers that keep ending each other's trials (a grace too short for the machine) stop after the failure
    limit, as failed trials do, instead of trying forever."""
    storage, lost = f"sqlite:///{tmp_path}/study.db", []
    _peer_fails_decoded_trials(monkeypatch, storage, "row", "while it decodes", lost, every=True)
    code = main(["optimize", "--model", str(tiny_model_dir), "--storage", storage, "--study-name", "row",
                 "--n-trials", "20", "--confirm-top", "0", "--studies-dir", str(tmp_path / "studies"), *SMALL])
    captured = capsys.readouterr()
    assert len(lost) == 5 and captured.out.count("was ended by another worker") == 5  # StudySettings.max_failures
    assert ("stopped: 5 trials in a row failed, the last because another worker ended it while this one ran it; "
            "where workers are alive, a longer --heartbeat-grace") in captured.out
    assert code == 0, captured.err


def test_a_trial_error_stays_the_error_when_the_storage_cannot_be_read_after_it(monkeypatch):
    """The check whether a peer ended the trial reads the storage; when that read fails too, the trial's own error is
    the one Optuna records (not the read's), and the trial counts as not lost."""
    from skipsearch.search.study import TrialRunner

    def failing_run(self, trial):
        raise RuntimeError("the trial's own")

    def unreadable(trial_id):
        raise OSError("storage gone")

    runner = TrialRunner(space=None, evaluator=None, objective="speedup", min_match=0.0)
    monkeypatch.setattr(TrialRunner, "_run", failing_run)
    study = optuna.create_study()
    trial = study.ask()

    monkeypatch.setattr(study._storage, "get_trial", unreadable)
    with pytest.raises(RuntimeError, match="the trial's own"):
        runner(trial)
    assert runner.take_lost_trial() is None and isinstance(runner.last_error, RuntimeError)


def _optimize_in_a_fork(argv, results):
    torch.set_num_threads(1)  # no OpenMP pool of the parent's in a forked child
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        error = io.StringIO()
        with contextlib.redirect_stderr(error):
            try:
                code = main(argv)
            except BaseException as exception:  # a traceback is a failure too
                code = repr(exception)
    results.put((code, error.getvalue().strip()[-300:]))


def test_two_workers_started_together_on_a_new_sqlite_file_both_proceed(tiny_model_dir, tmp_path):
    """Both create Optuna's tables at once ("table ... already exists") and both may take the same queued trial
    ("Cannot tell a COMPLETE trial"): 20 tries, none may fail. No worker dies here, so the grace is long: a late
    heartbeat on a loaded machine ending a live worker's trial is the tests above. Forked from this process (imports
    done), on tmpfs where there is one, to keep the tries fast."""
    import multiprocessing
    import tempfile

    context = multiprocessing.get_context("fork")
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path))
    try:
        for attempt in range(20):
            argv = ["optimize", "--model", str(tiny_model_dir), "--storage", f"sqlite:///{folder}/{attempt}.db",
                    "--study-name", "together", "--n-trials", "2", "--num-prompts", "1", "--max-new-tokens", "8",
                    "--confirm-top", "0", "--heartbeat-interval", "1", "--heartbeat-grace", "60", "--studies-dir",
                    str(folder / "studies"), *SMALL[4:]]
            results = context.Queue()
            workers = [context.Process(target=_optimize_in_a_fork, args=(argv, results)) for _ in range(2)]
            for process in workers:
                process.start()
            outcomes = [results.get(timeout=180) for _ in workers]
            for process in workers:
                process.join(timeout=30)
            assert [code for code, _ in outcomes] == [0, 0], (attempt, outcomes)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
