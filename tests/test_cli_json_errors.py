"""With --json, an error is also one JSON object on stdout: {"error": {type, message, exit_code}}."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app

runner = CliRunner()


def _error(result) -> dict:
    payload = json.loads(result.stdout)  # the whole of stdout is that one object
    assert set(payload) == {"error"} and set(payload["error"]) == {"type", "message", "exit_code"}
    assert payload["error"]["exit_code"] == result.exit_code
    return payload["error"]


@pytest.mark.parametrize("args,error_type,code,words", [
    (["eval", "no/such/model/dir", "--json"], "InputError", 2, "no/such/model/dir"),
    (["fetch", "nowhere.gguf", "--json"], "InputError", 2, "nowhere.gguf"),
    (["eval", "m", "--max-tokens", "1", "--json"], "BadParameter", 2, "--max-tokens"),  # rejected while parsing
])
def test_json_error_object_on_stdout(args, error_type, code, words):
    result = runner.invoke(app, args)
    assert result.exit_code == code
    error = _error(result)
    assert error["type"] == error_type and words in error["message"]
    assert "Traceback" not in result.output


def test_json_error_from_a_flag_conflict(tiny_llama_dir, tmp_path):
    result = runner.invoke(app, ["merge", "--method", "ties", "--isotropic", str(tiny_llama_dir), str(tiny_llama_dir),
                                 "-o", str(tmp_path / "o"), "--json"])
    assert result.exit_code != 0
    assert "conflicts" in _error(result)["message"]
    assert result.stderr.startswith("error:")  # the one human line still goes to stderr


def test_without_json_stdout_stays_empty_on_error():
    result = runner.invoke(app, ["eval", "no/such/model/dir"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error:") and "no/such/model/dir" in result.stderr
