"""Hugging Face checkpoints in and out: a folder as transformers' ``save_pretrained``
writes it (``config.json`` and ``model.safetensors``, or shards with
``model.safetensors.index.json``), read and written with safetensors' own library.

- :func:`from_pretrained` builds a :class:`~distgraph.nn.llama.Llama` from the config
  (``model_type`` llama, mistral, qwen2), or a :class:`~distgraph.nn.mixtral.Mixtral`
  (``mixtral``), and gives it the checkpoint's weights, cast to
  the default dtype (float32 master weights of a bfloat16 checkpoint). With
  ``lazy=True`` it is built under ``dg.LazyGuard``: each parameter reads only the block a
  process asks for, through safetensors' ``get_slice``, so a rank of an Engine never
  holds a whole tensor it does not own.
- :func:`save_pretrained` writes a model's weights (or an Engine's gathered ones) in
  that format, ``config.json`` included, cast to the checkpoint's dtype, in shards of at
  most ``max_shard_size`` with an index above it, as transformers does; files are
  written under temporary names and renamed, so a failure leaves no partial checkpoint.

A config field distgraph cannot honour is one error naming the field: an unknown
``model_type``, a ``hidden_act`` other than silu, a ``rope_type`` not implemented,
sliding windows on some layers only. Names map both ways: distgraph's are transformers'
without ``model.``; Linear weights are ``[in, out]`` here and ``[out, in]`` there.
Mixtral's experts are read from either layout transformers has written: the current
stacked one (``mlp.experts.gate_up_proj`` [E, 2I, hidden], ``mlp.experts.down_proj``
[E, hidden, I]) or the earlier one with a tensor per expert
(``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` and ``block_sparse_moe.gate.weight``);
they are written in the stacked one. distgraph keeps gate and up apart
(``mlp.experts.gate_proj``, ``up_proj`` [E, hidden, I]; ``down_proj`` [E, I, hidden]) so
that tensor parallelism can split each expert's I.

Example::

    model = dg.from_pretrained("path/to/Llama-3.2-1B", lazy=True)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-5))
    ...
    engine.save_pretrained("finetuned/")
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np

from distgraph import dtypes
from distgraph.errors import DistGraphError
from distgraph.nn.layers import Linear
from distgraph.nn.llama import Llama, LlamaConfig
from distgraph.nn.mixtral import Mixtral, MixtralConfig
from distgraph.parameter import LazyGuard

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
              "output_router_logits")
CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")     # a buffer older checkpoints saved
CHECK_CONFIG = ("config.json does not describe these weights; check its vocab_size, "
                "hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, "
                "head_dim")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*$", re.I)


class PretrainedError(DistGraphError):
    """A checkpoint folder or config distgraph cannot read as it is."""


def _fail(path, what: str) -> PretrainedError:
    return PretrainedError(f"{path}: {what}")


# -- config ------------------------------------------------------------------------------------
def config_from_hf(raw: dict, where="config.json") -> LlamaConfig:
    """The LlamaConfig of a transformers config dict (transformers 4 or 5 spelling)."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _fail(where, f"model_type {model_type!r} is not supported; distgraph reads "
                           f"{', '.join(MODEL_TYPES)} checkpoints")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(where, f"hidden_act {act!r}: the LLaMA MLP distgraph builds uses silu")
    theta, scaling = _rope(raw, where)
    window = None
    if model_type in ("mistral", "mixtral"):
        window = raw.get("sliding_window")
    elif model_type == "qwen2":
        layers = set(raw.get("layer_types") or ())
        if raw.get("use_sliding_window") or "sliding_attention" in layers:
            raise _fail(where, "use_sliding_window / layer_types with sliding_attention: "
                               "Qwen2's per-layer sliding windows are not implemented")
    bias = raw.get("attention_bias", False) if model_type == "llama" else model_type == "qwen2"
    fields = {f: raw[f] for f in ("vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "max_position_embeddings",
                                  "rms_norm_eps", "tie_word_embeddings", "initializer_range")
              if raw.get(f) is not None}
    if model_type == "mixtral":
        if raw.get("router_jitter_noise"):
            raise _fail(where, f"router_jitter_noise {raw['router_jitter_noise']}: the "
                               f"router's multiplicative jitter is not implemented (set 0)")
        fields.update({f: raw[f] for f in MOE_FIELDS if raw.get(f) is not None})
        return MixtralConfig(**fields, rope_theta=theta, rope_scaling=scaling,
                             sliding_window=window)
    return LlamaConfig(**fields, rope_theta=theta, rope_scaling=scaling, attention_bias=bias,
                       o_proj_bias=bias and model_type == "llama",
                       mlp_bias=bool(raw.get("mlp_bias", False)), sliding_window=window)


