"""PyTorch's Adam written by hand in numpy, shared by the benchmarks' reference steps."""

import math

import numpy as np


def adam_(p, g, m, v, t, lr, beta1, beta2, eps):
    """Adam in place on p, m, v (step t counts from 1), with one scratch buffer for every
    intermediate, as a careful numpy programmer writes it."""
    f = p.dtype.type
    tmp = np.multiply(g, f(1.0 - beta1))
    m *= f(beta1)
    m += tmp
    np.multiply(g, g, out=tmp)
    tmp *= f(1.0 - beta2)
    v *= f(beta2)
    v += tmp
    np.sqrt(v, out=tmp)
    tmp *= f(1.0 / math.sqrt(1.0 - beta2 ** t))
    tmp += f(eps)
    np.divide(m, tmp, out=tmp)
    tmp *= f(lr / (1.0 - beta1 ** t))
    p -= tmp
