"""Builds posenc's Python package: CMake compiles the PyTorch extension (libposenc_torch.so,
with the core linked in statically) against Debian's libtorch, and the wheel carries it next to
the package's Python files. Configured by pyproject.toml; run by `pip install .`."""
import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(ROOT, "build-pip"), exist_ok=True)  # egg_base below


def cmake_version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(posenc VERSION ([0-9.]+)", f.read())
    if match is None:
        raise RuntimeError("posenc: no `project(posenc VERSION …)` in CMakeLists.txt")
    return match.group(1)


class BuildWithCMake(build_py):
    """The package's Python files as usual, then the extension from CMake beside them."""

    def run(self):
        super().run()
        build = os.path.join(os.path.abspath(self.get_finalized_command("build").build_temp), "cmake")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                               "-DBUILD_SHARED_LIBS=OFF", "-DPOSENC_BUILD_TORCH=ON", "-DPOSENC_BUILD_STUDY=OFF",
                               "-DPOSENC_BUILD_CLI=OFF", "-DPOSENC_BUILD_TESTS=OFF", "-DPOSENC_BUILD_BENCH=OFF"])
        subprocess.check_call(["cmake", "--build", build, "--target", "posenc_torch", "--parallel",
                               str(os.cpu_count() or 1)])
        target = os.path.join(self.build_lib, "posenc")
        os.makedirs(target, exist_ok=True)
        self.copy_file(os.path.join(build, "python", "posenc", "libposenc_torch.so"), target)


class BinaryDistribution(Distribution):
    """A wheel for this platform and interpreter: it carries a compiled library."""

    def has_ext_modules(self):
        return True


setup(version=cmake_version(), cmdclass={"build_py": BuildWithCMake}, distclass=BinaryDistribution,
      options={"build": {"build_base": "build-pip"}, "egg_info": {"egg_base": "build-pip"}})