def _rope(raw: dict, where) -> tuple:
    """(rope_theta, rope scaling dict or None) of transformers 5's ``rope_parameters`` or
    4's ``rope_theta`` and ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or dict(raw.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise _fail(where, f"rope_type {kind!r} (rope scaling) is not implemented; "
                           f"distgraph implements default, linear and llama3")
    keys = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise _fail(where, f"rope scaling {kind!r} lacks {', '.join(missing)}")
    return theta, {"rope_type": kind, **{k: float(scaling[k]) for k in keys}}


def config_to_hf(config: LlamaConfig, model_type: str, dtype: str, base: dict | None = None):
    """A transformers config dict for ``config`` (keeping what ``base`` says besides)."""
    raw = dict(base or {})
    raw.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]],
               hidden_act="silu", dtype=dtype, torch_dtype=dtype)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
              "initializer_range"):
        raw[f] = getattr(config, f)
    rope = {"rope_theta": config.rope_theta, "rope_type": "default",
            **(config.rope_scaling or {})}
    raw["rope_parameters"] = rope
    raw.pop("rope_scaling", None)
    raw.pop("rope_theta", None)
    if model_type == "llama":
        raw["attention_bias"], raw["mlp_bias"] = config.attention_bias, config.mlp_bias
    if model_type in ("mistral", "mixtral"):
        raw["sliding_window"] = config.sliding_window
    if model_type == "mixtral":
        raw.update({f: getattr(config, f) for f in MOE_FIELDS}, router_jitter_noise=0.0)
    return raw


# -- names ---------------------------------------------------------------------------------------
def hf_name(name: str) -> str:
    """The checkpoint's name of distgraph parameter ``name`` (of a stacked expert
    weight: the stacked tensor it is read from, ``gate_up_proj`` for gate and up)."""
    name = _EXPERT.sub(lambda m: m[1] + ("gate_up_proj" if m[2] != "down" else "down_proj"),
                       name)
    return name if name.startswith("lm_head.") else "model." + name


_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts\.)(gate|up|down)_proj$")
_LEGACY = {"gate": "w1", "up": "w3", "down": "w2"}


def _expert_sources(name: str, shape: tuple, file_of: dict):
    """(an ExpertTensor, the checkpoint keys it reads, their shape as the config makes
    them) of distgraph's stacked expert weight ``name`` [E, in, out], or None if it is
    not one: the stacked layout if the checkpoint has it, else one tensor per expert."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    experts, n_in, n_out = shape
    key = hf_name(name)
    if key in file_of:
        rows = n_out if m[2] == "down" else 2 * n_out
        offset = n_out if m[2] == "up" else 0
        return ExpertTensor(((file_of[key], key),), offset), (key,), (experts, rows, n_in)
    old = "model." + m[1].replace(".mlp.", ".block_sparse_moe.")
    keys = tuple(f"{old}{e}.{_LEGACY[m[2]]}.weight" for e in range(experts))
    if all(k in file_of for k in keys):
        return ExpertTensor(tuple((file_of[k], k) for k in keys)), keys, (n_out, n_in)
    return ExpertTensor(()), (key,), None           # missing: the caller says so


def _legacy_router(name: str, file_of: dict) -> str:
    """The checkpoint key of a Mixtral router weight ``name`` in either layout."""
    key = hf_name(name)
    if key in file_of or not name.endswith(".mlp.gate.weight"):
        return key
    old = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    return old if old in file_of else key


def _transposed(model) -> set:
    """Names of the Linear weights (stored [in, out] here, [out, in] in a checkpoint)."""
    return {f"{path}.weight" if path else "weight" for path, layer in model.named_sublayers()
            if isinstance(layer, Linear)}


