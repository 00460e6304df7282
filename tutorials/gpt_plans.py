"""The hand-written tensor-parallel plan the tutorials train GPT with (tutorial 02
explains it): each block's Linear layers split over the mesh's ``mp`` dim (first Linear
of the attention and of the MLP by columns, weight and bias; second by rows). The MLP
then runs the Megatron way; the attention, whose ``qkv`` packs q | k | v, runs whole on
each mp rank from gathered weights. The batch is split over ``dp`` by ``dg.shard_dataloader``, not by the model.
Shared by tutorials 02, 05, 06 and 07.

Example::

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = dg.nn.GPT(vocab_size=128, d_model=64, n_layer=2, n_head=4, max_seq_len=32)
    megatron(model, mesh)
    engine.fit(dg.shard_dataloader(data, mesh, shard_dims="dp"), batch_size=16)
"""

import distgraph as dg


def megatron(model, mesh):
    """Column-split the first Linear of each attention and MLP, row-split the second."""
    for block in model.blocks:
        megatron_block(block, mesh)


def megatron_block(block, mesh):
    """The split of one TransformerBlock."""
    for first, second in ((block.attn.qkv, block.attn.proj), (block.mlp.fc1, block.mlp.fc2)):
        dg.shard_tensor(first.weight, mesh, [None, "mp"])
        dg.shard_tensor(first.bias, mesh, ["mp"])
        dg.shard_tensor(second.weight, mesh, ["mp", None])
