"""The package's shared argument checks and its JSON with infinities."""

import json
import math

import numpy as np
import pytest

from flwr_inca._checks import check_int, check_probability, check_real
from flwr_inca._json import InfinityEncoder, dumps, float_from_json, jsonable


@pytest.mark.parametrize("value, minimum, maximum, ok", [
    (1, 1, None, True), (np.int64(3), 1, None, True), (0, 0, None, True), (5, 1, 5, True),
    (0, 1, None, False), (True, 1, None, False), (1.0, 1, None, False), ("2", 1, None, False),
    (6, 1, 5, False), (-1, None, 0, True), (None, 1, None, False),
])
def test_check_int(value, minimum, maximum, ok):
    if ok:
        checked = check_int("k", value, minimum, maximum)
        assert checked == value and type(checked) is int
    else:
        with pytest.raises(ValueError, match=r"^k must be an integer"):
            check_int("k", value, minimum, maximum)


def test_check_messages_name_the_argument_and_the_range():
    with pytest.raises(ValueError, match=r"^iterations must be an integer >= 1, got 0$"):
        check_int("iterations", 0)
    with pytest.raises(ValueError, match=r"^rows must be an integer in \[2, 9\], got 10$"):
        check_int("rows", 10, 2, 9)
    with pytest.raises(ValueError, match=r"^delta must be in \(0, 1\), got 1$"):
        check_real("delta", 1, 0, 1, low_open=True, high_open=True)
    with pytest.raises(ValueError, match=r"^epsilon must be a finite number > 0, got inf$"):
        check_real("epsilon", math.inf, 0, low_open=True)
    with pytest.raises(ValueError, match=r"^mu must be >= 0, got -0.5$"):
        check_real("mu", -0.5, 0, finite=False)
    with pytest.raises(ValueError, match=r"^rate must be in \[0, 1\), got 1.0$"):
        check_probability("rate", 1.0, one=False)


@pytest.mark.parametrize("value", [math.nan, True, "0.5", None, [0.5]])
def test_check_real_refuses_what_is_not_a_real_number(value):
    with pytest.raises(ValueError, match="x must be"):
        check_real("x", value, 0.0, 1.0)


def test_check_real_bounds():
    assert check_real("x", 0, 0, 1) == 0.0 and check_real("x", np.float32(0.5), 0, 1) == 0.5
    assert check_real("x", math.inf, 0, finite=False) == math.inf
    for value, kw in [(0.0, {"low_open": True}), (1.0, {"high_open": True}), (-1e-300, {})]:
        with pytest.raises(ValueError):
            check_real("x", value, 0.0, 1.0, **kw)


def test_json_writes_infinities_as_strings_and_reads_them_back():
    data = {"mu": {"3": math.inf, "4": 0.5}, "neg": -math.inf, "nan": math.nan,
            "arr": np.array([1.0, np.inf]), "n": np.int64(7), "f": np.float32(0.25), "t": (1, 2),
            "ok": np.bool_(True)}
    text = dumps(data)
    assert "Infinity" not in text and "NaN" not in text
    back = json.loads(text)
    assert back == {"mu": {"3": "inf", "4": 0.5}, "neg": "-inf", "nan": "nan", "arr": [1.0, "inf"], "n": 7,
                    "f": 0.25, "t": [1, 2], "ok": True}
    assert json.dumps(data["mu"], cls=InfinityEncoder) == '{"3": "inf", "4": 0.5}'
    assert json.dumps([math.inf], cls=InfinityEncoder, indent=1) == '[\n "inf"\n]'
    assert float_from_json("inf", "mu") == math.inf and float_from_json("-inf", "mu") == -math.inf
    assert float_from_json(2, "mu") == 2.0 and math.isnan(float_from_json("nan", "mu"))
    for bad in ["Infinity", True, None, [1]]:
        with pytest.raises(ValueError, match="mu must be a number or 'inf'"):
            float_from_json(bad, "mu")
    assert jsonable({"a": [1, (2.5, math.inf)]}) == {"a": [1, [2.5, "inf"]]}
