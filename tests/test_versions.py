"""The supported versions (configuration/versions.py): pyproject.toml states the same ranges for pip, each check
refuses an unsupported version by name, and the plugin refuses an unsupported vLLM when vLLM loads it."""

import pytest
import tomllib
from packaging.requirements import Requirement

from configuration import versions
from tests.conftest import REPO_ROOT


def test_pyproject_states_the_ranges_the_checks_enforce():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = {req.name: req.specifier for req in map(Requirement, project["dependencies"])}
    assert requirements["torch"] == versions.TORCH
    assert requirements["transformers"] == versions.TRANSFORMERS


@pytest.mark.parametrize(
    ("package", "installed", "supported"),
    [
        ("torch", "2.11.0+cu130", versions.TORCH),
        ("torch", "2.13.0+cpu", versions.TORCH),
        ("transformers", "5.17.0", versions.TRANSFORMERS),
        ("transformers", "5.23.0", versions.TRANSFORMERS),
        ("vllm", "0.26.0", versions.VLLM),
        ("vllm", "0.32.0+cpu", versions.VLLM),
    ],
)
def test_supported_versions_pass(package, installed, supported):
    versions.check_version(package, installed, supported)


@pytest.mark.parametrize(
    ("package", "installed", "supported"),
    [
        ("torch", "2.10.0", versions.TORCH),
        ("torch", "2.14.0", versions.TORCH),
        ("transformers", "5.16.1", versions.TRANSFORMERS),
        ("transformers", "5.25.0", versions.TRANSFORMERS),
        ("vllm", "0.27.0", versions.VLLM),
        ("vllm", "0.33.0", versions.VLLM),
    ],
)
def test_unsupported_versions_are_refused_by_name(package, installed, supported):
    with pytest.raises(ImportError, match=rf"supports {package} .*and {package} {installed} is installed"):
        versions.check_version(package, installed, supported)


def test_the_plugin_refuses_an_unsupported_vllm_when_vllm_loads_it(monkeypatch):
    vllm = pytest.importorskip("vllm")
    import vllm_integration

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(ImportError, match="supports vllm ==0.26.\\* or ==0.32.\\*, and vllm 0.33.0 is installed"):
        vllm_integration.register()
