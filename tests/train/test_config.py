"""A bad config is refused by `python -m torchbridge train` with a message naming the key, before the data
is prepared or any rank starts; the shipped configs are valid and the default one is the bundled model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchbridge.train import cli, config
from torchbridge.train import data as data_lib

BUNDLED = Path(__file__).resolve().parents[2] / "src" / "torchbridge" / "assets" / "default-model"


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the command gets as far as preparing data or launching ranks."""
    def refuse(*args, **kwargs):
        raise AssertionError("a bad config reached data preparation or the launcher")

    monkeypatch.setattr(data_lib, "prepare", refuse)
    monkeypatch.setattr(cli, "launch", refuse)


def _refused(tmp_path, capsys, argv: list[str], toml: str | None = None) -> str:
    if toml is not None:
        (tmp_path / "job.toml").write_text(toml)
        argv = ["--config", str(tmp_path / "job.toml"), *argv]
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    return err


@pytest.mark.parametrize("toml, key", [
    ("[training]\nstpes = 3\n", "training.stpes"),
    ("[trainer]\nsteps = 3\n", "trainer"),
    ("[training]\nsteps = \"ten\"\n", "training.steps"),
    ("[parallel]\ntp = 1.5\n", "parallel.tp"),
    ("[data]\ncorpus = \"/nonexistent/corpus\"\n", "data.corpus"),
    ("[training]\nbatch_size = 6\n", "training.batch_size"),  # tiny's 8 -> 6 does not split over 4 ranks
    ("[model]\nnum_kv_heads = 3\n", "model.num_kv_heads"),
])
def test_bad_config_file_names_the_key(tmp_path, capsys, nothing_starts, toml, key):
    err = _refused(tmp_path, capsys, ["--nproc", "4"], toml)
    assert f"bad config: {key}" in err, err


@pytest.mark.parametrize("argv, key", [
    (["--nproc", "3", "--set", "parallel.tp=2"], "parallel.tp"),  # 2 does not divide 3 ranks
    (["--nproc", "4", "--set", "parallel.dp_shard=3"], "parallel.dp_shard"),  # 3 x 1 is not 4
    (["--nproc", "4", "--set", "parallel.tp=4"], "parallel.tp"),  # tiny has 2 KV heads
    (["--device", "gpu"], "job.device"),
    (["--set", "training.nope=1"], "training.nope"),
    (["--set", "data.corpus=/nonexistent/corpus"], "data.corpus"),
])
def test_bad_command_line_names_the_key(tmp_path, capsys, nothing_starts, argv, key):
    err = _refused(tmp_path, capsys, ["--config", "tiny", *argv])
    assert f"bad config: {key}" in err, err


def test_corpus_without_python_files_is_refused(tmp_path, capsys, nothing_starts):
    (tmp_path / "empty").mkdir()
    err = _refused(tmp_path, capsys, ["--config", "tiny", "--set", f"data.corpus={tmp_path / 'empty'}"])
    assert "bad config: data.corpus" in err and "no .py files" in err, err


def test_shipped_configs_are_valid_and_default_is_the_bundled_model():
    for name in ("default", "tiny"):
        config.validate(config.load(name))
    m = config.load("default").model
    bundled = json.loads((BUNDLED / "config.json").read_text())
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads,
            m.max_position_embeddings, m.tie_word_embeddings) == (
        bundled["hidden_size"], bundled["intermediate_size"], bundled["num_hidden_layers"],
        bundled["num_attention_heads"], bundled["num_key_value_heads"], bundled["max_position_embeddings"],
        bundled["tie_word_embeddings"])
    assert config.load("default").data.vocab_size == bundled["vocab_size"]


def test_dp_shard_defaults_to_the_ranks_tensor_parallelism_leaves():
    cfg = config.load("tiny")
    config.apply_overrides(cfg, {"job.nproc": 4, "parallel.tp": 2})
    assert config.validate(cfg).parallel.dp_shard == 2
