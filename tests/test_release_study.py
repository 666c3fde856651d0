"""Studies written by skipsearch 0.1.0 (commit f3a5ff2, tests/fixtures/make_release_studies.py) still load, and
export, summarize and judge as that release did."""

import json
import shutil
from pathlib import Path

import pytest

from skipsearch.cli import main
from skipsearch.export import export_trial, verdict, write_dv
from skipsearch.search import study_summary
from skipsearch.storage import load_study

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "release_studies.expected.json").read_text())


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release")
    shutil.copy(FIXTURES / "release_studies.db", folder / "studies.db")  # opening a study may write to its file
    return f"sqlite:///{folder / 'studies.db'}"


def undated(config: dict) -> dict:
    """A config's JSON without the time of its export."""
    return {**config, "search": {k: v for k, v in config["search"].items() if k != "created_at"}}


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
