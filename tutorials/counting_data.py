"""The tutorials' synthetic next-token task: each sequence counts upward from a random
start with a random stride (mod the vocabulary), so after two tokens the rest is
predictable and a GPT that learns the pattern drives the loss far below ln(vocab)."""

import numpy as np


class CountingSequences:
    """Samples (tokens[t], labels[t] = tokens[t+1]) of x_t = (start + stride * t) mod vocab."""

    def __init__(self, n, seq_len, vocab, seed=0):
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, vocab, n)
        strides = rng.integers(1, 4, n)
        t = np.arange(seq_len + 1)
        self.seqs = (starts[:, None] + strides[:, None] * t[None, :]) % vocab

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        return s[:-1].astype(np.int64), s[1:].astype(np.int64)
