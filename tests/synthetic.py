"""A small synthetic classification task shared by the simulator's tests: FEATURES inputs, CLASSES
classes, labels from a random linear model plus a little noise (so a linear model can learn them)."""

import numpy as np

FEATURES, CLASSES = 12, 3


def linear_task(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x (n, FEATURES) float32, y (n,) int64), the same for the same seed."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = np.argmax(x @ w + 0.3 * rng.standard_normal((n, CLASSES)), axis=1).astype(np.int64)
    return x, y


class Outlier:
    """A test double of a round's certificates (:class:`flwr_inca.privacy.prefix.RoundPrefix`): its cost with
    every final ``factor`` times the real one (an outlier execution); what it reveals without them, as it is."""

    def __init__(self, real, factor):
        self.real, self.factor = real, factor

    def with_finals(self, finals=None):
        from flwr_inca.privacy.rounds import RoundCertificate

        cert = self.real.with_finals(finals)
        return RoundCertificate(cert.mu * self.factor, cert.methods) if finals is None else cert

    def through(self, iterations):
        return self.real.through(iterations)


def script_outliers(monkeypatch, rounds, factor):
    """Make the rounds in ``rounds`` outliers (:class:`Outlier`) for every driver (``IncaRounds.prefix``)."""
    from flwr_inca.rounds import IncaRounds

    real = IncaRounds.prefix
    monkeypatch.setattr(IncaRounds, "prefix", lambda self, trace, rnd: (
        Outlier(real(self, trace, rnd), factor) if rnd in rounds else real(self, trace, rnd)))
    return real  # the real certificates
