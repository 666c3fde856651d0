import datetime
import json

import pytest

from skipsearch.io.data import load_prompts, load_rows


def test_builtin_prompts_are_selected_deterministically_by_seed():
    everything = load_prompts(num_prompts=None)
    assert len(everything) == 32 and all(isinstance(p, str) and p for p in everything)
    assert load_prompts(num_prompts=5, seed=3) == load_prompts(num_prompts=5, seed=3)
    assert load_prompts(num_prompts=5, seed=3) != load_prompts(num_prompts=5, seed=4)
    assert set(load_prompts(num_prompts=5, seed=3)) <= set(everything)


def test_rows_a_study_saw_are_left_out_before_the_draw(tmp_path):
    """bench measures a config on prompts its study neither decoded nor ranked a head on: those rows are left out
    before the seeded draw, said in a note, and counted where too few remain."""
    from skipsearch.io.data import prompt_digest

    every = load_rows(num_prompts=None, seed=0)
    studied = load_rows(num_prompts=4, seed=0)
    seen = {prompt_digest(row.turns) for row in studied}
    assert len(seen) == 4 and prompt_digest(("a", "b")) != prompt_digest(("a\x1eb",))
    notes = []
    held_out = load_rows(num_prompts=4, seed=0, study_prompts=seen, note=notes.append)
    assert len(held_out) == 4 and not {prompt_digest(row.turns) for row in held_out} & seen
    assert notes == [f"4 prompts of dataset 'builtin' left out: the config's study decoded them or ranked its draft "
                     "head on them, so a figure on them would be in-sample (--include-study-prompts keeps them)"]
    with pytest.raises(ValueError, match=f"asked for {len(every)} prompts, but dataset 'builtin' has {len(every) - 4} "
                                         r"besides the 4 its config's study saw \(--include-study-prompts keeps"):
        load_rows(num_prompts=len(every), seed=0, study_prompts=seen, note=notes.append)


def test_local_jsonl_and_json_with_a_field(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"text": f"prompt {i}"}) for i in range(4)))
    assert sorted(load_prompts(str(tmp_path / "p.jsonl"), field="text", num_prompts=4)) == [
        f"prompt {i}" for i in range(4)]
    (tmp_path / "p.json").write_text(json.dumps([{"q": "a"}, {"q": "b"}]))
    assert sorted(load_prompts(str(tmp_path / "p.json"), field="q", num_prompts=None)) == ["a", "b"]


@pytest.mark.parametrize(
    "content, kwargs, message",
    [
        ('{"prompt": "a"}', dict(field="text"), "has no field 'text'"),
        ('{"prompt": ""}', {}, "no non-empty text"),
        ('{"prompt": "a"}', dict(num_prompts=3), "asked for 3 prompts"),
        ("not json at all", {}, "line 1: not valid JSON"),
        ('{"prompt": "a"}\n{"prompt": "b"\n', {}, "line 2: not valid JSON"),
        ('{"prompt": "a"}\n[1, 2]\n', {}, "line 2: expected an object"),
        ('{"prompt": "a"}\n{"prompt": 3}\n', {}, "line 2: 'prompt' is a number \\(3\\), not text"),
        ('[{"prompt": "a"}, {"prompt": [3]}]', dict(suffix=".json"), "record 2: 'prompt': turn 1 is a number"),
        ('[{"prompt": "a"}, {"prompt": {"b": 1}}]', dict(suffix=".json"), "record 2: 'prompt' is a dict"),
        ('[' * 5000 + ']' * 5000, {}, "line 1: nested too deeply to read"),
        ('[' * 5000 + ']' * 5000, dict(suffix=".json"), "json': nested too deeply to read"),
        # .json: the error of what the file looks like, a document or JSON Lines; a document with no rows says so
        ('[\n  {\n    "prompt": "a"\n  },\n  {\n    "prompt": "b', dict(suffix=".json"),
         r"json': not valid JSON \(Unterminated string at its end: cut short\?\)$"),
        ('[\n  {"prompt": "a"},\n  {"prompt" "b"}\n]', dict(suffix=".json"),
         r"json': not valid JSON \(Expecting ':' delimiter at line 3 column 13\)$"),
        ('{"prompt": "a"}\n{"prompt": "b"\n', dict(suffix=".json"), "line 2: not valid JSON"),
        ("[]", dict(suffix=".json"), "json' has no rows$"),
        ('{"prompt": []}', dict(suffix=".json"), "json' has no rows$"),
        ("\n\n", {}, "is empty"),
    ],
)
def test_bad_datasets_are_clear_errors(tmp_path, content, kwargs, message):
    path = tmp_path / f"d{kwargs.pop('suffix', '.jsonl')}"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(str(path), **{"num_prompts": 1, **kwargs})


