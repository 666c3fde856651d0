"""The full LM head for verification on a CPU: its weight packed once for oneDNN's matrix multiply.

A verification runs the full model over a round's tokens, 2 to 9 at once. On a CPU, PyTorch's fp32 linear for 4 or
more rows chooses a GEMM far slower than its one-row product: on a 2-core Intel Xeon, Gemma 3 270M's head
(262,144 x 640) took 3.4 times its one-row time for nine rows, so a round's verification cost 2.5 plain steps. The
same weight reordered once into oneDNN's blocked layout (what inductor's frozen CPU graphs do) took 1.4 times it,
for any number of rows; up to 3 rows PyTorch's own kernel is as fast or faster, and runs (BENCHMARKS.md, "The
verification's head on a CPU", `benchmarks/verify_head.py`). The packed copy costs the head's size in memory once
per model; plain steps keep the model's own head, and every logit is the same product, summed in another order.

Where the packed path does not apply (no CPU, another dtype than float32, a PyTorch without oneDNN or without the
two operators inductor uses for it), verification keeps the model's own head: `packed_head` returns None.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32,)  # what the packed path is measured and tested for
PACKED_FROM_ROWS = 4  # fewer rows run PyTorch's own kernel: as fast or faster there (module doc)


class PackedHead(nn.Module):
    """The LM head over all rows: from `PACKED_FROM_ROWS` rows on through its weight in oneDNN's blocked layout (one
    copy, any number of rows per call), under that through the model's own weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if rows.shape[0] < PACKED_FROM_ROWS:
            return nn.functional.linear(hidden_states, self.weight, self.bias)
        logits = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return logits.view(*hidden_states.shape[:-1], self.weight.shape[0])


def packed_head(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedHead | None:
    """A `PackedHead` of the head `weight` (vocab, hidden) and `bias`, or None where the packed path does not apply
    (module doc): then the model's own head verifies."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    if not all(hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise")):
        return None
    return PackedHead(weight, bias)
