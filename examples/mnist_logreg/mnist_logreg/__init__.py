"""Logistic regression on MNIST with IncA: a Flower App (see ../README.md)."""
