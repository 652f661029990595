"""The install layout: every subpackage ships, and kernels/ installs only as gradcomp.kernels."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed_for_install():
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gradcomp").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    on_disk.add("gradcomp.kernels")
    assert on_disk == set(_config()["packages"])


def test_kernels_folder_maps_under_the_gradcomp_namespace():
    config = _config()
    assert config["package-dir"] == {"gradcomp.kernels": "kernels"}
    assert "kernels" not in config["packages"]
    import gradcomp.kernels

    assert Path(gradcomp.kernels.__file__).resolve().parent == ROOT / "kernels"
