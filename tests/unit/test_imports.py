"""The rooms' dependency rule (ARCHITECTURE.md): `core/` and `config/` are pure Python. Importing
them, every module of both, must not load torch (checked in a fresh interpreter)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import llmserve.config
import llmserve.core


def _modules(package) -> list[str]:
    return [package.__name__] + [
        m.name for m in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + ".")
    ]


def test_core_and_config_do_not_import_torch():
    modules = _modules(llmserve.core) + _modules(llmserve.config)
    assert "llmserve.core.scheduler" in modules and "llmserve.config.cache" in modules
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "heavy = sorted(m for m in ('torch', 'numpy', 'numba') if m in sys.modules)\nprint(heavy)\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "torch" not in out.stdout, f"importing core/config loaded: {out.stdout.strip()}"
