"""Stock coding agents against the server, with only their provider settings:
the Codex CLI (``codex exec``, the Responses API) and Claude Code (``claude
-p``, the Messages API), pinned npm packages (``AGENT_CLIS``).

Each runs one turn on a copy of the demo model whose context holds their
prompts (~13k and ~9k tokens): the turn must end with exit status 0, every
request it made answered 200 (none refused). Where node or the packages are
missing the tests skip with one line; under ``CI=true`` they must run
(``.ci/run`` installs the packages into ``.ci/agents``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from refusion_mlx.models.loading import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[1]
AGENT_CLIS = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.332"}
INSTALLED = Path(os.environ.get("REFUSION_AGENT_CLIS", ROOT / ".ci" / "agents")) / "node_modules" / ".bin"
CONTEXT = 32768
# a turn's limit: the GPU paths run a Mac's kernels on this CPU (MLX's fused attention, unfused here), and
# prefill an agent's 11k-token prompt in ~130 s where the CPU paths take ~12 s
TIMEOUT = 600 if os.environ.get("REFUSION_MLX_PATHS") == "gpu" else 240


def cli(name: str) -> str:
    """The agent's command, or a skip (a failure under CI=true) saying how to install it."""
    found = INSTALLED / name if (INSTALLED / name).exists() else shutil.which(name)
    if found is None or shutil.which("node") is None:
        why = (f"{name} not installed: npm install --prefix .ci/agents {' '.join(AGENT_CLIS.values())} "
               "(needs node)")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return str(found)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo model with a context of 32k positions (the agents' prompts are long), on a free port."""
    from refusion_mlx.serve.http_server import RefusionServer

    folder = tmp_path_factory.mktemp("long-demo") / "model"
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    srv = RefusionServer(str(folder), model_id="tiny-refusion", port=0).start()
    yield srv
    srv.close()


def run(command, env, home: Path) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "ANTHROPIC", "CODEX", "CLAUDE"))}
    return subprocess.run(command, env={**clean, "HOME": str(home), **env}, cwd=home, capture_output=True,
                          text=True, timeout=TIMEOUT)


def served(caplog) -> list:
    """The server's log lines of the turn: its answers and its refusals."""
    return [r.getMessage() for r in caplog.records if r.name == "refusion_mlx.server"]


def test_codex_exec_runs_a_turn_with_its_defaults(server, tmp_path, caplog):
    codex = cli("codex")
    home = tmp_path / "codex"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "tiny-refusion"\nmodel_provider = "local"\n\n[model_providers.local]\nname = "local"\n'
        f'base_url = "{server.url}"\nwire_api = "responses"\nenv_key = "LOCAL_API_KEY"\n')
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        done = run([codex, "exec", "--skip-git-repo-check", "Say hi."],
                   {"CODEX_HOME": str(home / ".codex"), "LOCAL_API_KEY": "local"}, home)
    lines = served(caplog)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(line.startswith("stream ") and "prompt=" in line for line in lines), lines  # its turn, answered
    assert not [line for line in lines if line[:1] == "4"], lines  # nothing refused: namespace and web_search tools


def test_claude_code_runs_a_turn_with_its_defaults(server, tmp_path, caplog):
    claude = cli("claude")
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        done = run([claude, "-p", "Say hi."], {"ANTHROPIC_BASE_URL": server.url.removesuffix("/v1"),
                                               "ANTHROPIC_API_KEY": "local"}, tmp_path / "claude")
    lines = served(caplog)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(line.startswith("stream ") for line in lines), lines
    assert not [line for line in lines if line[:1] == "4"], lines  # thinking, a system message, beta headers
    assert any("max_tokens" in line and "cut to" in line for line in lines), lines  # its 32,000 default, cut