# -- reading -------------------------------------------------------------------------------------
class _Tensors:
    """Which file of a checkpoint folder holds each tensor."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            self.file_of = _index_files(path, index)
        elif os.path.exists(os.path.join(path, WEIGHTS)):
            from safetensors import safe_open

            with safe_open(os.path.join(path, WEIGHTS), framework="numpy") as f:
                self.file_of = {k: os.path.join(path, WEIGHTS) for k in f.keys()}
        else:
            raise _fail(path, f"has neither {WEIGHTS} nor {INDEX}: not a safetensors "
                              f"checkpoint (transformers' save_pretrained writes one)")

    def shape(self, key: str) -> tuple:
        from safetensors import safe_open

        with safe_open(self.file_of[key], framework="numpy") as f:
            return tuple(f.get_slice(key).get_shape())


def _index_files(path: str, index: str) -> dict:
    """{tensor: its shard's path} of a sharded checkpoint's index, every shard it lists
    checked to be in ``path`` (a copy that left one out failed at the first tensor read
    from it, with safetensors' FileNotFoundError naming only the shard)."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        file_of = {k: os.path.join(path, v) for k, v in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise _fail(index, f"not a safetensors index ({type(err).__name__}: {err}): it "
                           f"should hold a \"weight_map\" of tensor -> shard file") from None
    held: dict = {}
    for key, file in sorted(weight_map.items()):
        held.setdefault(file, []).append(key)
    for file, keys in sorted(held.items()):
        if not os.path.isfile(os.path.join(path, file)):
            what = keys[0] if len(keys) == 1 else f"{len(keys)} tensors, {keys[0]} first"
            raise _fail(path, f"{INDEX} lists {file} (holding {what}), which is not in the "
                              f"folder: copy or download every shard the index names")
    return file_of


class CheckpointTensor:
    """A parameter's values in a checkpoint file: ``block(shape, index, dtype)`` reads
    only the block ``index`` of it (through safetensors' ``get_slice``), transposed from
    the file's layout where ``transpose``; what a lazy parameter makes its blocks with."""

    def __init__(self, file: str, key: str, transpose: bool):
        self.file, self.key, self.transpose = file, key, transpose

    def block(self, shape, index, dtype: str) -> np.ndarray:
        from safetensors import safe_open

        index = tuple(slice(0, n) for n in shape) if index is None else tuple(index)
        stored = index[::-1] if self.transpose else index
        with safe_open(self.file, framework="numpy") as f:
            part = f.get_slice(self.key)[stored] if stored else f.get_tensor(self.key)
        part = part.T if self.transpose else part
        return np.array(part, dtype=dtype, order="C")


class ExpertTensor:
    """A stacked expert weight [E, in, out] in a checkpoint: ``parts`` is one (file, key)
    of a stacked tensor [E, out', in] (read from row ``offset`` of its dim 1), or one
    (file, key) per expert of an [out, in] tensor (the earlier layout); ``block`` reads
    only the block asked for, as :class:`CheckpointTensor` does."""

    def __init__(self, parts: tuple, offset: int = 0):
        self.parts, self.offset = parts, offset

    def block(self, shape, index, dtype: str) -> np.ndarray:
        from safetensors import safe_open

        index = tuple(slice(0, n) for n in shape) if index is None else tuple(index)
        (e0, e1, _), (a0, a1, _), (b0, b1, _) = (s.indices(n) for s, n in zip(index, shape))
        rows, cols = slice(self.offset + b0, self.offset + b1), slice(a0, a1)
        if len(self.parts) == 1:
            file, key = self.parts[0]
            with safe_open(file, framework="numpy") as f:
                part = f.get_slice(key)[e0:e1, rows, cols].transpose(0, 2, 1)
        else:
            blocks = []
            for file, key in self.parts[e0:e1]:
                with safe_open(file, framework="numpy") as f:
                    blocks.append(f.get_slice(key)[rows, cols].T)
            part = np.stack(blocks) if blocks else np.zeros((0, a1 - a0, b1 - b0))
        return np.array(part, dtype=dtype, order="C")


def from_pretrained(path, lazy: bool = False) -> Llama:
    """The model of a transformers checkpoint folder ``path`` (module docstring)."""
    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG)
    if not os.path.exists(config_path):
        raise _fail(path, f"has no {CONFIG}: give the folder transformers' save_pretrained "
                          f"wrote")
    with open(config_path) as f:
        raw = json.load(f)
    config = config_from_hf(raw, config_path)
    tensors = _Tensors(path)
    with LazyGuard():                # shapes only: the checkpoint gives the values
        model = (Mixtral if isinstance(config, MixtralConfig) else Llama)(config)
    transposed = _transposed(model)
    params = dict(model.named_parameters())
    experts = {n: _expert_sources(n, tuple(p.shape), tensors.file_of) for n, p in params.items()}
    keys = {n: experts[n][1] if experts[n] else (_legacy_router(n, tensors.file_of),)
            for n in params}
    expected = {k for ks in keys.values() for k in ks}
    extra = sorted(k for k in tensors.file_of if k not in expected and not IGNORED.match(k))
    missing = sorted(k for k in expected if k not in tensors.file_of)
    if extra or missing:
        raise _fail(path, "the checkpoint does not fit the config's model: "
                          + (f"missing {missing[:5]}" if missing else "")
                          + ("; " if extra and missing else "")
                          + (f"unexpected {extra[:5]}" if extra else ""))
    for name, p in params.items():
        if experts[name]:
            reader, used, want = experts[name]
            for key in used:
                stored = tensors.shape(key)
                if stored != want:
                    raise _fail(path, f"tensor {key} has shape {list(stored)}, but "
                                      f"config.json makes it {list(want)} (for {name} "
                                      f"{list(p.shape)}): {CHECK_CONFIG}, "
                                      f"num_local_experts")
            p.init = reader
            if not lazy:
                p.set_value(p.block())
            continue
        key = keys[name][0]
        flip = name in transposed
        stored = tensors.shape(key)
        if (stored[::-1] if flip else stored) != tuple(p.shape):
            want = list(p.shape)[::-1] if flip else list(p.shape)
            raise _fail(path, f"tensor {key} has shape {list(stored)}, but config.json makes it "
                              f"{want}" + (f" ([out, in] of distgraph's {name} "
                                           f"{list(p.shape)})" if flip else "")
                        + f": {CHECK_CONFIG}")
        p.init = CheckpointTensor(tensors.file_of[key], key, flip)
        if not lazy:
            p.set_value(p.block())
    model.pretrained = {"model_type": raw["model_type"], "config": raw,
                        "dtype": raw.get("dtype") or raw.get("torch_dtype") or "float32"}
    return model


