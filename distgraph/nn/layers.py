"""Standard layers and the GPT-2 model (nanoGPT architecture and parameter names)."""

from __future__ import annotations

import math

from distgraph import dtypes, ops
from distgraph.annotation import shard_tensor
from distgraph.errors import DistGraphError
from distgraph.registry import DTypeError, ShapeError
from distgraph.initializer import Init
from distgraph.nn.layer import Layer, LayerList
from distgraph.parameter import Parameter


def _param(shape, kind: str, scale: float) -> Parameter:
    """A parameter made by an initialiser (lazy under ``dg.LazyGuard``): its key is the
    next draw of ``dg.seed``'s generator, so models built in the same order match."""
    key = int(dtypes.param_rng().integers(2**63)) if kind != "constant" else 0
    return Parameter.initialized(shape, Init(kind, float(scale), key))


def _uniform(shape, bound):
    return _param(shape, "uniform", bound)


def _normal(shape, std):
    return _param(shape, "normal", std)


def _constant(shape, value):
    return _param(shape, "constant", value)


class Linear(Layer):
    """``y = x @ weight + bias`` with ``weight`` of shape [in_features, out_features]."""

    def __init__(self, in_features, out_features, bias=True, init_std=None):
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        shape = (in_features, out_features)
        self.weight = _normal(shape, init_std) if init_std else _uniform(shape, bound)
        self.bias = None
        if bias:
            self.bias = _constant((out_features,), 0.0) if init_std else \
                _uniform((out_features,), bound)

    def extra_repr(self) -> str:
        n_in, n_out = self.weight.shape
        return f"{n_in}, {n_out}" + ("" if self.bias is not None else ", bias=False")

    def forward(self, x):
        y = ops.matmul(x, self.weight)
        return y + self.bias if self.bias is not None else y


class Embedding(Layer):
    def __init__(self, num_embeddings, embedding_dim, init_std=1.0):
        super().__init__()
        self.weight = _normal((num_embeddings, embedding_dim), init_std)

    def extra_repr(self) -> str:
        return ", ".join(map(str, self.weight.shape))

    def forward(self, ids):
        return ops.embedding(ids, self.weight)


def _shape(n) -> tuple:
    return (int(n),) if isinstance(n, int) else tuple(int(d) for d in n)


