"""The project's own contracts: ruff clean, import-linter layers, and a torch-free start-up path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean():
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold():
    result = _run(str(BIN / "lint-imports"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and ", 0 broken" in result.stdout


def test_cli_and_model_cache_do_not_import_torch():
    # Parsing an engine command and validating and sizing its EngineConfig (what the CLI and the
    # Engine pane do before loading) stay torch-free too.
    code = ("import sys, app.cli, engine, engine.models, engine.config\n"
            "from engine.engine_config import EngineConfig\n"
            "args = app.cli._parser().parse_args(['serve', '--weights', 'int4', '--spec', "
            "'ngram', '--kv-policy', 'h2o', '--kv-budget', '0.2'])\n"
            "EngineConfig.from_cli(args).peak_kv_tokens(1024)\n"
            "print('torch' in sys.modules)")
    result = _run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_no_module_reaches_itself_through_its_imports():
    import grimp

    graph = grimp.build_graph("app", "engine", "kernels", "planner", "monitor", "storage")
    cycles = sorted({tuple(sorted((m, b))) for m in graph.modules
                     for b in graph.find_modules_directly_imported_by(m)
                     if graph.chain_exists(importer=b, imported=m)})
    assert cycles == []
