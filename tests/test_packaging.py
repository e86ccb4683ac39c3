"""The installed package stands on its own: no pytest at run time, every imported distribution declared with
bounds, the YAML configs shipped and found from any directory, ``dsv41 --version``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

from dsv41_jax.cli import main
from dsv41_jax.config.files import CONFIGS, config_path, packaged_configs

REPO = Path(__file__).resolve().parents[1]
# imported only when installed, to pick a metrics writer (train.report): never required
DETECTED = {"torch", "tensorflow", "tensorboardX"}

_NO_PYTEST = """
import importlib, json, pkgutil, sys

class NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name == "pytest" or name.startswith(("pytest.", "_pytest")):
            raise ImportError("pytest is not installed here")

sys.meta_path.insert(0, NoPytest())
import dsv41_jax
names = [m.name for m in pkgutil.walk_packages(dsv41_jax.__path__, "dsv41_jax.")]
for name in names:
    importlib.import_module(name)
from dsv41_jax.cli import main
code = main(["make-fake-hf", "--config", "tiny", "--out", sys.argv[1]])
print(json.dumps({"modules": len(names), "code": code}))
"""


def test_the_library_runs_without_pytest(tmp_path):
    # every module imports, and make-fake-hf (which once imported pytest through dsv41_jax.testing) runs
    out = subprocess.run([sys.executable, "-c", _NO_PYTEST, str(tmp_path / "hf")], capture_output=True, text=True,
                         cwd=tmp_path, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and report["modules"] > 50
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


def _imported_modules() -> set[str]:
    names = set()
    for path in [*REPO.glob("dsv41_jax/**/*.py"), *REPO.glob("pallas_kernels/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"dsv41_jax", "pallas_kernels", "__future__"}


def _requirement_name(req: str) -> str:
    for stop in "<>=[;! ":
        req = req.split(stop)[0]
    return req.lower().replace("_", "-")


def test_every_imported_distribution_is_declared_with_bounds():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(r): r for r in project["dependencies"]}
    optional = {_requirement_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    dists = packages_distributions()
    undeclared = []
    for module in sorted(_imported_modules() - DETECTED):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & (set(required) | optional):
            undeclared.append(f"{module} ({', '.join(sorted(names))})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert "etils" in required and "pytest" not in required
    for name in ("jax", "flax", "orbax-checkpoint"):  # what the code relies on the internals of has a ceiling
        assert "<" in required[name], required[name]


def test_configs_ship_with_the_package_and_are_found_from_anywhere(tmp_path, monkeypatch):
    assert packaged_configs() == sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    setup = (REPO / "setup.py").read_text()
    assert '"dsv41_jax.configs": "configs"' in setup and '"dsv41_jax.configs": ["*.yaml"]' in setup
    monkeypatch.chdir(tmp_path)  # outside the checkout: the README's paths still work
    for spec in ("pretrain_tiny", "configs/pretrain_tiny.yaml", "pretrain_tiny.yaml"):
        assert config_path(spec) == CONFIGS / "pretrain_tiny.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "pretrain_tiny.yaml").write_text("steps: 1\n")
    assert config_path("configs/pretrain_tiny.yaml") == Path("configs/pretrain_tiny.yaml")  # the user's own first


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out.strip() == f"dsv41-jax {version('dsv41-jax')}"
