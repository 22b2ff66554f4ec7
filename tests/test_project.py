"""The project's own settings modules load and pass Django's system checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", ["settings.embedded", "settings.production"])
def test_settings_module_passes_the_system_checks(module: str, tmp_path: Path) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": module, "DURABLE_FLOW_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout
