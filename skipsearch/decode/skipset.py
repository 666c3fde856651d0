"""A skip set: which decoder layers' attention and MLP sublayers a draft skips, and which rows of the LM head it reads
(`DraftHead`; None: all of them). Plain values, with no torch, so that configs, studies, plots and the command line
carry them without importing the draft path (skipping.py)."""

from __future__ import annotations

import base64
import functools
import hashlib
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class DraftHead:
    """The vocabulary a draft's LM head reads: token ids, most probable first where a ranking made them (any order
    where a config was read). Two heads are equal when they hold the same ids, in whatever order.

    The draft computes logits for these rows only; every other token gets the lowest finite logit, so its draft
    probability is zero and its greedy draft never wins. Verification always reads the full head."""

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        ids = tuple(self.ids)
        if not ids:
            raise ValueError("a draft head needs at least one token id")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"draft head token ids must be integers >= 0, got {i!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"draft head token ids contain duplicates ({len(ids) - len(set(ids))} repeated)")
        object.__setattr__(self, "ids", ids)

    @property
    def rows(self) -> int:
        return len(self.ids)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the sorted ids: what equality, hashing and a config's check compare."""
        return hashlib.sha256(",".join(map(str, sorted(self.ids))).encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftHead) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"DraftHead(rows={self.rows}, digest={self.digest[:12]})"

    def check_fits(self, vocab_size: int) -> None:
        """Raise ValueError unless every id names one of `vocab_size` tokens."""
        top = max(self.ids)
        if top >= vocab_size:
            raise ValueError(f"draft head token id {top} is out of range: the model's vocabulary has {vocab_size} "
                             f"tokens (ids 0..{vocab_size - 1})")

    def to_json(self, vocab_size: int) -> dict[str, Any]:
        """The compact form a skip config carries: the ids as a bitmap over the vocabulary, deflated, in base64."""
        self.check_fits(vocab_size)
        bits = bytearray((vocab_size + 7) // 8)
        for i in self.ids:
            bits[i >> 3] |= 1 << (i & 7)
        return {"rows": self.rows, "vocab_size": vocab_size, "sha256": self.digest,
                "bitmap": base64.b64encode(zlib.compress(bytes(bits), 9)).decode("ascii")}

    @classmethod
    def from_json(cls, data: Any) -> DraftHead:
        """The head `to_json` wrote; ValueError saying what is wrong for anything else."""
        if not isinstance(data, dict) or not {"rows", "vocab_size", "bitmap"} <= data.keys():
            raise ValueError("a draft head needs 'rows', 'vocab_size' and 'bitmap'")
        rows, vocab_size, text = data["rows"], data["vocab_size"], data["bitmap"]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (rows, vocab_size)):
            raise ValueError("a draft head's 'rows' and 'vocab_size' must be integers >= 1")
        try:
            bits = zlib.decompress(base64.b64decode(text, validate=True))
        except (TypeError, ValueError, zlib.error):
            raise ValueError("a draft head's 'bitmap' is not base64 of deflated bytes") from None
        if len(bits) != (vocab_size + 7) // 8:
            raise ValueError(f"a draft head's bitmap has {len(bits) * 8} bits for a vocabulary of {vocab_size}")
        ids = tuple(i for i in range(vocab_size) if bits[i >> 3] >> (i & 7) & 1)
        if len(ids) != rows or not ids:
            raise ValueError(f"a draft head's bitmap holds {len(ids)} ids, not the {rows} its 'rows' says")
        head = cls(ids)
        if "sha256" in data and data["sha256"] != head.digest:
            raise ValueError("a draft head's ids do not match its 'sha256' (the file was changed)")
        return head


@dataclass(frozen=True)
class SkipSet:
    """0-based decoder-layer ids whose attention / MLP the draft skips (sorted, unique), and the rows of the LM head
    the draft reads (`head`; None: the full head)."""

    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()
    head: DraftHead | None = None

    @classmethod
    def of(cls, attn: Iterable[int] = (), mlp: Iterable[int] = (), num_layers: int | None = None,
           head: DraftHead | None = None) -> SkipSet:
        """Build a validated skip set; `num_layers` bounds the ids when given."""
        return cls(_layer_ids(attn, "attn", num_layers), _layer_ids(mlp, "mlp", num_layers), head)

    @property
    def size(self) -> int:
        """How many sublayers the draft skips (the head not counted)."""
        return len(self.attn) + len(self.mlp)

    @property
    def drafts(self) -> bool:
        """Whether the draft differs from the full model at all: a sublayer skipped or the head trimmed."""
        return bool(self.size) or self.head is not None

    @property
    def head_rows(self) -> int | None:
        """The rows of the LM head the draft reads; None: all of them."""
        return None if self.head is None else self.head.rows

    @property
    def sublayers(self) -> SkipSet:
        """The same sublayers skipped, with the full head (the draft path's layers depend on nothing else)."""
        return SkipSet(self.attn, self.mlp) if self.head is not None else self

    def skipped_fraction(self, num_layers: int) -> float:
        return self.size / (2 * num_layers)

    def check_fits(self, num_layers: int) -> None:
        """Raise ValueError if an id does not name one of `num_layers` layers."""
        SkipSet.of(self.attn, self.mlp, num_layers)

    def as_dict(self) -> dict[str, Any]:
        """The sublayers, and the head's row count where it is trimmed (a config carries the head's ids apart)."""
        out: dict[str, Any] = {"attn": list(self.attn), "mlp": list(self.mlp)}
        if self.head is not None:
            out["head_rows"] = self.head.rows
        return out

    def __str__(self) -> str:
        return f"attn={list(self.attn)} mlp={list(self.mlp)}" + (f" head={self.head.rows}" if self.head else "")


def _layer_ids(ids: Iterable[int], kind: str, num_layers: int | None) -> tuple[int, ...]:
    ids = list(ids)
    for i in ids:
        # bool is an int subclass; True as a layer id is a bug, not layer 1.
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"{kind} skip ids must be integers, got {i!r}")
        if i < 0 or (num_layers is not None and i >= num_layers):
            bound = f"0..{num_layers - 1}" if num_layers is not None else ">= 0"
            raise ValueError(f"{kind} skip id {i} is out of range: layer ids are {bound}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{kind} skip ids contain duplicates: {ids}")
    return tuple(sorted(ids))
