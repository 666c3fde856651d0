"""The prompts a command decodes, as token ids, each with its category.

A row of several user turns is a conversation: each turn but the last is answered by the model itself, decoded
greedily and plainly (untimed, as every method would answer it: greedy decoding is lossless), and the last turn is
asked after those answers, through the chat template. The context each prompt needs is checked before any decoding;
one that does not fit the model is skipped with a line saying so, or refused, as `too_long` asks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..decode.kvcache import check_cache_memory
from ..decode.loop import generate
from ..io import models
from ..io.data import PromptRow

TOO_LONG = ("refuse", "skip")


@dataclass(frozen=True)
class EncodedPrompts:
    """The prompts kept, as token ids, and each one's category (None: the dataset has none), in the draw's order."""

    ids: list[list[int]]
    categories: list[str | None]
    kept: list[int]  # which of the rows each prompt is (a prompt too long for the model's context may be skipped)


def encode_rows(loaded: models.LoadedModel, rows: list[PromptRow], raw: bool, max_new_tokens: int,
                max_draft_tokens: int, too_long: str = "refuse", say: Callable[[str], None] = print,
                show_progress: bool = False) -> EncodedPrompts:
    """`rows` as token ids, each checked first to leave the model room for its answers in its context, and for its
    answers and a round's drafts in the device's memory; a conversation's earlier turns answered by plain greedy
    decoding."""
    if too_long not in TOO_LONG:
        raise ValueError(f"too_long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
    kept = [i for i, row in enumerate(rows) if _fits(loaded, row, raw, max_new_tokens, too_long, say)]
    if not kept:
        raise ValueError("every prompt is too long for the model's context: lower --max-new-tokens or give shorter "
                         "prompts")
    longest = max(_upper_bound(loaded, rows[i], raw, max_new_tokens) for i in kept)
    check_cache_memory(loaded.model, longest + max_new_tokens + max_draft_tokens)
    conversations = sum(len(rows[i].turns) > 1 for i in kept)
    bar = tqdm(total=conversations, desc="answering earlier turns", unit="conversation",
               disable=not show_progress or not conversations)
    ids = []
    with bar:
        for i in kept:
            ids.append(_encoded(loaded, rows[i], raw, max_new_tokens))
            bar.update(len(rows[i].turns) > 1)
    return EncodedPrompts(ids, [rows[i].category for i in kept], kept)


def _upper_bound(loaded: models.LoadedModel, row: PromptRow, raw: bool, max_new_tokens: int) -> int:
    """The most tokens the prompt can take: its turns with empty answers, plus room for each answer."""
    empty = [""] * (len(row.turns) - 1)
    return len(models.encode_conversation(loaded.tokenizer, row.turns, empty, raw=raw)) + len(empty) * max_new_tokens


def _fits(loaded: models.LoadedModel, row: PromptRow, raw: bool, max_new_tokens: int, too_long: str,
          say: Callable[[str], None]) -> bool:
    """Whether the prompt fits the model's context; when it does not, a line (skip) or a ValueError (refuse)."""
    try:
        models.check_context(loaded.model, _upper_bound(loaded, row, raw, max_new_tokens), max_new_tokens)
        return True
    except ValueError as error:
        where = f"{row.where}" + (f" ({row.category})" if row.category else "")
        if too_long == "refuse":
            raise ValueError(f"{where}: {error} (--too-long skip leaves such prompts out)") from None
        say(f"skipped {where}: {error}")
        return False


def _encoded(loaded: models.LoadedModel, row: PromptRow, raw: bool, max_new_tokens: int) -> list[int]:
    """The prompt's ids, the model's own answers to its earlier turns included (up to `max_new_tokens` each)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    answers: list[str] = []
    for number in range(1, len(row.turns)):
        ids = models.encode_conversation(tokenizer, row.turns[:number], answers, raw=raw)
        out = generate(model, ids, skip=None, max_new_tokens=max_new_tokens,
                       eos_token_id=model.generation_config.eos_token_id)
        answers.append(tokenizer.decode(out.tokens, skip_special_tokens=True).strip())
    return models.encode_conversation(tokenizer, row.turns, answers, raw=raw)
