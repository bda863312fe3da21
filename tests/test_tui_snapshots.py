"""SVG snapshot tests of every screen (pytest-textual-snapshot), from the seeded sample data at
fixed sizes. Accept intended changes with `pytest tests/test_tui_snapshots.py --snapshot-update`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_textual_snapshot")

_spec = importlib.util.spec_from_file_location(
    "make_screenshots", Path(__file__).resolve().parents[1] / "scripts" / "make_screenshots.py"
)
shots = importlib.util.module_from_spec(_spec)
sys.modules["make_screenshots"] = shots  # dataclasses look their module up
_spec.loader.exec_module(shots)


@pytest.mark.parametrize("scene", shots.SCENES, ids=[s.name for s in shots.SCENES])
def test_screen_snapshot(snap_compare, scene):
    assert snap_compare(shots.build_app(scene), press=list(scene.press), terminal_size=scene.size)
