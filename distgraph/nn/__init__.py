"""Layers, models and losses."""

from distgraph.nn.layer import Layer, LayerList
from distgraph.nn.llama import (Llama, LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaMLP,
                                RMSNorm)
from distgraph.nn.mixtral import Mixtral, MixtralConfig, MixtralSparseMoeBlock
from distgraph.nn.layers import (GPT, MLP, CrossEntropyLoss, Dropout, Embedding, LayerNorm, Linear,
                                 MSELoss, MultiHeadAttention, TransformerBlock)