def test_other_fields_of_mixed_types_do_not_matter(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "n": 1}\n{"prompt": "b", "n": "x"}\n{"n": 2}\n')
    assert sorted(load_prompts(str(tmp_path / "d.jsonl"), num_prompts=None)) == ["a", "b"]
    # A row without the text is left out; where that leaves too few, the refusal says why there are fewer.
    with pytest.raises(ValueError, match=r"has 2 \(1 of its 3 rows have no text in field 'prompt'\)$"):
        load_prompts(str(tmp_path / "d.jsonl"), num_prompts=3)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        load_prompts(str(tmp_path / "folder.jsonl"))


def test_json_columns_and_non_utf8(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"prompt": ["a", "b", "c"]}))
    assert sorted(load_prompts(str(tmp_path / "c.json"), num_prompts=None)) == ["a", "b", "c"]
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        load_prompts(str(tmp_path / "latin.jsonl"))


def _offline(monkeypatch, datasets_cache):
    """HF_HUB_OFFLINE=1 as huggingface_hub and datasets read it once imported, with datasets' cache in a folder."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)


def test_offline_hub_dataset_not_cached_says_why(monkeypatch, tmp_path):
    _offline(monkeypatch, tmp_path / "datasets")
    with pytest.raises(ValueError, match=r"not in the datasets cache, and the Hub cannot be asked \(HF_HUB_OFFLINE"):
        load_prompts("someone/some-dataset")


def test_offline_hub_dataset_is_read_from_the_datasets_cache(monkeypatch, tmp_path):
    """A Hub dataset loaded once before is read from datasets' cache while the Hub cannot be asked. The cache is made
    without the Hub: the json builder prepares the rows under the name and layout a Hub load would have given them."""
    from datasets.packaged_modules.json.json import Json

    _offline(monkeypatch, tmp_path / "datasets")
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"prompt": f"cached {i}"}) for i in range(3)))
    builder = Json(dataset_name="tiny", data_files={"train": str(tmp_path / "rows.jsonl")}, hash="0" * 16,
                   cache_dir=str(tmp_path / "datasets"))
    builder.download_and_prepare()
    prepared = next((tmp_path / "datasets" / "tiny").glob("default-*"))
    (tmp_path / "datasets" / "someone___tiny").mkdir()
    prepared.rename(tmp_path / "datasets" / "someone___tiny" / "default")
    assert sorted(load_prompts("someone/tiny", num_prompts=None)) == [f"cached {i}" for i in range(3)]


def test_a_hub_dataset_is_asked_offline_where_the_hub_cannot_be_reached(monkeypatch):
    """Online, datasets would retry the Hub and log each try beside the one-line error: where the Hub cannot be
    reached, it is asked offline (its cache alone), and the switch is restored after."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr("skipsearch.io.models.hub_unreachable", lambda: "no route")
    asked = []

    def uncached(*_, **__):
        asked.append((datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE))
        raise FileNotFoundError("not cached")

    monkeypatch.setattr(datasets, "load_dataset", uncached)
    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    with pytest.raises(ValueError, match=r"the Hub cannot be asked \(no route\)"):
        load_prompts("someone/some-dataset")
    assert asked == [(True, True)] and (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == before


def test_a_hub_datasets_config_is_given_after_a_colon(monkeypatch, tmp_path):
    """"name:config" reads that config (cached here as a Hub load of it would have cached it); a dataset of several
    configs asked without one names them and the syntax."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    _offline(monkeypatch, tmp_path / "datasets")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "of config main"}))
    Json(dataset_name="tiny", config_name="main", data_files={"train": str(tmp_path / "rows.jsonl")},
         hash="0" * 16, cache_dir=str(tmp_path / "datasets")).download_and_prepare()
    (tmp_path / "datasets" / "someone___tiny").mkdir()
    next((tmp_path / "datasets" / "tiny").glob("main*")).rename(tmp_path / "datasets" / "someone___tiny" / "main")
    assert load_prompts("someone/tiny:main", num_prompts=None) == ["of config main"]

    def several_configs(*_, **__):
        raise ValueError("Config name is missing.\nPlease pick one among the available configs: ['main', 'socratic']"
                         "\nExample of usage:\n\t`load_dataset('someone/gsm', 'main')`")

    monkeypatch.setattr(datasets, "load_dataset", several_configs)
    with pytest.raises(ValueError) as refused:
        load_prompts("someone/gsm")
    assert str(refused.value) == ("cannot read dataset 'someone/gsm': it has configs ['main', 'socratic']: give one "
                                  "as --dataset someone/gsm:CONFIG")


def test_jsonl_rows_keep_unicode_line_separators_inside_strings(tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028, U+2029 and U+0085 raw inside strings: a row ends at "\n" alone.
    texts = ["a\u2028b", "c\x85d", "e\u2029f"]
    path = tmp_path / "u.jsonl"
    path.write_bytes("\r\n".join(json.dumps({"prompt": t}, ensure_ascii=False) for t in texts).encode() + b"\n\n{")
    with pytest.raises(ValueError, match="line 5: not valid JSON"):  # the line numbers count "\n" alone
        load_prompts(str(path), num_prompts=None)
    path.write_bytes("\n".join(json.dumps({"prompt": t}, ensure_ascii=False) for t in texts).encode() + b"\r\n")
    assert sorted(load_prompts(str(path), num_prompts=None)) == texts


def test_one_json_lines_row_saved_as_json_is_one_record(tmp_path):
    (tmp_path / "one.json").write_text('{"prompt": "x", "category": "qa"}')
    assert load_prompts(str(tmp_path / "one.json"), num_prompts=None) == ["x"]
    (tmp_path / "turns.json").write_text('{"turns": ["hi", "and then?"], "id": 3}')
    assert load_prompts(str(tmp_path / "turns.json"), field="turns", num_prompts=None) == ["hi"]
    (tmp_path / "columns.json").write_text('{"prompt": ["a", "b"], "n": [1, 2]}')  # all lists: still columns
    assert sorted(load_prompts(str(tmp_path / "columns.json"), num_prompts=None)) == ["a", "b"]


def _hub_rows(monkeypatch, rows):
    """datasets.load_dataset answering with `rows`, an in-memory dataset, as a Hub dataset's split would be."""
    import datasets

    monkeypatch.setattr("skipsearch.io.models.hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda *_, **__: rows)


@pytest.mark.parametrize("value, message", [
    (datetime.datetime(2024, 5, 1, 12, 30), r"row 1: 'prompt' is a datetime \(\"datetime.datetime\(2024, 5, 1, 12, 30"),
    (b"\x89PNG" * 40, r"row 1: 'prompt' is a bytes \(\"b'\\\\x89PNG.*\.\.\.\), not text or a list of turns$"),
    ([{"bytes": b"\x89PNG", "path": None}], r"row 1: 'prompt': turn 1 is a dict \(\{\"bytes\": \"b'.*\), not text$"),
])
def test_a_hub_column_json_cannot_hold_is_refused_in_one_line(monkeypatch, value, message):
    """A Hub column of datetimes, bytes or images (a dict of bytes) is quoted by its repr, not raised on by json."""
    import datasets

    _hub_rows(monkeypatch, datasets.Dataset.from_dict({"prompt": [value]}))
    with pytest.raises(ValueError, match=message) as refused:
        load_prompts("someone/odd", num_prompts=None)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 160


def test_a_hub_class_label_category_is_read_as_its_name(monkeypatch):
    import datasets

    features = datasets.Features({"prompt": datasets.Value("string"),
                                  "category": datasets.ClassLabel(names=["open_qa", "creative_writing"])})
    _hub_rows(monkeypatch, datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "category": [0, 1, 1]}, features))
    rows = load_rows("someone/labelled", num_prompts=None)
    assert sorted((row.turns[0], row.category) for row in rows) == [("a", "open_qa"), ("b", "creative_writing"),
                                                                   ("c", "creative_writing")]


def test_a_non_utf8_json_file_is_refused_naming_it(tmp_path):
    (tmp_path / "latin.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(ValueError, match=r"dataset '.*latin.json' is not UTF-8 text \(at byte 16\): save it as UTF-8$"):
        load_prompts(str(tmp_path / "latin.json"))


def test_a_json_document_saved_as_jsonl_is_read_as_one(tmp_path):
    path = tmp_path / "pretty.jsonl"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    assert sorted(load_prompts(str(path), num_prompts=None)) == ["a", "b"]
    path.write_text(json.dumps({"prompt": "one"}, indent=2))  # one object, pretty-printed
    assert load_prompts(str(path), num_prompts=None) == ["one"]
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2)[:-3])  # neither: the lines' error
    with pytest.raises(ValueError, match="line 1: not valid JSON"):
        load_prompts(str(path), num_prompts=None)
