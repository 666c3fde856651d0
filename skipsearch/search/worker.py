"""A worker's trials: one `study.optimize` call, which Optuna callbacks stop with `study.stop()` (called again after a
trial that another worker ended meanwhile, which Optuna refuses to store).

After each trial the rules decide whether this worker starts another: the trial budget (distinct skip sets,
counted across all the study's workers), a limit on failures in a row, an exhausted search space, and a stop
signal (Ctrl-C or SIGTERM).
A resource that runs out (disk space, a file-size limit, memory) or a model whose logits are not finite ends the study
at once: every later trial would fail the same way.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..io.errors import NonFiniteLogits, exhausted_resource
from .ranking import quoted_speedup, ranked
from .records import TrialRecord, distinct_trials, enqueue, read_trials, read_vocabulary, study_label
from .settings import StudySettings
from .space import SearchSpace
from .storage import Heartbeat, explain_stale_trials, heartbeat_enabled, recover_dead_workers_trials


Callback = Callable[[optuna.Study, FrozenTrial], None]


class TrialRunner(Protocol):
    """What a worker runs each trial with (study.py's `TrialRunner`): Optuna's objective, keeping the trial's error,
    which Optuna logs and keeps to itself, for the stopping rules."""

    last_error: Exception | None

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]: ...

    def was_told(self, study: optuna.Study, trial: FrozenTrial) -> None: ...

    def take_lost_trial(self) -> str | None: ...


class SurplusTrial(Exception):
    """Raised at the start of a trial that would take the study past its trial budget."""


class TrialLost(Exception):
    """Raised at the end of a trial that another worker ended meanwhile (see `work`)."""


def ends_the_study(error: BaseException | None) -> bool:
    """Whether no later trial can succeed after `error`: a resource ran out (the next trial needs it too, and the
    study's file may not take even a failure's record), or the model's logits are not finite (no figure means
    anything). Failing `max_failures` trials on it, each with a traceback, would only hide it."""
    return error is not None and (isinstance(error, NonFiniteLogits) or exhausted_resource(error) is not None)


class Interrupted(Exception):
    """A second stop signal: abandon the running trial (or confirmation) now. An Exception, so that Optuna fails the
    trial and goes on to the callbacks instead of unwinding the whole study; the caller still exports what finished."""


# Ctrl-C, and what batch schedulers (Slurm, Kubernetes) send before they kill: both stop a study the same way.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@dataclass
class StopRequest:
    """Why this worker stops starting trials: a reason to print (empty: none), the stop signals so far and the
    first one's name, and what a second signal abandons. Called after each trial, it is the stop-signal rule."""

    reason: str = ""
    interrupts: int = 0
    signal_name: str = ""  # "Ctrl-C" or "SIGTERM": the first stop signal; empty while none came
    running: str = "running trial"  # what runs now, as the messages name it
    outcome: str = ""  # when a signal stopped the run: where, and what that left for the export

    @property
    def requested(self) -> bool:
        return bool(self.reason or self.interrupts)

    def stop(self, study: optuna.Study, reason: str) -> None:
        self.reason = reason
        study.stop()

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.interrupts:
            study.stop()


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[None]:
    """First Ctrl-C or SIGTERM: finish what runs (`stop.running`), then stop; the caller still exports.
    Second: abandon it now (`Interrupted`). Signal handlers can only be set in the main thread: elsewhere the
    signals keep their handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        name = STOP_SIGNALS[signum]
        stop.interrupts += 1
        stop.signal_name = stop.signal_name or name
        if stop.interrupts > 1:
            stop.reason = f"interrupted twice ({name}): the {stop.running} was abandoned"
            optuna.logging.set_verbosity(optuna.logging.ERROR)  # no traceback for the abandoned trial
            raise Interrupted(f"stopped by a second {name}")
        print(f"\n{name}: stopping after the {stop.running} ({name} again to stop now)", flush=True)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass
class FailureLimit:
    """Stops the study after `limit` failed trials in a row (until then, the next trial tries again); an error that
    `ends_the_study` ends it at once. A trial that found the budget spent is no failure."""

    limit: int
    stop: StopRequest
    runner: TrialRunner  # its `last_error`: Optuna logs a failed trial's exception and keeps it to itself
    in_a_row: int = 0

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        error = self.runner.last_error
        if isinstance(error, SurplusTrial):
            return
        if ends_the_study(error):
            raise error
        self.in_a_row = self.in_a_row + 1 if trial.state == TrialState.FAIL else 0
        if self.in_a_row >= self.limit:
            reason = TrialRecord.of(trial, read_vocabulary(study)).fail_reason or (
                f"{type(error).__name__}: {error}" if error else "of an error Optuna logged above")
            self.stop.stop(study, f"{self.limit} trials in a row failed, the last because {reason}")

    def count_lost(self) -> None:
        """A trial another worker ended (Optuna runs no callback for it) fails in a row too; between trials, so the
        stop is only requested."""
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            self.stop.reason = (f"{self.limit} trials in a row failed, the last because another worker ended it while "
                                "this one ran it; where workers are alive, a longer --heartbeat-grace keeps them from "
                                "ending each other's trials")


@dataclass
class ExhaustedSpace:
    """Stops the study once it has evaluated every skip set of the space. TPE on a small space can keep proposing
    its favourite: after `explore_after` repeated proposals in a row a random unevaluated set is queued to move it
    on, and when none can be drawn the space counts as exhausted."""

    space: SearchSpace
    explore_after: int
    seed: int
    stop: StopRequest
    runner: TrialRunner
    repeats_in_a_row: int = 0

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if isinstance(self.runner.last_error, SurplusTrial):
            return
        repeated = TrialRecord.of(trial, self.space.ranking).repeat_of is not None
        self.repeats_in_a_row = self.repeats_in_a_row + 1 if repeated else 0
        distinct = distinct_trials(study)
        if len(distinct) >= self.space.size:
            self.stop.stop(study, f"the search space is exhausted: all {self.space.size} skip sets in it were evaluated")
        elif self.repeats_in_a_row >= self.explore_after:
            evaluated = {self.space.key(t.skip) for t in distinct}
            fresh = self.space.random_unevaluated(evaluated, random.Random(self.seed + trial.number))
            if fresh is None:
                self.stop.stop(study, f"the sampler proposed only already-evaluated skip sets {self.repeats_in_a_row} "
                                      f"times in a row and no unevaluated one could be drawn ({len(distinct)} distinct "
                                      "sets evaluated): the search space looks exhausted")
            else:
                enqueue(study, self.space.params_for(fresh), TrialRecord(explored=True))
                self.repeats_in_a_row = 0


@dataclass
class TrialBudget:
    """Stops the study once it has `n_trials` distinct skip sets, or at the deadline. Trials running in any worker
    count, so that the workers together do not overshoot; before counting, the trials of dead workers are failed
    (and re-enqueued) so that they do not.

    With heartbeats, a dead worker's trial is failed once its grace period is over, so a worker that finds only
    running trials left waits for them instead of stopping. Without, their workers are alive and finish the study.
    (The deadline is checked here rather than by Optuna's `timeout`: a waiting worker must give up at it too.)
    """

    n_trials: int
    storage: optuna.storages.BaseStorage
    stop: StopRequest
    grace_s: float
    deadline: float | None = None
    note: str = ""  # said when other workers finish the study

    @property
    def heartbeat(self) -> bool:
        return heartbeat_enabled(self.storage)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if not self.room_for_a_trial(study):
            study.stop()

    def room_for_a_trial(self, study: optuna.Study) -> bool:
        while not self.stop.requested:
            if self.heartbeat:
                explain_stale_trials(study)
            else:
                recover_dead_workers_trials(study, self.grace_s)
            finished = len(distinct_trials(study))
            if finished >= self.n_trials or (self.deadline is not None and time.monotonic() >= self.deadline):
                return False
            running = read_trials(study, (TrialState.RUNNING,))
            if finished + len(running) < self.n_trials:
                return True
            if not self.heartbeat:
                owners = sorted({t.worker or "?" for t in running})
                self.note = (f"the study's last {len(running)} trial(s) are running in other workers "
                             f"({', '.join(owners)}), which finish the study")
                return False
            time.sleep(min(5.0, self.storage.get_heartbeat_interval()))
        return False


def work(study: optuna.Study, storage: optuna.storages.BaseStorage, runner: TrialRunner, settings: StudySettings,
         space: SearchSpace, stop: StopRequest) -> StopRequest:
    """Run trials until the study, shared with any other workers, has evaluated `settings.n_trials` distinct skip
    sets, or a rule stops it (`stop` is the stop-signal rule: the caller handles the signals with
    `stop_on_signals`); returns why it stopped. Failed trials do not count: they are retried, up to
    `settings.max_failures` in a row; a repeated proposal costs no decoding and does not count either. A trial that
    another worker ended while this one ran it (a late heartbeat) is said in one line and counts as failed."""
    deadline = time.monotonic() + settings.timeout if settings.timeout else None
    budget = TrialBudget(settings.n_trials, storage, stop, (settings.heartbeat or Heartbeat()).grace_s, deadline)
    failures = FailureLimit(settings.max_failures, stop, runner)
    rules = [failures, ExhaustedSpace(space, settings.explore_after_repeats, settings.seed, stop, runner), stop]
    verbosity = optuna.logging.get_verbosity()  # the trial runner quiets Optuna for an error that ends the study
    with _progress(study, settings.n_trials, settings.show_progress_bar) as bar:
        try:
            while budget.room_for_a_trial(study):
                try:
                    study.optimize(runner, callbacks=[runner.was_told, *rules, bar, budget], catch=(Exception,))
                    break
                except Interrupted:
                    raise
                except Exception:  # Optuna's tell refuses a trial another worker ended: that trial is lost, not all
                    lost = runner.take_lost_trial()
                    if lost is None:
                        raise
                    if ends_the_study(runner.last_error):
                        raise runner.last_error from None
                    print(lost)
                    optuna.logging.set_verbosity(verbosity)
                    failures.count_lost()
        except Interrupted:
            pass  # raised between trials; `stop` says so
        finally:
            optuna.logging.set_verbosity(verbosity)
    if budget.note:
        print(budget.note)
    if stop.reason:
        print(f"stopped: {stop.reason}")
    return stop


@contextlib.contextmanager
def _progress(study: optuna.Study, total: int, enabled: bool) -> Iterator[Callback]:
    """A bar of the distinct skip sets evaluated (all workers), with the best trial so far."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=min(total, len(distinct_trials(study))), unit="set", disable=not enabled,
               dynamic_ncols=True, desc="skip sets")

    def callback(study: optuna.Study, trial: FrozenTrial) -> None:
        measured = min(total, len(distinct_trials(study)))
        if measured == bar.n:  # a repeated proposal (or a failed trial) measures nothing: no redraw, no line in a log
            return
        bar.n = measured
        # Plain decoding's own trial scores about 1 by construction: the bar shows the best set that skips something.
        best = next(iter(ranked(study)), None)
        if best is not None:
            bar.set_postfix_str(f"best skip set so far {best_label(study, best)} (trial {best.number}, unconfirmed)",
                                refresh=False)
        bar.refresh()

    try:
        yield callback
    finally:
        bar.close()


def best_label(study: optuna.Study, trial: TrialRecord) -> str:
    """A ranked trial's speedup and acceptance, as the progress bar shows them."""
    speedup = quoted_speedup(trial.figures, study_label(study).objective)
    acceptance = trial.figures.acceptance_rate
    return f"{speedup.estimate:.2f}x, acceptance {'-' if acceptance is None else format(acceptance, '.2f')}"
