"""The draft head's vocabulary: the model's tokens ranked by how much probability the model itself gives them on a
study's ranking prompts (heads.py: prompts of its dataset beside the calibration prompts), so that a head of the top
rows covers what the model goes on to say.

The ranking sums the model's next-token distributions over every position of each prompt and of its plain greedy
continuation (teacher-forced in one forward per prompt): a token the
model puts weight on anywhere counts, not only the tokens its argmax picked. The tokenizer's special tokens (EOS
above all: a draft that cannot propose the end stops no round) come first whatever their weight. A head of the top N
rows is `VocabularyRanking.head(N)`. Coverage on prompts that did not make the ranking is measured by
`benchmarks/draft_head.py` (BENCHMARKS.md).
"""

from __future__ import annotations

import base64
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..decode.skipset import DraftHead

RANKED_POSITIONS_PER_FORWARD = 256  # the softmax of this many positions at once: (positions x vocab) floats


@dataclass(frozen=True)
class VocabularyRanking:
    """Token ids, the most probable first, as many as the largest head a study may try."""

    ids: tuple[int, ...]

    def head(self, rows: int | None) -> DraftHead | None:
        """The draft head of the top `rows` tokens; None (the full head) for None or 0."""
        if not rows:
            return None
        if rows > len(self.ids):
            raise ValueError(f"a head of {rows} rows was asked of a ranking of {len(self.ids)} tokens")
        return DraftHead(self.ids[:rows])

    def coverage(self, tokens: Iterable[int], rows: int) -> float:
        """The share of `tokens` among the top `rows`."""
        top, tokens = frozenset(self.ids[:rows]), list(tokens)
        return sum(t in top for t in tokens) / len(tokens) if tokens else 1.0

    def to_text(self) -> str:
        """A compact text form (for a study's attributes): the ids as 32-bit integers, deflated, in base64."""
        return base64.b64encode(zlib.compress(array("i", self.ids).tobytes(), 9)).decode("ascii")

    @classmethod
    def from_text(cls, text: str) -> VocabularyRanking:
        ids = array("i")
        ids.frombytes(zlib.decompress(base64.b64decode(text)))
        return cls(tuple(ids))


@torch.inference_mode()
def rank_vocabulary(model: torch.nn.Module, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                    first: Iterable[int] = (), keep: int | None = None) -> VocabularyRanking:
    """Rank `model`'s vocabulary by the probability it sums over every position of each prompt and its continuation
    (one forward each), the ids in `first` (special tokens) ahead of all; the top `keep` (None: all)."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    weight = torch.zeros(vocab_size, dtype=torch.float64, device=model.device)
    for prompt, continuation in zip(prompts, continuations):
        ids = torch.tensor([list(prompt) + list(continuation)], device=model.device)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        for start in range(0, hidden.shape[0], RANKED_POSITIONS_PER_FORWARD):
            logits = model.get_output_embeddings()(hidden[start : start + RANKED_POSITIONS_PER_FORWARD])
            weight += _softcapped(model, logits).float().softmax(-1).sum(0, dtype=torch.float64)
    special = list(dict.fromkeys(i for i in first if 0 <= i < vocab_size))
    weight[special] = -1.0  # placed ahead of all, in their order, below
    # A stable sort: ties keep id order, so that a ranking is the same on every run.
    order = torch.sort(weight, descending=True, stable=True).indices[: (keep or vocab_size) - len(special)]
    return VocabularyRanking(tuple(special + order.tolist())[: keep or vocab_size])


def _softcapped(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The model's final soft cap (Gemma 2), where its config has one: the distribution decoding samples from."""
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits
