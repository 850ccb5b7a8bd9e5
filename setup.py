"""Packaging that installs the overlay, never a top-level `vllm` package.

The wheel holds `vllm_transformers_overlay` (the finder), the subpackage's files as
`vllm_transformers_overlay.backend` (found by path, never imported under that name),
and `vllm_transformers_overlay.pth`, which installs the finder at interpreter start.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BACKEND = "vllm/model_executor/models/transformers"
HOOK = "vllm_transformers_overlay.pth"


class BuildWithHook(build_py):
    """Also place the `.pth` hook at the root of the wheel (site-packages)."""

    def run(self):
        super().run()
        self.copy_file(str(Path("overlay") / HOOK), str(Path(self.build_lib) / HOOK))

    def get_outputs(self, include_bytecode=True):
        return [
            *super().get_outputs(include_bytecode),
            str(Path(self.build_lib) / HOOK),
        ]


def backend_packages() -> list[str]:
    root = Path(BACKEND)
    return [
        ".".join(
            ("vllm_transformers_overlay.backend", *init.parent.relative_to(root).parts)
        )
        for init in sorted(root.rglob("__init__.py"))
    ]


setup(
    packages=["vllm_transformers_overlay", *backend_packages()],
    package_dir={
        "vllm_transformers_overlay": "overlay/vllm_transformers_overlay",
        "vllm_transformers_overlay.backend": BACKEND,
    },
    cmdclass={"build_py": BuildWithHook},
)
