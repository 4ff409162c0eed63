"""Builds the CPU kernels into a wheel (metadata lives in pyproject.toml).

With torch importable at build time (`pip install --no-build-isolation .`, or the Docker build,
which compiles on the host), each ISA level's library goes into the wheel beside the package.
Without torch (pip's isolated build) or without a compiler, the wheel has no kernels: the log
says so at run time and `pacer build-kernels` builds them. An editable install (`make setup`)
builds them in the source tree instead (`python -m gpu_worker.kernel_build`).
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from gpu_worker import kernel_build
            out = os.path.join(self.build_lib, "gpu_worker", "_kernels", kernel_build.torch_key())
            if os.path.exists(kernel_build.library_path(out, kernel_build.LEVEL_NAMES[0])):
                return            # prebuilt in the source tree (the Docker build): shipped as is
            kernel_build.build(out_dir=out)
        except Exception as e:    # no torch here, or no compiler: the wheel works without kernels
            print(f"pacer: CPU kernels not built ({e}); run `pacer build-kernels` after install")


setup(cmdclass={"build_py": BuildPyWithKernels})
