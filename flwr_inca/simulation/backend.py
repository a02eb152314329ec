"""Where local training runs: Ray actors (each holding a cohort of clients) or this process.

Clients are split once into contiguous cohorts; each cohort's examples are copied to its trainer
(for Ray: put in the object store once, so a cluster node holds only its cohorts' data). Every round
the runner decides each participant's work (its example rows, from per-(client, round) streams) and
the trainers return the clipped updates, which are assembled in participant order. The work does not
depend on the cohorts, so the updates are the same for any number of actors.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import seeding
from .partitions import Partitions
from .training import CohortTrainer, LocalWork

__all__ = ["WorkPlanner", "InlineBackend", "RayBackend", "TrainingFailure", "create_backend"]


class TrainingFailure(RuntimeError):
    """A round's local training was lost (a trainer process died, also after ``retries`` fresh
    ones): the round releases nothing; the runner records it and training goes on."""


class WorkPlanner:
    """Each participant's example rows for a round, in cohort-local numbering.

    Record level: a Poisson sample with rate ``q`` of the client's examples (one step).
    Party level: ``local_epochs`` passes over a fresh permutation (last batch of a pass may be short)
    or ``local_steps`` minibatches of ``batch_size`` taken from successive permutations.
    """

    def __init__(
        self,
        partitions: Partitions,
        cohorts: list[np.ndarray],
        *,
        unit: str,
        sample_rate: float,
        batch_size: int,
        local_steps: int | None,
        local_epochs: int | None,
        seed: int,
    ) -> None:
        self.partitions, self.unit, self.q = partitions, unit, float(sample_rate)
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.local_steps = local_steps
        self.local_epochs = local_epochs if (local_steps is None and local_epochs is not None) else None
        if unit == "party" and local_steps is None and local_epochs is None:
            self.local_epochs = 1
        sizes = partitions.sizes()
        self.cohort_of = np.empty(partitions.clients, dtype=np.int64)
        self.offset_of = np.empty(partitions.clients, dtype=np.int64)
        for a, members in enumerate(cohorts):
            self.cohort_of[members] = a
            self.offset_of[members] = np.concatenate([[0], np.cumsum(sizes[members])[:-1]])
        self.cohorts = cohorts

    def _client_rows(self, round: int, client: int) -> list[np.ndarray]:
        n = self.partitions.indices[client].size
        rng = seeding.stream(self.seed, seeding.TRAINING, round, client)
        if self.unit == "record":
            return [np.flatnonzero(rng.random(n) < self.q)]
        B = self.batch_size
        if self.local_epochs is not None:
            batches = []
            for _ in range(self.local_epochs):
                perm = rng.permutation(n)
                batches.extend(perm[i : i + B] for i in range(0, n, B))
            return batches
        needed = self.local_steps * B
        stream = np.concatenate([rng.permutation(n) for _ in range(math.ceil(needed / n))])
        return [stream[s * B : (s + 1) * B] for s in range(self.local_steps)]

    def plan(self, round: int, participants: np.ndarray) -> list[LocalWork]:
        """One :class:`LocalWork` per cohort (clients in ascending order; empty cohorts included)."""
        rows = {int(c): self._client_rows(round, int(c)) for c in participants}
        if self.unit == "record":
            width = max(1, max(r[0].size for r in rows.values()))
        else:
            width = self.batch_size
            steps = max(len(r) for r in rows.values())
        out = []
        for a in range(len(self.cohorts)):
            members = np.sort(participants[self.cohort_of[participants] == a])
            if self.unit == "record":
                mat = np.full((members.size, width), -1, dtype=np.int64)
                for j, c in enumerate(members):
                    r = rows[int(c)][0]
                    mat[j, : r.size] = r + self.offset_of[c]
            else:
                mat = np.full((members.size, steps, width), -1, dtype=np.int64)
                for j, c in enumerate(members):
                    for s, r in enumerate(rows[int(c)]):
                        mat[j, s, : r.size] = r + self.offset_of[c]
            out.append(LocalWork(members, mat))
        return out


def _cohort_data(partitions: Partitions, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = np.concatenate([partitions.indices[c] for c in members])
    return partitions.x[rows], partitions.y[rows]


def _assemble(participants: np.ndarray, works: list[LocalWork], results: list[np.ndarray]) -> np.ndarray:
    d = next(r.shape[1] for r in results)
    out = np.empty((participants.size, d), dtype=np.float32)
    position = {int(c): i for i, c in enumerate(participants)}
    for work, res in zip(works, results):
        for j, c in enumerate(work.clients):
            out[position[int(c)]] = res[j]
    return out


class InlineBackend:
    """All clients in this process (one cohort): for debugging, tests and machines without Ray."""

    name = "inline"

    def __init__(self, model_fn: Callable, partitions: Partitions, trainer_kwargs: dict[str, Any]) -> None:
        self.cohorts = [np.arange(partitions.clients)]
        x, y = _cohort_data(partitions, self.cohorts[0])
        self.trainer = CohortTrainer(model_fn, x, y, **trainer_kwargs)
        self.actors = 0

    def submit(
        self, params: np.ndarray, participants: np.ndarray, works: list[LocalWork]
    ) -> Callable[[], np.ndarray]:
        """Training as a deferred call (run when collected: this backend has no other process)."""
        return lambda: self.train(params, participants, works)

    def train(self, params: np.ndarray, participants: np.ndarray, works: list[LocalWork]) -> np.ndarray:
        return _assemble(participants, works, [self.trainer.train(params, w) for w in works])

    def peak_memory_mb(self) -> float:
        """Peak memory of the trainers outside this process (none here)."""
        return 0.0

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "inline (this process, no Ray)"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "backend='ray' needs Ray: pip install 'flwr-inca[simulation]', or use backend='inline'"
        ) from None
    return ray


RAY_ADDRESS_VARIABLE = "RAY_ADDRESS"


def ray_address_to_join(address: str | None) -> tuple[str | None, str]:
    """The cluster to join, as ``ray.init`` finds it, and the name of where the address came from (for
    messages): a non-empty ``RAY_ADDRESS`` replaces ``address`` None or ``"auto"``; ``"local"`` means
    a new local Ray (None)."""
    name = "ray_address"
    from_environment = os.environ.get(RAY_ADDRESS_VARIABLE, "")
    if from_environment and (address is None or address == "auto"):
        address, name = from_environment, RAY_ADDRESS_VARIABLE
    return (None if address == "local" else address), name


def _check_reachable(address: str, name: str = "ray_address") -> None:
    """Fail fast, naming the parameter (or variable) ``name``, if ``host:port`` does not accept
    connections."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{name} must be 'auto' or 'host:port', got {address!r}")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            pass
    except OSError as exc:
        unset = "unset RAY_ADDRESS" if name == RAY_ADDRESS_VARIABLE else "leave ray_address=None"
        raise ConnectionError(
            f"{name}={address!r}: no Ray cluster answers there ({exc}); start one "
            f"with `ray start --head` or {unset} for a local Ray"
        ) from None


