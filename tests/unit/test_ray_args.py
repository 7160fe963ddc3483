"""The Ray Serve command line's numbers (serve/ray_main.py): what Ray would take, or one error."""

from __future__ import annotations

import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.serve.ray_main import parse_delays


def test_autoscale_delays_are_finite_seconds():
    assert parse_delays("1,3") == (1.0, 3.0) and parse_delays("0,0") == (0.0, 0.0)
    for text in ("nan,nan", "inf,1", "1e400,0", "-1,2", "1", "a,b"):  # NaN and infinity passed a `< 0` check
        with pytest.raises(SpecDeployError, match="--autoscale-delays"):
            parse_delays(text)
