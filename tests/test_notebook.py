import nbformat
from nbclient import NotebookClient

from conftest import tiny_model
from skipsearch.decode.config import ModelInfo
from skipsearch.decode.config import load_skip_config
from skipsearch.decode.policy import DraftPolicy
from skipsearch.report.export import export_trial
from skipsearch.search.study import SearchSpace, StudySettings, run_study

NOTEBOOK = "notebooks/view_study.ipynb"


def test_view_study_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    model = tiny_model()
    settings = StudySettings(study_name="nb", storage=f"sqlite:///{tmp_path}/nb.db", n_trials=5, num_prompts=1,
                             max_new_tokens=6, min_match=0.0, show_progress_bar=False)
    study = run_study(model, ModelInfo.of(model, "tiny"), "float32", [[5, 9, 14]], settings,
                      SearchSpace(num_layers=4, skip_prior=0.4), DraftPolicy(max_draft_tokens=3), None)
    export_trial(study, tmp_path / "nb" / "best.json")
    monkeypatch.setenv("SKIPSEARCH_STUDY", "nb")
    monkeypatch.setenv("SKIPSEARCH_STORAGE", settings.storage)
    monkeypatch.setenv("SKIPSEARCH_STUDIES_DIR", str(tmp_path))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4
    assert any("nb: " in o.get("text", "") for o in outputs)
    assert not [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]  # no warnings
    best = load_skip_config(tmp_path / "nb" / "best.json")  # the notebook shows the exported decision
    shown = best.skip if best.skip.size else "nothing (plain decoding)"
    trial = "" if best.search.trial_number is None else f" (trial {best.search.trial_number})"
    assert any(f"skip: {shown}{trial}\n" in o.get("text", "") for o in outputs)
    figures = ("figures of the exported skip set:" if best.skip.drafts else
               "figures of the best confirmed skip set" if best.metrics.best_skipping else "no skip set has been confirmed")
    assert any(figures in o.get("text", "") for o in outputs)  # plain decoding's figures are not shown as a set's
