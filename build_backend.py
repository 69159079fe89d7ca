"""The build backend: setuptools', plus refusion-mlx's start-up file in every wheel.

``pyproject.toml`` names this module (``backend-path = ["."]``). It hands
every hook to ``setuptools.build_meta`` and adds one file to the wheels it
builds, the regular one (``pip install .``) and the editable one (``pip
install -e .``, PEP 660): ``refusion_mlx_blas.pth`` at the wheel's root, which
the installer puts in site-packages and Python reads at start-up
(``_refusion_mlx_blas.py`` says what it does). setuptools has no setting that
puts a file at the root of an editable wheel, hence this wrapper; it uses
only the PEP 517 hooks and the wheel format (a file plus its ``RECORD``
line).
"""

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook, unchanged)

from _refusion_mlx_blas import PTH_LINE, PTH_NAME


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_file(os.path.join(wheel_directory, name), PTH_NAME, PTH_LINE.encode())
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_file(os.path.join(wheel_directory, name), PTH_NAME, PTH_LINE.encode())
    return name


def add_file(wheel: str, name: str, data: bytes) -> None:
    """Add ``name`` at the root of a wheel and list it in its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rewritten = wheel + ".part"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            content = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # the wheel's last entry, by convention
                dst.writestr(name, data)
                content = content.rstrip(b"\n") + f"\n{name},sha256={digest},{len(data)}\n".encode()
            dst.writestr(info, content)
    os.replace(rewritten, wheel)