class LayerNorm(Layer):
    def __init__(self, normalized_shape, epsilon=1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.weight = _constant(_shape(normalized_shape), 1.0)
        self.bias = _constant(_shape(normalized_shape), 0.0)

    def extra_repr(self) -> str:
        return ", ".join(map(str, self.weight.shape))

    def forward(self, x):
        return ops.layer_norm(x, None, self.weight, self.bias, self.epsilon)


class Dropout(Layer):
    """Seeded dropout: the mask depends on the layer's seed and the training step only."""

    def __init__(self, p=0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise DistGraphError(f"Dropout p must be in [0, 1), got {p}")
        self.p = p
        self.seed = int(dtypes.param_rng().integers(2**31))

    def forward(self, x):
        return ops.dropout(x, self.p, training=self.training, seed=self.seed)


class MLP(Layer):
    """fc1 -> activation -> fc2 (``activation`` is "gelu" or "relu")."""

    def __init__(self, d_in, d_hidden, d_out=None, activation="gelu", init_std=None, dropout=0.0):
        super().__init__()
        if activation not in ("gelu", "relu"):
            raise DistGraphError(f"MLP activation must be gelu or relu, got {activation!r}")
        self.activation = activation
        self.fc1 = Linear(d_in, d_hidden, init_std=init_std)
        self.fc2 = Linear(d_hidden, d_out or d_in, init_std=init_std)
        self.drop = Dropout(dropout)

    def forward(self, x):
        h = ops.gelu(self.fc1(x)) if self.activation == "gelu" else ops.relu(self.fc1(x))
        return self.drop(self.fc2(h))


class MultiHeadAttention(Layer):
    """Causal self-attention with one fused ``qkv`` projection (q | k | v, heads contiguous)."""

    def __init__(self, d_model, n_head, dropout=0.0, causal=True, init_std=None):
        super().__init__()
        if d_model % n_head:
            raise DistGraphError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head, self.causal = n_head, causal
        self.qkv = Linear(d_model, 3 * d_model, init_std=init_std)
        self.proj = Linear(d_model, d_model, init_std=init_std)
        self.attn_drop = Dropout(dropout)
        self.resid_drop = Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        h, hd = self.n_head, d // self.n_head
        q, k, v = ops.split(self.qkv(x), 3, axis=-1)

        def heads(z):
            return ops.transpose(ops.reshape(z, [b, t, h, hd]), [0, 2, 1, 3])

        q, k, v = heads(q), heads(k), heads(v)
        att = ops.scale(ops.matmul(q, k, transpose_y=True), 1.0 / math.sqrt(hd))
        if self.causal:
            att = ops.where(ops.causal_mask(t), att, float("-inf"))
        att = self.attn_drop(ops.softmax(att, axis=-1))
        y = ops.reshape(ops.transpose(ops.matmul(att, v), [0, 2, 1, 3]), [b, t, d])
        return self.resid_drop(self.proj(y))


class TransformerBlock(Layer):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    recompute_unit = True        # Strategy(recompute=True) recomputes inside each one

    def __init__(self, d_model, n_head, dropout=0.0, init_std=None):
        super().__init__()
        self.ln1 = LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_head, dropout, init_std=init_std)
        self.ln2 = LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model, activation="gelu", init_std=init_std, dropout=dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def megatron(self, mesh, dim: str = "mp") -> None:
        """This block's Megatron split over mesh dim ``dim``: ``attn.qkv`` and ``mlp.fc1``
        column-split (weight ``[None, dim]``, bias ``[dim]``), ``attn.proj`` and
        ``mlp.fc2`` row-split (weight ``[dim, None]``); their biases and the norms
        whole."""
        for first, second in ((self.attn.qkv, self.attn.proj), (self.mlp.fc1, self.mlp.fc2)):
            shard_tensor(first.weight, mesh, [None, dim])
            if first.bias is not None:
                shard_tensor(first.bias, mesh, [dim])
            shard_tensor(second.weight, mesh, [dim, None])


class GPT(Layer):
    """GPT-2: token + position embedding, blocks, final LayerNorm, untied LM head.

    Example::

        model = GPT(vocab_size=128, d_model=64, n_layer=2, n_head=4, max_seq_len=32)
        prog = dg.trace(model, dg.InputSpec([4, 32], "int64", "tokens"))
    """

    def __init__(self, vocab_size, d_model, n_layer, n_head, max_seq_len, dropout=0.0):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.wte = Embedding(vocab_size, d_model, init_std=0.02)
        self.wpe = Embedding(max_seq_len, d_model, init_std=0.02)
        self.drop = Dropout(dropout)
        self.blocks = LayerList(TransformerBlock(d_model, n_head, dropout, init_std=0.02)
                                for _ in range(n_layer))
        self.ln_f = LayerNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size, bias=False, init_std=0.02)

    def embed(self, idx):
        """Token plus position embedding of ``idx`` [batch, seq] (then dropout)."""
        t = idx.shape[-1]
        if t > self.max_seq_len:
            raise DistGraphError(f"sequence length {t} exceeds max_seq_len {self.max_seq_len}")
        pos = ops.slice(self.wpe.weight, [0], [0], [t])
        return self.drop(self.wte(idx) + pos)

    def head(self, x):
        """Final LayerNorm and LM head: the logits of hidden states ``x``."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def megatron(self, mesh, dim: str = "mp") -> None:
        """Megatron-LM's tensor parallelism over mesh dim ``dim`` (``dg.parallelize``'s
        ``"megatron"`` plan): every block's (:meth:`TransformerBlock.megatron`), and the
        vocabulary of ``wte`` (``[dim, None]``) and ``lm_head`` (``[None, dim]``) split
        over ``dim`` (Megatron's vocab-parallel embedding and output layer) where its
        size divides the vocabulary (else they stay whole)."""
        self.assign_paths()       # errors name a parameter by its path in the model
        for block in self.blocks:
            block.megatron(mesh, dim)
        if self.wte.weight.shape[0] % mesh.dim_size(dim) == 0:
            shard_tensor(self.wte.weight, mesh, [dim, None])
            shard_tensor(self.lm_head.weight, mesh, [None, dim])


class CrossEntropyLoss(Layer):
    """Mean softmax cross-entropy over all tokens; labels are int64 class ids. Tokens
    labelled ``ignore_index`` (default -100, as Paddle and PyTorch) count for nothing:
    the mean is over the others."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = int(ignore_index)

    def forward(self, logits, labels):
        if not dtypes.is_integer(labels.dtype):
            raise DTypeError(f"CrossEntropyLoss: the label {labels.name!r} is "
                             f"{labels.dtype}, but cross-entropy takes integer class ids: "
                             "give the dataset int64 labels (e.g. y.astype(np.int64)); for "
                             "float targets use MSELoss")
        if tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ShapeError(_label_shape_error(labels, logits))
        return ops.cross_entropy(logits, labels, ignore_index=self.ignore_index)


def _label_shape_error(labels, logits) -> str:
    """What to say when a batch's labels are not the logits' shape without the class dim,
    in terms of one sample (dim 0 is the batch), with the likely fix."""
    have, want = list(labels.shape[1:]), list(logits.shape[1:-1])
    if have == want + [1]:
        fix = ("drop the last dim (y[..., 0] or y.reshape(" + ", ".join(map(str, want)) + "))"
               if want else "drop the last dim (y[0])")
    elif have == want + [logits.shape[-1]]:
        fix = "give class ids, not one-hot rows or scores (y.argmax(-1))"
    else:
        fix = f"give each sample a label of shape {want}"
    per = "per position" if want else "per sample"
    return (f"CrossEntropyLoss: each sample's label {labels.name!r} has shape {have}, but "
            f"its logits have shape {list(logits.shape[1:])} ({logits.shape[-1]} classes), "
            f"so the label needs shape {want}, one class id {per}: {fix}")


class MSELoss(Layer):
    """Mean squared error between the model's output and a label of its dtype and
    shape (a label of another shape is refused, not broadcast)."""

    def forward(self, pred, target):
        if target.dtype != pred.dtype:
            kind = "integer" if dtypes.is_integer(target.dtype) else target.dtype
            raise DTypeError(f"MSELoss: the label {target.name!r} is {kind} ({target.dtype}) "
                             f"but the model's output is {pred.dtype}: give the dataset "
                             f"float labels (fed as {pred.dtype}); for class ids use "
                             "CrossEntropyLoss")
        if tuple(target.shape) != tuple(pred.shape):
            raise ShapeError(_target_shape_error(target, pred))
        return ops.mse_loss(pred, target)


def _target_shape_error(target, pred) -> str:
    """What to say when a batch's regression targets are not the output's shape (they
    would broadcast against it, a silently wrong loss), per sample, with the likely fix."""
    have, want = list(target.shape[1:]), list(pred.shape[1:])
    if have == want + [1]:
        fix = "drop the last dim (y[..., 0])"
    elif have[-1:] == [1] and have[:-1] == want[:-1]:
        fix = (f"give one target per output (y of shape {want}), or make the model's last "
               "layer output 1 feature")
    elif have == want[:-1] and want[-1:] == [1]:
        fix = "add a last dim of 1 (y[..., None])"
    else:
        fix = f"give each sample a target of shape {want}"
    return (f"MSELoss: each sample's label {target.name!r} has shape {have}, but the model's "
            f"output has shape {want}; the label needs the output's shape (it is not "
            f"broadcast): {fix}")
