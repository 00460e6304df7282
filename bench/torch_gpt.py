"""GPT-2 (nanoGPT's layout, as ``dg.nn.GPT`` builds it) in PyTorch, for the benchmarks
that compare with PyTorch: token and position embeddings, pre-norm blocks of causal
attention (one Linear d -> 3d, heads contiguous) and an MLP (d -> 4d, GELU's tanh form),
a final norm and an untied head without bias."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        heads = [t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v)]
        a = nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class TorchGPT(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layer: int, n_head: int,
                 max_seq_len: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
