"""The non-editable install (the README's first command) ships every package: each folder of
``composer/`` with an ``__init__.py`` is listed in pyproject.toml's ``packages``."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "composer").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    dirs = config["package-dir"]
    for name in listed:  # and every listed one exists where package-dir says
        base = dirs.get(name) or name.replace(".", "/")
        assert (ROOT / base / "__init__.py").is_file(), name
