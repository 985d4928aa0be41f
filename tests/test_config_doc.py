"""docs/CONFIG.md is generated from the schema's `#:` comments and kept in sync (dspark.config.reference)."""

from __future__ import annotations

import inspect

from dspark.config import schema
from dspark.config.loader import valid_keys
from dspark.config.reference import STALE_MESSAGE, config_reference, main, stale_message
from dspark.config.resolve import repo_root

CONFIG_DOC = repo_root() / "docs" / "CONFIG.md"


def test_config_doc_matches_the_schema():
    assert CONFIG_DOC.read_text(encoding="utf-8") == config_reference(), STALE_MESSAGE


def test_every_schema_key_has_a_row():
    text = config_reference()
    missing = [key for key in valid_keys() if f"| `{key}` |" not in text]
    assert not missing, missing


def test_a_changed_comment_makes_the_check_fail(tmp_path):
    """The control: edit one field comment in the schema's source and the committed doc no longer matches."""
    source = inspect.getsource(schema)
    old = "#: draft decoder layers (paper 5)"
    assert source.count(old) == 1
    changed = config_reference(source.replace(old, "#: draft decoder layers (paper 5; a changed comment)"))
    assert "a changed comment" in changed and changed != config_reference()
    committed = tmp_path / "CONFIG.md"
    committed.write_text(config_reference(), encoding="utf-8")
    assert stale_message(committed, config_reference()) is None
    assert stale_message(committed, changed) == STALE_MESSAGE


def test_check_exits_1_on_a_stale_file_and_write_fixes_it(tmp_path, capsys):
    doc = tmp_path / "CONFIG.md"
    doc.write_text("# an old reference\n", encoding="utf-8")
    assert main(["--check"], path=doc) == 1
    assert STALE_MESSAGE in capsys.readouterr().err
    assert main([], path=doc) == 0
    assert main(["--check"], path=doc) == 0


def test_comments_above_and_after_a_field_are_both_read():
    text = config_reference()
    # model.draft_vocab_size: a `#:` line above the field; model.depth: a `#:` comment after it; a `|` is escaped
    assert "| `model.draft_vocab_size` | `int` | `0` | Vd, predict over" in text
    assert "| `model.depth` | `int` | `5` | draft decoder layers (paper 5) |" in text
    assert "markov \\| gated \\| rnn \\| gru \\| selector_conv \\| none" in text
