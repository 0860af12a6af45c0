"""The perseus-horovod distribution (compat/horovod): its wheel carries the start-up hook and horovodrun; where it
is installed, ``import horovod.torch`` gives perseus's module in every process without loading perseus at
start-up, and next to a real Horovod it does nothing but say so. (tools/check_wheel.sh installs it in a fresh
environment and runs a Horovod script under horovodrun.)"""

import glob
import os
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)  # for hangs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    os.path.join(REPO, "compat", "horovod"), "-w", str(out)], check=True, cwd=str(out))
    return glob.glob(str(out / "perseus_horovod-*.whl"))[0]


@pytest.fixture(scope="module")
def site_dir(wheel, tmp_path_factory):
    """The wheel installed into a folder of its own, to be added as a site directory (which runs .pth files)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
                   check=True)
    return str(target)


def python(code, site, extra_path=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*extra_path, REPO])}
    env.pop("PERSEUS_HOROVOD_ALIAS", None)
    env.pop("PERSEUS_HOROVOD_CONFLICT_SAID", None)
    boot = f"import site; site.addsitedir({site!r}); "
    return subprocess.run([sys.executable, "-c", boot + code], env=env, capture_output=True, text=True, cwd="/",
                          timeout=120)


def test_the_wheel_has_the_hook_and_horovodrun(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "perseus-horovod.pth" in names and "perseus_horovod/__init__.py" in names
    entry = [n for n in names if n.endswith("entry_points.txt")][0]
    assert "horovodrun = perseus_horovod:main" in zipfile.ZipFile(wheel).read(entry).decode()
    meta = [n for n in names if n.endswith("METADATA")][0]
    assert "Requires-Dist: perseus==" in zipfile.ZipFile(wheel).read(meta).decode()


def test_import_horovod_gives_perseus_loaded_only_then(site_dir):
    done = python("import sys; before = 'perseus' in sys.modules; import horovod.torch as hvd; "
                  "import perseus.torch; print(before, hvd is perseus.torch, hvd.__name__)", site_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "perseus.torch"], done.stdout + done.stderr


def test_next_to_a_real_horovod_it_says_so_and_stands_aside(site_dir, tmp_path):
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    done = python("import horovod; print(getattr(horovod, 'REAL', False))", site_dir, [str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "a real Horovod is installed" in done.stderr and "uninstall one" in done.stderr
    refused = python("import perseus_horovod, sys; sys.exit(perseus_horovod.main(['-np', '2', 'true']))",
                     site_dir, [str(tmp_path)])
    assert refused.returncode == 2 and "its own horovodrun would be shadowed" in refused.stderr
