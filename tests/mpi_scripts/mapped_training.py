"""Train a DP x TP MLP on 4 ranks under three rank mappings; rank 0 prints JSON saying
whether losses and parameters are bitwise identical and which mappings were used."""
import json

import numpy as np

import distgraph as dg
dg.set_default_dtype("float64")
class Data:
    def __init__(s): r=np.random.default_rng(0); s.x=r.normal(size=(64,8)); s.y=r.normal(size=(64,4))
    def __len__(s): return 64
    def __getitem__(s,i): return s.x[i], s.y[i]
mesh=dg.ProcessMesh([[0,1],[2,3]],["dp","mp"])
class M(dg.nn.Layer):
    def __init__(s):
        super().__init__(); s.fc1=dg.nn.Linear(8,16); s.fc2=dg.nn.Linear(16,4)
    def forward(s,x):
        dg.shard_tensor(x, mesh, ["dp",None]); return s.fc2(dg.ops.relu(s.fc1(x)))
res=[]
for mapping in [None, {0:3,1:2,2:1,3:0}, {0:1,1:0,2:3,3:2}]:
    dg.seed(0); m=M(); dg.shard_tensor(m.fc1.weight, mesh, [None,"mp"]); dg.shard_tensor(m.fc2.weight, mesh, ["mp",None])
    e=dg.Engine(m, dg.nn.MSELoss(), dg.optim.Adam(0.01), cluster=dg.Cluster.local(4), rank_mapping=mapping)
    h=e.fit(Data(), batch_size=16); sd=e.state_dict()
    res.append((h.losses, sd, e._backends["train"].rank_of))
from mpi4py import MPI  # noqa: E402
if MPI.COMM_WORLD.rank==0:
    same = all(r[0] == res[0][0] and all(np.array_equal(r[1][k], res[0][1][k]) for k in r[1])
               for r in res)
    print(json.dumps({"identical": same, "rank_of": [r[2] for r in res]}))
