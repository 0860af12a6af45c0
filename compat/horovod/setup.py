"""The perseus-horovod distribution (see perseus_horovod/__init__.py): built from this folder of the perseus
repository, e.g. ``pip install ./compat/horovod`` or ``pip wheel --no-deps ./compat/horovod``."""

import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "..", "..", "perseus", "_version.py")) as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


class BuildWithPth(build_py):
    """Also put perseus-horovod.pth at the top of the wheel (site-packages), where Python runs it at start-up."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, "perseus-horovod.pth"), os.path.join(self.build_lib, "perseus-horovod.pth"))


setup(
    name="perseus-horovod",
    version=VERSION,
    description="Horovod's import names (import horovod.torch ...) and horovodrun, for perseus",
    packages=["perseus_horovod"],
    python_requires=">=3.10",
    install_requires=[f"perseus=={VERSION}"],
    entry_points={"console_scripts": ["horovodrun = perseus_horovod:main"]},
    cmdclass={"build_py": BuildWithPth},
    license="Apache-2.0",
    zip_safe=False,
)
