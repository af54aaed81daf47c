"""Synthetic, learnable data for tests and benchmarks: every item is a pure function of (seed, sample id).

``SyntheticLM`` yields token sequences from a noisy affine recurrence ``t[i+1] = (a * t[i] + c) mod V`` (with
probability ``1 - noise``, else a random token), so a small model's loss falls quickly and every process
rebuilds exactly the same sample for the same id without any file or communication.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["SyntheticLM", "microbatches"]


class SyntheticLM(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, *, seed: int = 0,
                 noise: float = 0.1) -> None:
        if num_samples < 1 or seq_len < 2 or vocab_size < 4:
            raise ValueError("SyntheticLM needs num_samples >= 1, seq_len >= 2, vocab_size >= 4")
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.seed, self.noise = seed, noise

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        v = self.vocab_size
        tokens = torch.empty(self.seq_len, dtype=torch.long)
        tokens[0] = torch.randint(v, (1,), generator=g)
        jumps = torch.rand(self.seq_len, generator=g) < self.noise
        randoms = torch.randint(v, (self.seq_len,), generator=g)
        for i in range(1, self.seq_len):
            tokens[i] = randoms[i] if jumps[i] else (5 * tokens[i - 1] + 3) % v
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens.clone(),
                "sample_id": index}


def microbatches(batch: dict[str, torch.Tensor], num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """Split a batch into at most ``num_microbatches`` nearly equal micro-batches (none empty)."""
    n = next(iter(batch.values())).shape[0]
    parts = min(num_microbatches, n)
    chunks = {k: torch.tensor_split(v, parts) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]
