"""The Python package as users get it: built and pip-installed into a fresh virtualenv (offline,
no numpy), imported from outside the repository, finding libdsv4 through DSV4_LIBRARY, an
installed prefix or pkg-config; imported from a source checkout without installing; typed
(`mypy --strict` on the package, and on a client of the installed package through py.typed);
and the error when no library is found, naming every place looked.

Each subprocess gets an environment without the variables the lookup reads (DSV4_LIBRARY,
CARGO_TARGET_DIR, PKG_CONFIG_PATH, LD_LIBRARY_PATH, PYTHONPATH) and with pkg-config's system
directories hidden, so only what a test sets is found."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import get_type_hints

import pytest

import dsv4
from dsv4 import _native, requests

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
FIXTURE = ROOT / "tests" / "fixtures" / "flash-like" / "hf-f32"
# The library this test session loaded (make test-python: the staged install's libdsv4.so.0).
LIBRARY = Path(_native.lib._name).resolve()
CARGO_VERSION = re.search(r'^version = "(.*)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)

# Run inside the installed package's interpreter: a greedy generate on the fixture model with EOS
# (token 1) pushed down, then forced, printing where dsv4 and the library came from.
CLIENT = textwrap.dedent("""
    import sys
    import dsv4
    params = {"model_path": sys.argv[1], "threads": 2,
              "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 2, "page_size": 128}}
    with dsv4.Engine(params) as engine:
        run = engine.generate([5, 17, 300, 2, 9], max_new_tokens=3, temperature=0,
                              logit_bias_tokens=[1], logit_bias_values=[-1000.0])
        eos = engine.generate([5, 17, 300, 2, 9], max_new_tokens=3, temperature=0,
                              logit_bias_tokens=[1], logit_bias_values=[1000.0])
    print("package", dsv4.__file__)
    print("library", dsv4._native.lib._name)
    print("numpy", "numpy" in sys.modules)
    print("run", len(run), run.finish_reason.name, run.generated_tokens)
    print("eos", list(eos), eos.finish_reason.name)
""")


def clean_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DSV4_LIBRARY", "CARGO_TARGET_DIR", "PKG_CONFIG_PATH", "LD_LIBRARY_PATH",
                        "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    empty = tmp_path / "no-pkgconfig"
    empty.mkdir(exist_ok=True)
    env["PKG_CONFIG_LIBDIR"] = str(empty)  # hides /usr/lib/pkgconfig and friends
    env.update({k: str(v) for k, v in extra.items()})
    return env


def python(exe, code, tmp_path, *args, **env):
    """Runs `code` with interpreter `exe` from tmp_path (outside the repository)."""
    return subprocess.run([str(exe), "-c", code, *map(str, args)], cwd=tmp_path,
                          env=clean_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=120)


def lines(out):
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def test_the_installed_library_has_its_debug_info_in_a_file_of_its_own():
    """`make install` strips the shared library and keeps its debug info next to it, linked by
    .gnu_debuglink (what gdb and valgrind follow); the static library is stripped too."""
    sections = subprocess.run(["readelf", "-S", "-W", str(LIBRARY)], capture_output=True,
                              text=True, check=True).stdout
    assert ".debug_info" not in sections, f"{LIBRARY} still carries its debug info"
    # Bytes: the section ends with the debug file's CRC-32, which is not text.
    link = subprocess.run(["readelf", "-p", ".gnu_debuglink", str(LIBRARY)],
                          capture_output=True, check=True).stdout
    debug = LIBRARY.parent / (LIBRARY.name + ".debug")
    assert debug.name.encode() in link, link
    assert ".debug_info" in subprocess.run(["readelf", "-S", "-W", str(debug)],
                                           capture_output=True, text=True, check=True).stdout
    static = subprocess.run(["readelf", "-S", "-W", str(LIBRARY.parent / "libdsv4.a")],
                            capture_output=True, text=True, check=True).stdout
    assert ".debug_info" not in static


def test_versions_agree_with_the_library_and_cargo():
    # A release bump that forgets the binding fails here rather than shipping mismatched structs.
    assert dsv4.__version__ == CARGO_VERSION
    assert dsv4.version() == CARGO_VERSION
    assert _native.ABI_MAJOR == int(CARGO_VERSION.split(".")[0])


def test_request_fields_type_lists_every_request_field():
    # The TypedDict that types generate()/stream()/submit() keywords and the fields build_request
    # accepts must not drift apart: add a new struct dsv4_request field to both.
    assert set(get_type_hints(dsv4.RequestFields)) == requests._FIELDS


# --- the installed package ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel pip builds from bindings/python (what `pip install ./bindings/python` builds
    and installs), built from a copy so setuptools' build/ and egg-info stay out of the tree;
    with this interpreter's setuptools (--no-build-isolation: no download)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "libdsv4.so*", "build", "*.egg-info", ".mypy_cache"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                          "--no-build-isolation", "--disable-pip-version-check", "-w",
                          str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = (tmp / "dist").glob("dsv4-*.whl")
    return whl


def test_the_wheel_is_pure_python_with_the_typed_marker(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert wheel.name == "dsv4-{}-py3-none-any.whl".format(CARGO_VERSION)
    package = {n for n in names if n.startswith("dsv4/")}
    assert package == {"dsv4/" + p.name for p in (PACKAGE / "dsv4").iterdir()
                       if p.suffix == ".py" or p.name == "py.typed"}
    assert "dsv4/py.typed" in package and not any("libdsv4" in n for n in names)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh virtualenv (no numpy, nothing else) with the wheel pip-installed, offline."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    exe = root / "bin" / "python"
    out = subprocess.run([str(exe), "-m", "pip", "install", "--no-deps", "--no-index",
                          "--disable-pip-version-check", str(wheel)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return root


def test_installed_package_generates_with_dsv4_library(venv, tmp_path):
    out = python(venv / "bin" / "python", CLIENT, tmp_path, FIXTURE, DSV4_LIBRARY=LIBRARY)
    assert out.returncode == 0, out.stderr
    got = lines(out)
    assert Path(got["package"]).is_relative_to(venv) and "site-packages" in got["package"]
    assert got["library"] == str(LIBRARY)
    assert got["numpy"] == "False"  # generate() needs no numpy: it is an optional extra
    assert got["run"] == "3 LENGTH 3"
    # Forcing EOS: it is generated, is the last (only) token, and the request ends with STOP.
    assert got["eos"] == "[1] STOP"


def test_installed_package_finds_the_library_in_its_prefix(venv, tmp_path):
    # `make install PREFIX=$VIRTUAL_ENV` puts the soname in <sys.prefix>/lib.
    link = venv / "lib" / "libdsv4.so.{}".format(_native.ABI_MAJOR)
    link.symlink_to(LIBRARY)
    try:
        out = python(venv / "bin" / "python", CLIENT, tmp_path, FIXTURE)
    finally:
        link.unlink()
    assert out.returncode == 0, out.stderr
    assert lines(out)["library"] == str(link)


def test_installed_package_finds_the_library_through_pkg_config(venv, tmp_path):
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config is not installed")
    prefix = tmp_path / "opt-dsv4"
    (prefix / "lib" / "pkgconfig").mkdir(parents=True)
    (prefix / "lib" / "libdsv4.so").symlink_to(LIBRARY)  # the development name only
    (prefix / "lib" / "pkgconfig" / "dsv4.pc").write_text(
        "prefix={}\nlibdir=${{prefix}}/lib\n\nName: dsv4\nDescription: t\nVersion: {}\n"
        "Libs: -L${{libdir}} -ldsv4\n".format(prefix, CARGO_VERSION))
    out = python(venv / "bin" / "python", "import dsv4; print(dsv4._native.lib._name)", tmp_path,
                 PKG_CONFIG_PATH=prefix / "lib" / "pkgconfig")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(prefix / "lib" / "libdsv4.so")


def test_missing_library_names_every_place_looked(venv, tmp_path):
    import ctypes.util

    if list(Path("/usr/local/lib").glob("libdsv4.so*")) or ctypes.util.find_library("dsv4"):
        pytest.skip("this machine has libdsv4 installed system-wide, so it is always found")
    out = python(venv / "bin" / "python", "import dsv4", tmp_path)
    assert out.returncode != 0
    err = out.stderr
    assert "OSError: libdsv4 not found. Looked in:" in err
    for place in ("DSV4_LIBRARY: not set",
                  "next to the package: {}/libdsv4.so*".format(
                      venv / "lib" / "python{}.{}".format(*sys.version_info[:2]) / "site-packages"
                      / "dsv4"),
                  "the Python prefix (<sys.prefix>/lib): {0}/lib/libdsv4.so.0, {0}/lib/libdsv4.so"
                  .format(venv),
                  "no dsv4.pc on PKG_CONFIG_PATH",
                  "make install's default prefix: /usr/local/lib/libdsv4.so.0",
                  "the dynamic linker's search path (ldconfig, LD_LIBRARY_PATH): no libdsv4",
                  "Fix: set DSV4_LIBRARY to the library file",
                  "`make install PREFIX=...`",
                  "PKG_CONFIG_PATH"):
        assert place in err, (place, err)
    # An installed package has no checkout to look in.
    assert "checkout" not in err.split("Fix:")[0]


def test_a_wrong_dsv4_library_is_an_error_not_a_fallback(venv, tmp_path):
    # Even with a library in the prefix, a DSV4_LIBRARY that names nothing is reported.
    link = venv / "lib" / "libdsv4.so.{}".format(_native.ABI_MAJOR)
    link.symlink_to(LIBRARY)
    try:
        out = python(venv / "bin" / "python", "import dsv4", tmp_path,
                     DSV4_LIBRARY=tmp_path / "nope.so")
        folder = python(venv / "bin" / "python", "import dsv4; print(dsv4._native.lib._name)",
                        tmp_path, DSV4_LIBRARY=venv / "lib")
    finally:
        link.unlink()
    assert out.returncode != 0
    assert "libdsv4 not found: DSV4_LIBRARY={} does not exist".format(tmp_path / "nope.so") \
        in out.stderr
    # A directory holding the library is accepted too.
    assert folder.returncode == 0, folder.stderr
    assert folder.stdout.strip() == str(link)


def test_mypy_type_checks_a_client_of_the_installed_package(venv, tmp_path):
    """Through py.typed, mypy reads the installed package's hints: a correct client passes,
    a wrong request field and a wrong result type are reported."""
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent("""
        from typing import List
        import dsv4

        def run(engine: dsv4.Engine) -> List[int]:
            out = engine.generate([1, 2], max_new_tokens=4, temperature=0.0, stop_tokens=[7])
            reason: dsv4.FinishReason = out.finish_reason
            assert reason is not dsv4.FinishReason.NONE
            return out.tokens
    """))
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        import dsv4

        def run(engine: dsv4.Engine) -> str:
            engine.generate([1, 2], max_tokens=4)
            return engine.generate([1, 2]).finish_reason
    """))
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable",
            str(venv / "bin" / "python")]
    ok = subprocess.run(mypy + [str(good)], cwd=tmp_path, env=clean_env(tmp_path),
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout
    wrong = subprocess.run(mypy + [str(bad)], cwd=tmp_path, env=clean_env(tmp_path),
                           capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 1, wrong.stdout
    assert 'Unexpected keyword argument "max_tokens"' in wrong.stdout
    assert 'Incompatible return value type (got "FinishReason", expected "str")' in wrong.stdout


# --- the source checkout -----------------------------------------------------------------------


def test_checkout_imports_without_installing(tmp_path):
    out = python(sys.executable, "import dsv4; print(dsv4.__file__); print(dsv4.version())",
                 tmp_path, PYTHONPATH=PACKAGE, DSV4_LIBRARY=LIBRARY)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(PACKAGE / "dsv4" / "__init__.py"), CARGO_VERSION]


def test_checkout_finds_its_own_build(tmp_path):
    # A copy of the checkout's layout: the build in target/release is found with nothing set,
    # and $CARGO_TARGET_DIR/release comes before it.
    repo = tmp_path / "repo"
    shutil.copytree(PACKAGE / "dsv4", repo / "bindings" / "python" / "dsv4",
                    ignore=shutil.ignore_patterns("__pycache__", "libdsv4.so*"))
    (repo / "Cargo.toml").write_text("[package]\nname = \"dsv4\"\n")
    (repo / "target" / "release").mkdir(parents=True)
    (repo / "target" / "release" / "libdsv4.so").symlink_to(LIBRARY)
    where = "import dsv4; print(dsv4._native.lib._name)"
    out = python(sys.executable, where, tmp_path, PYTHONPATH=repo / "bindings" / "python")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(repo / "target" / "release" / "libdsv4.so")

    other = tmp_path / "cargo-target"
    (other / "release").mkdir(parents=True)
    (other / "release" / "libdsv4.so.{}".format(_native.ABI_MAJOR)).symlink_to(LIBRARY)
    out = python(sys.executable, where, tmp_path, PYTHONPATH=repo / "bindings" / "python",
                 CARGO_TARGET_DIR=other)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(other / "release" / "libdsv4.so.0")


def test_mypy_strict_passes_on_the_package(tmp_path):
    # Its cache goes to tmp_path: nothing is written into the tree.
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir",
                          str(tmp_path / "mypy-cache"), str(PACKAGE / "dsv4")], cwd=PACKAGE,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
