"""Local training of many clients at once, vectorized over clients with ``torch.func``.

Per-example gradients come from ``torch.func.vmap(grad(...))`` rather than Opacus's
``GradSampleModule``: one vmapped call computes them for the examples of *many* clients (a cohort),
whose parameters may differ (party level, several local steps), without module hooks or one
wrapper per client; any ``nn.Module`` that ``torch.func.functional_call`` can run works. Opacus is
still what composes the rounds (``flwr_inca.privacy`` accountants), and the clipped step is tested
against the MNIST example's Opacus implementation.

Which examples each client uses in each step is decided by the runner from per-(client, round)
streams and sent as index arrays, so a client's update is the same bit for bit in any cohort and
with any number of actors.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)  # their running statistics

__all__ = ["ParamSpec", "LocalWork", "CohortTrainer", "clip_rows", "cross_entropy", "evaluate"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
CHUNK_BYTES = 16 * 2**20  # per-example gradients held at once (they stay in cache)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy (the default loss; losses return one value per example)."""
    return nn.functional.cross_entropy(logits, targets, reduction="none")


@dataclass(frozen=True)
class ParamSpec:
    """Names and shapes of a model's trainable parameters, and their flattening into one vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ParamSpec:
        names, shapes = [], []
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                raise ValueError(
                    f"model_fn: parameter {name!r} has dtype {p.dtype}; the simulator trains and "
                    "averages floating-point parameters only"
                )
            if p.requires_grad:
                names.append(name)
                shapes.append(tuple(p.shape))
        if not names:
            raise ValueError("model_fn: the model has no trainable parameter")
        for name, b in model.named_buffers():
            if b.is_floating_point() or isinstance(_owner(model, name), _BATCH_NORMS):
                raise ValueError(
                    f"model_fn: buffer {name!r} changes in training (e.g. BatchNorm statistics); "
                    "use GroupNorm or LayerNorm (as DP-SGD requires anyway)"
                )
        return cls(tuple(names), tuple(shapes))

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def dimension(self) -> int:
        return sum(self.sizes)

    def vector(self, model: nn.Module) -> np.ndarray:
        params = dict(model.named_parameters())
        return (
            torch.cat([params[n].detach().reshape(-1) for n in self.names]).to(torch.float32).numpy().copy()
        )

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """``vec`` (..., d) -> {name: (..., *shape)} views."""
        out, offset = {}, 0
        lead = vec.shape[:-1]
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out[name] = vec[..., offset : offset + size].reshape(*lead, *shape)
            offset += size
        return out

    def flatten(self, tensors: dict[str, torch.Tensor], lead: int) -> torch.Tensor:
        """{name: (*lead, *shape)} -> (*lead, d)."""
        return torch.cat([tensors[n].reshape(*tensors[n].shape[:lead], -1) for n in self.names], dim=lead)


def _owner(model: nn.Module, name: str) -> nn.Module:
    module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part)
    return module


@dataclass(frozen=True)
class LocalWork:
    """What a group of clients does in one round (cohort-local row numbers, -1 = padding).

    Record level: ``rows`` is (clients, B_max): each client's Poisson sample for its one step.
    Party level: ``rows`` is (clients, steps, B): each step's minibatch.
    """

    clients: np.ndarray  # (c,) client ids
    rows: np.ndarray


class CohortTrainer:
    """Holds a cohort's data and trains any subset of its clients from a global model.

    Args:
        model_fn: builds the model (called once; its parameters are replaced functionally).
        x, y: the cohort's examples; ``rows`` in :class:`LocalWork` index them.
        unit: ``"record"`` or ``"party"``.
        lr, clip_norm, batch_size: see ``SimulationConfig``.
        party_clip: L2 bound on each client's update.
        loss_fn: per-example loss ``loss_fn(outputs, targets) -> (batch,)``.
        threads: torch threads (1 in a Ray actor that owns one CPU).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        x: np.ndarray,
        y: np.ndarray,
        *,
        unit: str,
        lr: float,
        clip_norm: float,
        batch_size: int,
        party_clip: float,
        loss_fn: LossFn | None = None,
        threads: int | None = None,
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.model = model_fn()
        self.spec = ParamSpec.of(self.model)
        self.buffers = {k: v.detach() for k, v in self.model.named_buffers()}
        self.x = np.asarray(x)
        self.y = np.asarray(y)
        self.unit, self.lr, self.clip_norm = unit, float(lr), float(clip_norm)
        self.batch_size, self.party_clip = int(batch_size), float(party_clip)
        self.loss_fn = loss_fn or cross_entropy
        self._frozen = {n: p.detach() for n, p in self.model.named_parameters() if n not in self.spec.names}
        # a linear softmax classifier has closed-form per-example gradients: (p - onehot) x^T
        self._linear = (
            loss_fn is None
            and type(self.model) is nn.Linear
            and self.spec.names in (("weight", "bias"), ("weight",))
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """One tiny step, so that torch.func's first-call set-up is not timed as a round."""
        start = (
            torch.cat(
                [p.detach().reshape(-1) for n, p in self.model.named_parameters() if n in self.spec.names]
            )
            .to(torch.float32)
            .numpy()
        )
        if self.unit == "record":
            self.train(start, LocalWork(np.zeros(1, np.int64), np.zeros((1, 1), np.int64)))
        else:
            self.train(start, LocalWork(np.zeros(1, np.int64), np.zeros((1, 1, 1), np.int64)))

    @staticmethod
    def pid() -> int:
        """This trainer's process id (a Ray actor's worker process)."""
        return os.getpid()

    @staticmethod
    def peak_rss_mb() -> float:
        """Peak resident memory of this process (MB), for the history."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # ------------------------------------------------------------------ functional model
    def _call(self, params: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, ({**params, **self._frozen}, self.buffers), (inputs,))

    def _example_loss(self, params, x, y):
        return self.loss_fn(self._call(params, x.unsqueeze(0)), y.unsqueeze(0))[0]

    def _batch_loss(self, params, x, y, weight):
        losses = self.loss_fn(self._call(params, x), y)
        return (losses * weight).sum() / weight.sum().clamp(min=1.0)

    def _tensors(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        safe = np.where(rows >= 0, rows, 0)
        return torch.from_numpy(np.ascontiguousarray(self.x[safe])), torch.from_numpy(
            np.ascontiguousarray(self.y[safe])
        )

    # ------------------------------------------------------------------ training
    def train(self, global_params: np.ndarray, work: LocalWork) -> np.ndarray:
        """Updates (c, d) float32 of ``work.clients``, each clipped to ``party_clip``."""
        start = torch.tensor(np.asarray(global_params), dtype=torch.float32)  # a copy: Ray's is read-only
        if work.rows.shape[0] == 0:
            return np.zeros((0, start.numel()), dtype=np.float32)
        with torch.no_grad():
            if self.unit == "record":
                updates = self._record_step(start, work.rows)
            else:
                updates = self._party_steps(start, work.rows)
            updates = clip_rows(updates, self.party_clip)
        return updates.numpy()

    def _record_step(self, start: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """``-lr * sum_i clip(g_i, C) / B`` over each client's sampled examples (one DP-SGD step
        without noise: IncA adds it, across clients)."""
        if self._linear:
            return self._record_step_linear(start, rows)
        params = self.spec.unflatten(start)
        per_example = vmap(grad(self._example_loss), in_dims=(None, 0, 0))
        c, width = rows.shape
        d = start.numel()
        out = torch.zeros(c, d)
        # small chunks: the per-example gradients stay in cache for the norm and the weighted sum
        per_chunk = max(1, CHUNK_BYTES // (4 * d * max(width, 1)))  # clients per chunk
        offsets = np.concatenate([[0], np.cumsum(self.spec.sizes)])
        for lo in range(0, c, per_chunk):
            block = rows[lo : lo + per_chunk]
            valid = block >= 0
            counts = valid.sum(axis=1)
            if counts.sum() == 0:
                continue
            x, y = self._tensors(block[valid])  # row-major: each client's examples are contiguous
            g = per_example(params, x, y)
            flat = [g[name].reshape(int(counts.sum()), -1) for name in self.spec.names]
            norms = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat]), dim=0
            )
            factor = (self.clip_norm / (norms + 1e-12)).clamp(max=1.0)
            bad = ~torch.isfinite(norms)
            if bad.any():  # an example whose gradient is not finite contributes nothing (still <= C)
                factor[bad] = 0.0
                flat = [torch.where(bad[:, None], torch.zeros((), dtype=f.dtype), f) for f in flat]
            # each client's clipped sum on its own rows: the same arithmetic in any cohort
            ends = np.cumsum(counts)
            for j, (end, count) in enumerate(zip(ends, counts)):
                if count:
                    rows_j = slice(int(end - count), int(end))
                    for f, a, b in zip(flat, offsets[:-1], offsets[1:]):
                        out[lo + j, a:b] = factor[rows_j] @ f[rows_j]
        return out.mul_(-self.lr / self.batch_size)

    def _record_step_linear(self, start: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """:meth:`_record_step` for ``nn.Linear`` with cross-entropy, in closed form: example i's
        gradient is ``r_i [x_i, 1]`` with ``r_i = softmax(W x_i + b) - onehot(y_i)``, of norm
        ``|r_i| sqrt(|x_i|^2 + 1)``; each client's clipped sum is one product on its own rows."""
        tensors = self.spec.unflatten(start)
        weight, bias = tensors["weight"], tensors.get("bias")
        c = rows.shape[0]
        out = torch.zeros(c, start.numel())
        valid = rows >= 0
        counts = valid.sum(axis=1)
        if counts.sum() == 0:
            return out
        x, y = self._tensors(rows[valid])
        logits = x @ weight.T + (bias if bias is not None else 0.0)
        r = torch.softmax(logits, dim=1)
        r[torch.arange(len(y)), y] -= 1.0
        sq = (x * x).sum(dim=1) + (1.0 if bias is not None else 0.0)
        norms = r.norm(dim=1) * sq.sqrt()
        r.mul_((self.clip_norm / (norms + 1e-12)).clamp(max=1.0).unsqueeze(1))
        bad = ~torch.isfinite(norms)
        if bad.any():  # as in _record_step: an example whose gradient is not finite contributes nothing
            r[bad] = 0.0
            x = torch.where(bad[:, None], torch.zeros((), dtype=x.dtype), x)
        k = weight.numel()
        ends = np.cumsum(counts)
        for j, (end, count) in enumerate(zip(ends, counts)):
            if count:
                rows_j = slice(int(end - count), int(end))
                out[j, :k] = (r[rows_j].T @ x[rows_j]).reshape(-1)
                if bias is not None:
                    out[j, k:] = r[rows_j].sum(dim=0)
        return out.mul_(-self.lr / self.batch_size)

    def _party_steps(self, start: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Minibatch SGD from the global model, all clients at once; padded steps change nothing."""
        c, steps, width = rows.shape
        d = start.numel()
        per_client = vmap(grad(self._batch_loss), in_dims=(0, 0, 0, 0))
        out = torch.empty(c, d)
        per_chunk = max(1, CHUNK_BYTES // (4 * d * 4))
        for lo in range(0, c, per_chunk):
            block = rows[lo : lo + per_chunk]
            theta = start.expand(block.shape[0], d).clone()
            for s in range(steps):
                step_rows = block[:, s]
                if not (step_rows >= 0).any():
                    continue
                x, y = self._tensors(step_rows)
                weight = torch.from_numpy((step_rows >= 0).astype(np.float32))
                with torch.enable_grad():
                    g = per_client(self.spec.unflatten(theta), x, y, weight)
                theta.sub_(self.lr * self.spec.flatten(g, lead=1))
            out[lo : lo + block.shape[0]] = theta - start
        return out


def clip_rows(updates: torch.Tensor, bound: float) -> torch.Tensor:
    """Each row scaled down to L2 norm ``bound`` if it is longer: the Flower client's rule
    (``flwr_inca.flower.client.clip``), so both routes release the same clipped updates."""
    norms = updates.norm(dim=1, keepdim=True)
    return torch.where(norms > bound, updates * (bound / norms), updates)


def evaluate(
    model: nn.Module,
    spec: ParamSpec,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    loss_fn: LossFn | None = None,
    batch: int = 10_000,
) -> tuple[float, float]:
    """(mean loss, accuracy) of the model with flat ``params`` on (x, y); accuracy is NaN for
    non-integer targets."""
    loss_fn = loss_fn or cross_entropy
    tensors = spec.unflatten(torch.from_numpy(np.asarray(params, dtype=np.float32)))
    others = {n: p.detach() for n, p in model.named_parameters() if n not in spec.names}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    total_loss, correct = 0.0, 0
    classify = np.issubdtype(np.asarray(y).dtype, np.integer)
    with torch.no_grad():
        for lo in range(0, len(y), batch):
            xb = torch.from_numpy(np.ascontiguousarray(x[lo : lo + batch]))
            yb = torch.from_numpy(np.ascontiguousarray(y[lo : lo + batch]))
            out = functional_call(model, ({**tensors, **others}, buffers), (xb,))
            total_loss += float(loss_fn(out, yb).sum())
            if classify:
                correct += int((out.argmax(dim=1) == yb).sum())
    n = max(len(y), 1)
    return total_loss / n, (correct / n if classify else math.nan)