# -- writing -------------------------------------------------------------------------------------
def parse_size(size) -> int:
    """Bytes of ``"5GB"`` (1e9), ``"500MiB"`` (2^20 each) or an int."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(str(size))
    if not match:
        raise DistGraphError(f"max_shard_size {size!r}: give bytes or a size such as '5GB'")
    value, unit = float(match[1]), match[2].upper()
    base = 1024 if "I" in unit else 1000
    return int(value * base ** "BKMGT".index(unit[0]))


def check_savable(model) -> None:
    """Raise unless ``model`` is one :func:`save_pretrained` can write (the Llama family)."""
    if not isinstance(model, Llama):
        raise DistGraphError(f"save_pretrained writes a transformers checkpoint of a Llama-"
                             f"family model (dg.nn.Llama, dg.nn.Mixtral, dg.from_pretrained's); "
                             f"a {type(model).__name__} is not one: use engine.save(path), "
                             f"distgraph's checkpoint of any model")


def save_pretrained(model, path, state: dict | None = None, dtype: str | None = None,
                    model_type: str | None = None, max_shard_size="5GB") -> None:
    """Write ``model``'s weights (or ``state``, {name: global array}, e.g. an Engine's
    gathered ones) as a transformers checkpoint folder ``path`` (module docstring).
    ``dtype``: the checkpoint's (default: the one it was loaded from, else float32);
    ``model_type``: llama, mistral, qwen2 or mixtral (default: the loaded one, else
    mixtral for a Mixtral, llama for others)."""
    from safetensors.numpy import save_file

    check_savable(model)
    info = getattr(model, "pretrained", None) or {}
    model_type = model_type or info.get("model_type") or (
        "mixtral" if isinstance(model.config, MixtralConfig) else "llama")
    if model_type not in MODEL_TYPES:
        raise DistGraphError(f"save_pretrained: model_type {model_type!r}; one of "
                             f"{', '.join(MODEL_TYPES)}")
    dtype = dtypes.canonical(dtype or info.get("dtype", "float32"))
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    transposed = _transposed(model)
    tensors = {}
    for name in names:
        value = state[name] if state is not None else params[name].block()
        value = np.asarray(value)
        if _EXPERT.match(name):            # [E, in, out] -> stacked [E, out, in]
            value, key = value.transpose(0, 2, 1), hf_name(name)
            if key in tensors:             # gate's rows first, then up's
                value = np.concatenate([tensors[key], value.astype(tensors[key].dtype)], 1)
        elif name in transposed:
            value = value.T
        tensors[hf_name(name)] = np.ascontiguousarray(value.astype(_numpy_dtype(dtype)))
    shards = _shards(tensors, parse_size(max_shard_size))
    raw = config_to_hf(model.config, model_type, dtype, info.get("config"))
    os.makedirs(path, exist_ok=True)
    written = []
    try:
        for file, keys in shards:
            written.append(_write(path, file, lambda tmp, keys=keys: save_file(
                {k: tensors[k] for k in keys}, tmp, metadata={"format": "pt"})))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                     "weight_map": {k: file for file, keys in shards for k in keys}}
            written.append(_write(path, INDEX, lambda tmp: _dump(index, tmp)))
        written.append(_write(path, CONFIG, lambda tmp: _dump(raw, tmp)))
    except BaseException:
        for name in written:
            os.unlink(os.path.join(path, name))
        raise
    stale = {WEIGHTS, INDEX} - set(written)        # a single file replaces old shards
    for name in os.listdir(path):
        if name in stale or (name.startswith("model-") and name.endswith(".safetensors")
                             and name not in written):
            os.unlink(os.path.join(path, name))


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _shards(tensors: dict, limit: int) -> list:
    """[(file name, keys)]: tensors in order, a new shard where the next would pass
    ``limit`` bytes (a tensor larger than it gets a shard of its own)."""
    groups, size = [[]], 0
    for key, t in tensors.items():
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += t.nbytes
    if len(groups) == 1:
        return [(WEIGHTS, groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _write(folder: str, name: str, write) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return name


def _dump(data: dict, file: str) -> None:
    with open(file, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
