"""The docs stay in step with the code."""

from pathlib import Path

from vrl.config import field_table

ROOT = Path(__file__).resolve().parents[1]


def test_config_field_table_is_current():
    text = (ROOT / "docs" / "config.md").read_text()
    start, end = "<!-- fields:start -->\n", "<!-- fields:end -->"
    table = text[text.index(start) + len(start) : text.index(end)]
    assert table == field_table(), "refresh it with: python -m vrl.config"
