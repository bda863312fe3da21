"""The screenshots the README shows must match what the console renders today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual")

REPO = Path(__file__).resolve().parents[1]


def _shots():
    spec = importlib.util.spec_from_file_location("make_screenshots", REPO / "scripts" / "make_screenshots.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_screenshots"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_committed_screenshots_are_current(capsys):
    shots = _shots()
    rc = shots.main(["--check"])
    assert rc == 0, capsys.readouterr().err


def test_readme_shows_every_screenshot():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for scene in _shots().SCENES:
        assert f"screenshots/{scene.name}.svg" in readme, scene.name
