"""A model or head directory's config (export/dir_config.py): each way it can be missing or broken
is one clear error naming the directory or file."""

from __future__ import annotations

import pytest

from specdeploy.export.dir_config import read_dir_config
from specdeploy.runtime.errors import SpecDeployError


def _error(model_dir) -> str:
    with pytest.raises(SpecDeployError) as info:
        read_dir_config(model_dir, "config.json", "EAGLE head", ": not an EAGLE head directory")
    return str(info.value)


def test_each_fault_is_one_clear_error(tmp_path):
    assert _error(tmp_path / "nowhere") == f"EAGLE head directory not found: {tmp_path / 'nowhere'}"
    assert _error(tmp_path) == f"{tmp_path} has no config.json: not an EAGLE head directory"
    (tmp_path / "config.json").write_text("{")
    assert _error(tmp_path).startswith(f"{tmp_path / 'config.json'} is not valid JSON")
    (tmp_path / "config.json").write_text("[1]")
    assert _error(tmp_path) == f"{tmp_path / 'config.json'} must be a JSON object"


def test_a_config_reads_as_its_dict(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert read_dir_config(tmp_path, "config.json", "model", "") == {"hidden_size": 64}