def connect_ray(address: str | None, num_cpus: int | None = None, env_vars: Mapping[str, str] | None = None):
    """Ray, initialized: reuses a running session, else starts a local one (``address`` None and no
    ``RAY_ADDRESS``) or joins the cluster at ``address`` (else at ``RAY_ADDRESS``, as ``ray.init``
    does: then Ray's resources are the cluster's and ``num_cpus`` is not used). ``env_vars``: environment
    variables every worker of this session gets (a cluster's workers were not started from this process, so
    they do not inherit its environment); not applied to a session that was already running.

    Raises ``ConnectionError`` naming the address (or ``RAY_ADDRESS``) when no cluster answers there."""
    # Ray >= 2.50 warns about a future change of its GPU-visibility default; we use no accelerator
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray = _import_ray()
    address, name = ray_address_to_join(address)
    if address is not None:
        _check_reachable(address, name)
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": "WARNING",
        "configure_logging": True,
        "log_to_driver": True,
    }
    if address is None:
        kwargs["num_cpus"] = num_cpus or os.cpu_count() or 1
    else:
        kwargs["address"] = address
    if env_vars:
        kwargs["runtime_env"] = {"env_vars": dict(env_vars)}
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError) as exc:
        where = "a local Ray" if address is None else f"{name}={address!r}"
        raise ConnectionError(f"could not start or join {where}: {exc}") from None
    return ray


