"""The hand-written plan the tutorials train GPT with (tutorial 02 explains it): the batch
split over the mesh's ``dp`` dim, and each block's Linear layers split the Megatron way
over ``mp`` (first Linear of the attention and of the MLP by columns, weight and bias;
second by rows). Shared by tutorials 02, 05 and 06.

Example::

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    model = DataParallelGPT(mesh, vocab_size=128, d_model=64, n_layer=2, n_head=4,
                            max_seq_len=32)
    megatron(model, mesh)
"""

import distgraph as dg


class DataParallelGPT(dg.nn.GPT):
    """GPT whose input batch is split over the mesh's ``dp`` dim (``mesh`` None: serial)."""

    def __init__(self, mesh, **kwargs):
        super().__init__(**kwargs)
        self.mesh = mesh

    def forward(self, idx):
        if self.mesh is not None:
            dg.shard_tensor(idx, self.mesh, ["dp", None])
        return super().forward(idx)


def megatron(model, mesh):
    """Column-split the first Linear of each attention and MLP, row-split the second."""
    for block in model.blocks:
        for first, second in ((block.attn.qkv, block.attn.proj), (block.mlp.fc1, block.mlp.fc2)):
            dg.shard_tensor(first.weight, mesh, [None, "mp"])
            dg.shard_tensor(first.bias, mesh, ["mp"])
            dg.shard_tensor(second.weight, mesh, ["mp", None])
