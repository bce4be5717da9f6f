"""Every dependency range in pyproject.toml holds at its lowest allowed version.

A throwaway virtual environment, on top of this Python's packages (so torch is not downloaded again), gets every
dependency pinned at its floor. In it, against this checkout, run the tests that train on a dataset and a base from
the loopback Hub, push the run, load it back through transformers' pipeline, train under fp16's loss scaler, and
push through a stalled or dropped connection.

    python scripts/check_lowest_versions.py            # or: make test-floors (CI runs it after make test)
    python scripts/check_lowest_versions.py --venv /tmp/floors   # keep the environment for a second run

torch is the exception: PyPI's torch wheels bring gigabytes of CUDA libraries, so the torch already installed is used
and only checked against the range (pyproject.toml says which torch versions the suite ran on).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
NOT_INSTALLED = {"torch"}  # checked against its range as installed, never pinned (see the docstring)
# The tests run at the floors, by file, with the pytest -k expression that picks them. Left out of the round trip:
# the two-process run (a launcher's test, and the longest here) and the card's validation (huggingface_hub 1.x's
# ModelCard.validate asks huggingface.co whatever HF_ENDPOINT says; there is no network here).
TESTS = {
    "test_hub_roundtrip": "not two_process_run and not passes_hub_validation",  # Hub data and base, train, push, load
    "test_loss_scale": "",  # fp16's loss scaler through Accelerate
    "test_safety_io": "stall or reset",  # push timeouts and dropped connections: the HTTP library's own errors
}


def floors(pyproject: Path = REPO / "pyproject.toml") -> dict[str, Version]:
    """Each runtime dependency's lowest allowed version (its `>=` bound), by name as pyproject.toml spells it."""
    found = {}
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        lowest = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
        if not lowest:
            raise SystemExit(f"pyproject.toml: {line!r} has no lower bound (>=) to check")
        found[requirement.name] = max(lowest)
    return found


def run(command: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command).replace("\n", "; "), flush=True)
    return subprocess.run(command, check=check, **kwargs)


def install_floors(python: Path, lowest: dict[str, Version]) -> None:
    """pip-install every dependency but torch at its floor into the environment of `python`; check what it holds."""
    # Wheels only: a floor with no wheel for this Python would otherwise be built from source, slowly. pip's
    # complaints about packages of this Python that need newer versions are no concern here: shown on failure.
    pins = [f"{name}=={floor}" for name, floor in lowest.items() if name not in NOT_INSTALLED]
    pip = run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--only-binary", ":all:",
               *pins], check=False, capture_output=True, text=True)
    if pip.returncode:
        raise SystemExit(f"pip could not install the floors:\n{pip.stdout}{pip.stderr}")
    listing = run([str(python), "-c", "import sys\nfrom importlib.metadata import version\n"
                   "print('\\n'.join(f'{name} {version(name)}' for name in sys.argv[1:]))", *lowest],
                  capture_output=True, text=True).stdout
    print(listing, end="")
    installed = dict(line.split() for line in listing.splitlines())
    wrong = {name: found for name, found in installed.items()
             if name not in NOT_INSTALLED and Version(found) != lowest[name]}
    if wrong:
        raise SystemExit(f"not at their floors: {wrong}")


def run_tests(python: Path) -> int:
    """The TESTS in the environment of `python`, against this checkout; pytest's exit code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    chosen = " or ".join(f"({name} and ({pick}))" if pick else name for name, pick in TESTS.items())
    return subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(f"tests/{name}.py" for name in TESTS), "-k", chosen], cwd=REPO, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="the environment's folder, kept for the next run (default: a "
                                                  "temporary one, removed at the end)")
    args = parser.parse_args()
    lowest = floors()
    for name in NOT_INSTALLED:
        installed = Version(version(name))
        if installed < lowest[name]:
            raise SystemExit(f"{name} {installed} is installed, below pyproject.toml's floor {lowest[name]}")
        print(f"{name}: the installed {installed} is used (floor {lowest[name]}; not installable here at the floor)")
    with tempfile.TemporaryDirectory(prefix="floors-") as scratch:
        python = (args.venv or Path(scratch) / "venv") / "bin" / "python"
        started = time.perf_counter()
        if not python.exists():
            run([sys.executable, "-m", "venv", "--system-site-packages", str(python.parent.parent)])
        install_floors(python, lowest)
        installed = time.perf_counter()
        code = run_tests(python)
        print(f"lowest versions: installed in {installed - started:.0f} s, tests in "
              f"{time.perf_counter() - installed:.0f} s; exit code {code}", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
