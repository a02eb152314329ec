import numpy as np
import pytest
from reference import party_rows

from flwr_inca import InjectionSchedule
from flwr_inca.protocol import adapted_rows


@pytest.mark.parametrize("T", [1, 2, 5, 20])
@pytest.mark.parametrize("make", [InjectionSchedule.incremental, InjectionSchedule.early])
def test_builtin_schedules_are_valid(make, T):
    s = make(T)
    s.validate()
    assert s.c.shape == (T + 1,) and s.Z.shape == (T + 1, T)
    assert np.isclose(s.c.sum(), 1.0)
    assert np.allclose(s.Z.sum(axis=0), 0.0)


def test_incremental_matches_paper_example():
    s = InjectionSchedule.incremental(3)
    # v_0 = u/4 + eta_1 ; v_1 = u/4 - eta_1 + eta_2 ; v_3 = u/4 - eta_3
    assert np.allclose(s.c, 0.25)
    assert s.Z[0].tolist() == [1, 0, 0]
    assert s.Z[1].tolist() == [-1, 1, 0]
    assert s.Z[3].tolist() == [0, 0, -1]
    assert s.is_incremental_pattern
    assert not InjectionSchedule.early(3).is_incremental_pattern


def test_early_matches_paper_example():
    s = InjectionSchedule.early(3)
    assert s.c.tolist() == [1, 0, 0, 0]
    assert s.Z[0].tolist() == [1, 1, 1]
    assert s.Z[2].tolist() == [0, -1, 0]


@pytest.mark.parametrize(
    "c, Z, condition",
    [
        ([0.5, 0.4], [[1.0], [-1.0]], "condition (i): sum of c"),
        ([0.5, 0.5], [[1.0], [-0.5]], "condition (i): every column of Z"),
        # [c | Z] singular: c proportional to ... rows [0.5, 1] and [0.5, -1] are independent; make them dependent
        ([0.5, 0.5, 0.0], [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]], "condition (ii)"),
        ([1.0, 0.0, 0.0], [[1.0, 0.0], [2.0, 0.0], [-3.0, 0.0]], "condition (ii)"),
    ],
)
def test_custom_schedule_names_failed_condition(c, Z, condition):
    with pytest.raises(ValueError, match=condition.replace("(", r"\(").replace(")", r"\)")):
        InjectionSchedule.custom(c, Z)


def test_singular_z_without_last_row_is_rejected(rng):
    # With condition (i) the last row of Z is minus the sum of the others, so a null vector of
    # Z[:-1] is one of Z too: whenever (iii) fails, (ii) fails as well and is reported first.
    T = 4
    for _ in range(20):
        top = rng.standard_normal((T, T))
        top[:, -1] = top[:, :-1] @ rng.standard_normal(T - 1)  # Z[:-1] singular
        Z = np.vstack([top, -top.sum(axis=0)])
        c = np.full(T + 1, 1.0 / (T + 1))
        with pytest.raises(ValueError, match=r"Valid condition \(ii\)"):
            InjectionSchedule.custom(c, Z)


def test_custom_schedule_shape_errors():
    with pytest.raises(ValueError, match="shape"):
        InjectionSchedule.custom([0.5, 0.5], [[1.0, 0.0], [-1.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        InjectionSchedule.custom([0.5, np.nan], [[1.0], [-1.0]])
    with pytest.raises(ValueError, match="iterations"):
        InjectionSchedule.incremental(0)


def test_custom_valid_schedule_round_trips_json():
    c = np.array([0.2, 0.3, 0.5])
    Z = np.array([[1.0, 0.5], [-2.0, 1.0], [1.0, -1.5]])
    s = InjectionSchedule.custom(c, Z)
    back = InjectionSchedule.from_json(s.to_json(), 2)
    assert np.array_equal(back.c, c) and np.array_equal(back.Z, Z)
    assert InjectionSchedule.from_json("incremental", 4).name == "incremental"
    with pytest.raises(ValueError):
        InjectionSchedule.from_json({"c": [1.0]}, 2)


@pytest.mark.parametrize("make", [InjectionSchedule.incremental, InjectionSchedule.early])
def test_adapted_rows_match_reference_reading_of_spec(make, rng):
    T, n = 6, 9
    s = make(T)
    online = rng.random((T + 1, n)) > 0.35
    online[0] = True
    c_o, Z_o = adapted_rows(s, online)
    for i in range(n):
        cs, zs = party_rows(s.c, s.Z, online[:, i].tolist())
        assert np.allclose(c_o[:, i], cs)
        assert np.allclose(Z_o[:, i, :], np.array(zs))
        if online[T, i]:  # everything injected is cancelled
            assert np.allclose(Z_o[:, i, :].sum(axis=0), 0.0)


def test_incremental_dropout_injects_one_share_per_online_step(rng):
    T, n = 8, 5
    online = rng.random((T + 1, n)) > 0.4
    online[0] = True
    c_o, Z_o = adapted_rows(InjectionSchedule.incremental(T), online)
    assert np.allclose(c_o.sum(axis=0), online.sum(axis=0) / (T + 1))
    # at most one noise term outstanding after every step
    outstanding = np.cumsum(Z_o, axis=0)
    assert np.all((np.abs(outstanding) > 1e-12).sum(axis=2) <= 1)
