"""Builds posenc's Python package: CMake compiles the PyTorch extension (libposenc_torch.so, with
the core linked in statically) against the torch of the interpreter that runs pip, and the wheel
carries it next to the package's Python files. The extension's ABI is tied to that torch, so the
wheel requires its major.minor version. Configured by pyproject.toml; run by
`pip wheel --no-build-isolation .` or `pip install --no-build-isolation .` in an environment with torch."""
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
# CMake reads the real source tree (a symlinked checkout builds with the paths of its target, as a
# compiler cache shared with another build of the same tree needs).
SOURCE = os.path.dirname(os.path.realpath(__file__))
os.makedirs(os.path.join(ROOT, "build-pip"), exist_ok=True)  # egg_base below


def cmake_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(posenc VERSION ([0-9.]+)", f.read())
    if match is None:
        raise RuntimeError("posenc: no `project(posenc VERSION …)` in CMakeLists.txt")
    return match.group(1)


def torch_requirement():
    """torch==X.Y.* for the torch this interpreter imports (pip's isolated build environment has none)."""
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(f"posenc: {sys.executable} cannot import torch ({e}); posenc builds against the torch "
                           "of the environment it installs into: run pip with --no-build-isolation there") from e
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


class BuildWithCMake(build_py):
    """The package's Python files as usual, then the extension and its build record from CMake."""

    def run(self):
        super().run()
        build = os.path.join(os.path.abspath(self.get_finalized_command("build").build_temp), "cmake")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        # The installed RPATH from the start: the wheel must not point into this build's environment.
        subprocess.check_call(["cmake", "-S", SOURCE, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                               "-DBUILD_SHARED_LIBS=OFF", "-DPOSENC_BUILD_TORCH=ON", f"-DPOSENC_PYTHON={sys.executable}",
                               "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DPOSENC_BUILD_STUDY=OFF",
                               "-DPOSENC_BUILD_CLI=OFF", "-DPOSENC_BUILD_TESTS=OFF", "-DPOSENC_BUILD_BENCH=OFF"])
        subprocess.check_call(["cmake", "--build", build, "--target", "posenc_python", "--parallel",
                               str(os.cpu_count() or 1)])
        target = os.path.join(self.build_lib, "posenc")
        os.makedirs(target, exist_ok=True)
        for name in ("libposenc_torch.so", "_build.py"):
            self.copy_file(os.path.join(build, "python", "posenc", name), target)


class BinaryDistribution(Distribution):
    """A wheel for this platform and interpreter: it carries a compiled library."""

    def has_ext_modules(self):
        return True


setup(version=cmake_version(), install_requires=[torch_requirement()], cmdclass={"build_py": BuildWithCMake},
      distclass=BinaryDistribution,
      options={"build": {"build_base": "build-pip"}, "egg_info": {"egg_base": "build-pip"}})
