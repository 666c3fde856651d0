"""Studies written by skipsearch 0.1.0 (commit f3a5ff2, tests/fixtures/make_release_studies.py) still load, and
export, summarize and judge as that release did. Two deliberate changes since: a trial the pre-screen stopped is
exported with no score (that release wrote the pre-screen's estimate as one) and a verdict that says why
(release_studies.expected.json, trials 5 and 9 of "unconfirmed"); a modeled study's verdicts name the device its cost
profile prices, and its configs' `search.predicted_for` records it ("modeled")."""

import json
import re
import shutil
from pathlib import Path

import pytest

from skipsearch.cli import main
from skipsearch.report.export import export_trial, verdict, write_dv
from skipsearch.search.storage import load_study
from skipsearch.search.records import study_summary

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "release_studies.expected.json").read_text())


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release")
    shutil.copy(FIXTURES / "release_studies.db", folder / "studies.db")  # opening a study may write to its file
    return f"sqlite:///{folder / 'studies.db'}"


def undated(config: dict) -> dict:
    """A config's JSON without the time of its export, and without its null figures and settings: that release wrote
    an unknown one as null, this one leaves it out, and both read as unknown."""
    def known(values: dict) -> dict:
        return {k: known(v) if isinstance(v, dict) else v for k, v in values.items() if v is not None}

    return {**config, "metrics": known(config["metrics"]) if "metrics" in config else None,
            "skips": [{**entry, "metrics": known(entry["metrics"])} for entry in config.get("skips", [])],
            "search": {k: v for k, v in known(config["search"]).items() if k != "created_at"}}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_cli_exports_the_same_best_json(name, storage, tmp_path, capsys):
    output = tmp_path / "best.json"
    assert main(["export", "--storage", storage, "--study-name", name, "--output", str(output)]) == 0
    assert undated(json.loads(output.read_text())) == undated(EXPECTED[name]["best"])
    assert capsys.readouterr().out.splitlines()[0] == EXPECTED[name]["verdict"][1]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_trials_export_summarize_and_judge_as_before(name, storage, tmp_path):
    study = load_study(name, storage)
    expected = EXPECTED[name]
    assert study_summary(study) == expected["summary"]
    assert list(verdict(study)) == expected["verdict"]
    for number, config in expected["trials"].items():
        exported = export_trial(study, tmp_path / f"{number}.json", int(number))
        assert undated(exported.to_json()) == undated(config)
    write_dv(export_trial(study, tmp_path / "best.json"), tmp_path / "dv.json")
    assert json.loads((tmp_path / "dv.json").read_text()) == expected["dv"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_surface_ranks_and_labels_as_before(name, storage):
    """The confirmation's candidates and the skip map's top trials were ranked by two functions, the plots' highlight
    and the progress bar labelled by two more: one ranking now gives what each gave."""
    import matplotlib.pyplot as plt

    from skipsearch.report import plots
    from skipsearch.search.ranking import best_candidates, ranked
    from skipsearch.search.records import decoded_trials, measured_trials, read_confirmation
    from skipsearch.search.study import _confirmation_is_stale
    from skipsearch.search.worker import best_label

    study = load_study(name, storage)
    expected = EXPECTED[name]
    assert [t.number for t in best_candidates(study, 3)] == expected["candidates"]
    assert [t.number for t in ranked(study)] == expected["plot_ranking"]
    stored = read_confirmation(study)  # a re-run confirming with the stored repeats and prompts, as the release's did
    repeats, prompts = (stored.repeats, stored.prompts) if stored is not None else (2, 4)
    assert _confirmation_is_stale(study, 3, repeats, prompts) == expected["confirmation_stale"]
    assert best_label(study, ranked(study)[0]) == expected["progress_label"]
    assert [t.number for t in measured_trials(study)] == expected["measured"]
    assert [t.number for t in decoded_trials(study)] == expected["decoded"]
    fig = plots.skip_map(study)
    assert fig.axes[0].get_title() == expected["highlight"]
    plt.close(fig)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_records_write_back_what_the_release_stored(name, storage):
    """One conversion each way: every trial, the label and the confirmation, read as records and written back as
    user attributes, are what the release stored, key for key."""
    from skipsearch.decode.policy import DEPRECATED_FIELDS
    from skipsearch.search.records import CONFIRM_ATTR, STUDY_ATTR, Confirmation, StudyLabel, TrialRecord

    study = load_study(name, storage)
    stored = dict(study.user_attrs[STUDY_ATTR])
    if stored.get("draft") is not None:  # the old rules' policy fields (issue 27) are dropped on reading
        stored["draft"] = {k: v for k, v in stored["draft"].items() if k not in DEPRECATED_FIELDS}
    assert StudyLabel.from_attrs(study.user_attrs[STUDY_ATTR]).attrs() == stored
    assert Confirmation.from_attrs(study.user_attrs[CONFIRM_ATTR]).attrs() == study.user_attrs[CONFIRM_ATTR]
    for trial in study.trials:
        assert TrialRecord.of(trial).attrs() == trial.user_attrs, trial.number


@pytest.mark.parametrize("field, value", [("num_prompts", "8"), ("dataset", [1]), ("objective", None),
                                          ("seed", True), ("device", 0)])
def test_a_label_with_a_field_of_the_wrong_type_is_refused_when_read(field, value, storage):
    """A damaged label is refused in one line when the study is opened, not met later as a traceback."""
    from skipsearch.search.records import STUDY_ATTR, StudyLabel

    attrs = {**load_study(sorted(EXPECTED)[0], storage).user_attrs[STUDY_ATTR], field: value}
    with pytest.raises(ValueError, match=re.escape(f"not a skipsearch study label ({field} is {value!r})")):
        StudyLabel.from_attrs(attrs)
