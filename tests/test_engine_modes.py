"""The distributed Engine in every mode equals the serial one: fit with validation,
evaluate, predict, state_dict, then fit again (the scopes move between the train, eval
and predict plans through the global values)."""

import numpy as np

import distgraph as dg
from distgraph.runtime.comm.simulated import SimulatedWorld

MESH = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


class Data:
    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.x, self.y = rng.normal(size=(32, 8)), rng.normal(size=(32, 4))

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(dg.nn.Layer):
    def __init__(self, annotate):
        super().__init__()
        self.fc1, self.fc2, self.annotate = dg.nn.Linear(8, 16), dg.nn.Linear(16, 4), annotate
        if annotate:
            dg.shard_tensor(self.fc1.weight, MESH, [None, "mp"])
            dg.shard_tensor(self.fc2.weight, MESH, ["mp", None])

    def forward(self, x):
        if self.annotate:
            dg.shard_tensor(x, MESH, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


def session(comm=None, annotate=True, init=None):
    model = MLP(annotate)
    model.set_state_dict(init)   # simulated ranks are threads sharing dg.seed's generator
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.AdamW(0.01), communicator=comm,
                       strategy=dg.Strategy(sharding=annotate))
    history = engine.fit(Data(0), batch_size=8, epochs=2, valid_data=Data(1))
    evaluated = engine.evaluate(Data(1), 8)["loss"]
    predicted = [out[0] for out in engine.predict(Data(2), 8)]
    params = engine.state_dict()
    more = engine.fit(Data(0), batch_size=8, epochs=3).losses     # one more epoch
    return history.losses + more, [e["val_loss"] for e in history.epochs], evaluated, \
        predicted, params


def test_every_mode_equals_serial(float64):
    dg.seed(0)
    init = MLP(annotate=False).state_dict()
    losses, val, evaluated, predicted, params = session(annotate=False, init=init)
    ranks = SimulatedWorld(4, timeout=60).run(lambda comm: session(comm, init=init))
    for r_losses, r_val, r_eval, r_pred, r_params in ranks:
        assert np.allclose(r_losses, losses, rtol=1e-12, atol=0)
        assert np.allclose(r_val, val, rtol=1e-12, atol=0)
        assert abs(r_eval - evaluated) < 1e-12
        assert all(np.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(r_pred, predicted))
        assert all(np.max(np.abs(r_params[k] - params[k])) < 1e-12 for k in params)
