"""What an install gets: the recipes inside the wheel, and an Accelerate inside the tested bounds."""

import re
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

from tests.helpers import ROOT


def _accelerate_bounds() -> tuple:
    spec = re.search(r'"accelerate>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert spec, "pyproject.toml pins accelerate from below and above"
    return tuple(tuple(int(x) for x in v.split(".")) for v in spec.groups())


def test_installed_accelerate_is_inside_the_tested_bounds():
    low, high = _accelerate_bounds()
    installed = tuple(int(x) for x in re.findall(r"\d+", version("accelerate"))[:3])
    assert low <= installed < high, (installed, low, high)


def test_wheel_ships_every_recipe_and_metric(tmp_path):
    """A non-editable install (pip install ., a wheel) finds the same recipes as the checkout."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path), str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    # setuptools warns (~40 lines each) about a folder Python can import that `packages` does not list
    assert "would be ignored" not in build.stdout + build.stderr, (build.stdout + build.stderr)[:2000]
    wheel = next(tmp_path.glob("finetune-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert recipes and all(f"finetune/recipes/{r}" in names for r in recipes), recipes
    assert all(f"finetune/metrics/{m.name}/{m.name}.py" in names for m in (ROOT / "finetune" / "metrics").iterdir()
               if m.is_dir() and not m.name.startswith("_"))
    assert not any(n.startswith("tests/") or n.startswith("benchmarks/") for n in names)
    # installed from the wheel, away from the checkout, it lists the same recipes
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    listed = subprocess.run([sys.executable, "-c", "from finetune import registry; print(registry.__file__); "
                             "print(' '.join(n for n, _ in registry.list_recipes()))"], cwd=tmp_path,
                            capture_output=True, text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                            check=True)
    where, names = listed.stdout.splitlines()
    assert Path(where).is_relative_to(site)
    assert names.split() == [Path(r).stem for r in recipes]
