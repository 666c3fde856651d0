"""The draft head's vocabulary: the ranking a study makes, and the head a config carries."""

import pytest
import torch

from conftest import tiny_model
from skipsearch.decode.skipset import DraftHead, SkipSet
from skipsearch.search.vocabulary import VocabularyRanking, rank_vocabulary


def test_the_ranking_sums_the_models_own_probabilities_special_tokens_first():
    model = tiny_model("llama", seed=3, vocab_size=40)
    prompts, continuations = [[5, 9, 14], [3, 3, 8, 1]], [[7, 7], [2]]
    ranking = rank_vocabulary(model, prompts, continuations, first=[39, 0, 39])
    weight = torch.zeros(40, dtype=torch.float64)
    with torch.no_grad():
        for prompt, continuation in zip(prompts, continuations):
            weight += model(torch.tensor([prompt + continuation])).logits[0].softmax(-1).sum(0).double()
    expected = [t for t in torch.sort(weight, descending=True, stable=True).indices.tolist() if t not in (39, 0)]
    assert ranking.ids == (39, 0, *expected)
    by_weight = [t for t in torch.sort(weight, descending=True, stable=True).indices.tolist() if t != 39]
    assert rank_vocabulary(model, prompts, continuations, first=[39], keep=5).ids == (39, *by_weight[:4])
    assert VocabularyRanking.from_text(ranking.to_text()) == ranking
    assert ranking.head(3) == DraftHead((0, 39, expected[0])) and ranking.head(0) is None
    assert ranking.coverage([39, 0, expected[-1]], 2) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="ranking of 40 tokens"):
        ranking.head(41)


def test_a_draft_head_round_trips_through_its_compact_form_and_refuses_bad_ids():
    head = DraftHead((9, 2, 40000, 3))
    data = head.to_json(vocab_size=49152)
    assert data["rows"] == 4 and len(data["bitmap"]) < 200  # a deflated bitmap, not 49152 bits
    assert DraftHead.from_json(data) == head and DraftHead.from_json(data).ids == (2, 3, 9, 40000)
    assert hash(DraftHead((3, 2))) == hash(DraftHead((2, 3)))
    assert SkipSet(head=head) != SkipSet() and SkipSet(head=head).drafts and not SkipSet().drafts
    for ids, message in (((), "at least one"), ((1, 1), "duplicates"), ((-1,), ">= 0"), ((True,), ">= 0")):
        with pytest.raises(ValueError, match=message):
            DraftHead(ids)
    with pytest.raises(ValueError, match="out of range"):
        head.to_json(vocab_size=100)
    with pytest.raises(ValueError, match="sha256"):
        DraftHead.from_json({**data, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="needs 'rows'"):
        DraftHead.from_json({"rows": 4})


def test_the_ranking_prompts_are_the_datasets_others_never_calibration_prompts(tmp_path, default_model):
    import json

    from skipsearch.api.optimize import OptimizeSettings, _ranking_prompts
    from skipsearch.io.data import load_rows
    from skipsearch.io.models import encode_prompt

    texts = [f"Question number {i}: what is {i} plus {i}?" for i in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    settings = OptimizeSettings(dataset=[str(tmp_path / "d.jsonl")], num_prompts=2, head_prompts=3)
    calibration = load_rows(str(tmp_path / "d.jsonl"), num_prompts=2, seed=0)
    said = []
    ranked, rows = _ranking_prompts(settings, [str(tmp_path / "d.jsonl")], calibration, default_model, said.append)
    encoded = {tuple(encode_prompt(default_model.tokenizer, t)): t for t in texts}
    names = [encoded[tuple(ids)] for ids in ranked]
    assert len(names) == 3 and not set(names) & {row.turns[0] for row in calibration} and not said
    assert [row.turns[0] for row in rows] == names  # the rows a config names as its study's (bench holds them out)
    every = load_rows(str(tmp_path / "d.jsonl"), num_prompts=None, seed=0)
    assert _ranking_prompts(settings, [str(tmp_path / "d.jsonl")], every, default_model, said.append) == ([], [])
    assert "ranked on the calibration prompts" in said[0]
