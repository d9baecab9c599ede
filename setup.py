"""The server distribution's dependencies: [tool.celeris] in pyproject.toml plus the client.

The client distribution lives in ./clients and is not on any package index, so the server names
it by path (a PEP 508 direct reference). pip then installs both from a clone with `pip install .`.
Everything else about the build is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
DEPS = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["celeris"]["dependencies"]

setup(install_requires=[*DEPS, f"celeris-client @ {(HERE / 'clients').as_uri()}"])