class RayBackend:
    """One Ray actor per cohort; each trains its cohort's participants vectorized."""

    name = "ray"

    def __init__(
        self,
        model_fn: Callable,
        partitions: Partitions,
        trainer_kwargs: dict[str, Any],
        *,
        num_actors: int | None,
        address: str | None,
    ) -> None:
        ray = connect_ray(address, num_actors)
        self.ray = ray
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        actors = num_actors or max(1, int(cpus))
        actors = min(actors, partitions.clients)
        self.cohorts = [c for c in np.array_split(np.arange(partitions.clients), actors)]
        self._remote = ray.remote(CohortTrainer).options(num_cpus=min(1.0, cpus / actors))
        self._model_fn, self._trainer_kwargs = model_fn, trainer_kwargs
        self._data = []  # each cohort's (x, y) in the object store: a replaced actor gets them again
        for members in self.cohorts:
            x, y = _cohort_data(partitions, members)
            self._data.append((ray.put(x), ray.put(y)))
        self._actors = [self._start_actor(i) for i in range(actors)]
        self.actors = actors
        self.retries = 2  # fresh actors tried per cohort and round after one died
        self.replaced = 0  # actors replaced so far (the history's notes say so)
        self._lost = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                      ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError,
                      ray.exceptions.OutOfMemoryError)
        self.address = ray.get_runtime_context().gcs_address
        ray.get([a.__ray_ready__.remote() for a in self._actors])  # surface construction errors now

    def _start_actor(self, i: int):
        x, y = self._data[i]
        return self._remote.remote(self._model_fn, x, y, threads=1, **self._trainer_kwargs)

    def submit(
        self, params: np.ndarray, participants: np.ndarray, works: list[LocalWork]
    ) -> Callable[[], np.ndarray]:
        """Start training on the actors now; the returned call waits for and assembles the updates.

        An actor that died (killed, out of memory, its node lost) is replaced by a fresh one that
        trains the same work again (the work is seeded per client and round, so the updates are the
        same); after ``retries`` replacements the call raises :class:`TrainingFailure`."""
        ref = self.ray.put(params)
        futures = [actor.train.remote(ref, work) for actor, work in zip(self._actors, works)]
        return lambda: _assemble(participants, works, self._collect(ref, works, futures))

    def _collect(self, ref, works: list[LocalWork], futures: list) -> list[np.ndarray]:
        results: list[np.ndarray | None] = [None] * len(futures)
        for attempt in range(self.retries + 1):
            lost: list[int] = []
            for i, future in enumerate(futures):
                if results[i] is not None:
                    continue
                try:
                    results[i] = self.ray.get(future)
                except self._lost as exc:
                    lost.append(i)
                    error = exc
            if not lost:
                return results  # type: ignore[return-value]
            for i in lost:  # a fresh actor for the cohort, in this round and the next ones
                try:
                    self.ray.kill(self._actors[i])
                except Exception:  # noqa: BLE001  (it is dead already)
                    pass
                self._actors[i] = self._start_actor(i)
                self.replaced += 1
                if attempt < self.retries:
                    futures[i] = self._actors[i].train.remote(ref, works[i])
        raise TrainingFailure(
            f"local training of cohort(s) {lost} was lost {self.retries + 1} times "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )

    def train(self, params: np.ndarray, participants: np.ndarray, works: list[LocalWork]) -> np.ndarray:
        return self.submit(params, participants, works)()

    def peak_memory_mb(self) -> float:
        """Sum over the actors of their peak resident memory (MB)."""
        return float(sum(self.ray.get([a.peak_rss_mb.remote() for a in self._actors])))

    def close(self) -> None:
        for actor in self._actors:
            self.ray.kill(actor)
        self._actors = []

    def describe(self) -> str:
        return f"ray ({self.actors} actor(s), cluster {self.address})"


def create_backend(
    kind: str,
    model_fn: Callable,
    partitions: Partitions,
    trainer_kwargs: dict[str, Any],
    *,
    num_actors: int | None = None,
    address: str | None = None,
):
    if kind == "inline":
        return InlineBackend(model_fn, partitions, trainer_kwargs)
    return RayBackend(model_fn, partitions, trainer_kwargs, num_actors=num_actors, address=address)
