"""Logistic regression on MNIST with IncA: a Flower App (see ../README.md)."""

import os

# The example uses no GPU: opt in now to Ray's future default (it then no longer warns about the change).
# Set here, when Flower loads the app, so that both routes (`flwr run`, `python -m mnist_logreg.run`) get it.
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
