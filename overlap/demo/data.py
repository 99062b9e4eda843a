"""The demo's training data: a fixed token stream from a small Markov chain, generated from a seed.

Each token's successor is drawn from a row of a transition matrix whose logits are Gaussian and scaled by
`SHARPNESS`, so every token has a few likely successors: a model that learns the table predicts the next
token far better than chance, and the loss falls within a few dozen steps. The stream is the same on
every rank and in both runs of the demo (a ``torch.Generator`` seeded with the seed), and nothing is
downloaded. `entropy_rate` is the loss a perfect model would reach (nats per token).
"""

from __future__ import annotations

import torch

#: scale of the transition logits: larger means fewer likely successors and a lower reachable loss
SHARPNESS = 3.0


def transition_matrix(vocab: int, seed: int) -> torch.Tensor:
    """``[vocab, vocab]`` float64 probabilities: row ``i`` is the distribution of the token after ``i``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * SHARPNESS
    return logits.softmax(-1)


def batches(vocab: int, seq_len: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """``[steps, seq_len + 1, batch]`` int64 tokens, ``[s, b]`` per step as the model takes them (inputs
    are rows ``0 .. s-1``, targets rows ``1 .. s``). Each sequence starts from a uniformly drawn token and
    follows the chain; steps are drawn one after the other, so fewer steps are a prefix of more."""
    probs = transition_matrix(vocab, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.empty(steps, seq_len + 1, batch, dtype=torch.int64)
    for step in range(steps):
        tokens[step, 0] = torch.randint(vocab, (batch,), generator=gen)
        for t in range(seq_len):
            tokens[step, t + 1] = torch.multinomial(probs[tokens[step, t]], 1, generator=gen).squeeze(1)
    return tokens


def entropy_rate(vocab: int, seed: int) -> float:
    """The chain's entropy per token under its stationary distribution (nats): the lowest expected loss."""
    probs = transition_matrix(vocab, seed)
    stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(200):  # power iteration; the chain is dense, so it converges fast
        stationary = stationary @ probs
    row_entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
    return float(stationary @ row_entropy)
