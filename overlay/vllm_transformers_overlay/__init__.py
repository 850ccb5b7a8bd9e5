"""Serve this project's Transformers modeling backend in place of vLLM's stock copy.

The installed `vllm` ships its own `vllm.model_executor.models.transformers`. This
module owns the one thing that swaps it: a meta-path finder, installed at interpreter
start by the `vllm_transformers_overlay.pth` hook, that resolves that package name to
this project's directory. Everything else of `vllm` stays the installed one, and
nothing else patches vLLM but one function, which vLLM would need changed in-tree to
route hybrid models to this backend at all (`routing.py` says which and why).

Because the hook runs at interpreter start, it is active in every process vLLM spawns
(API server, engine core, workers, the model-inspection subprocess).

Set `VLLM_TRANSFORMERS_BACKEND=stock` to load vLLM's stock subpackage instead, so one
environment can compare the two. Any other value than `project` or `stock` makes every
`import vllm` fail with an error saying so, in every process: refusing only the
subpackage would not do, since vLLM's registry logs a failed import of a model class and
serves the model with another implementation. `python -m vllm_transformers_overlay`
prints which implementation is active.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

PACKAGE = "vllm.model_executor.models.transformers"
ROUTING_MODULE = "vllm.config.model"
"""Where the one function the overlay replaces lives (`routing.py`)."""
ENV_SWITCH = "VLLM_TRANSFORMERS_BACKEND"
PROJECT, STOCK = "project", "stock"


def requested() -> str:
    """The implementation `VLLM_TRANSFORMERS_BACKEND` asks for (default: project)."""
    value = os.environ.get(ENV_SWITCH, PROJECT).strip().lower() or PROJECT
    if value not in (PROJECT, STOCK):
        raise ValueError(
            f"{ENV_SWITCH} must be {PROJECT!r} (this project's backend) or "
            f"{STOCK!r} (vLLM's own copy), got {os.environ[ENV_SWITCH]!r}"
        )
    return value


def project_dir() -> Path:
    """Where this project's copy of the subpackage lives.

    Packaging maps `vllm_transformers_overlay.backend` to the subpackage's directory
    (the repository's tree in an editable install, a copy in a regular one). Finding
    its spec locates it without executing it under that name.
    """
    spec = importlib.util.find_spec(f"{__name__}.backend")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{__name__} is installed without its backend files")
    return Path(next(iter(spec.submodule_search_locations)))


class RefusingFinder(importlib.abc.MetaPathFinder):
    """Fails every import of `vllm` with `reason`: what `install` puts in place of a
    choice `VLLM_TRANSFORMERS_BACKEND` does not name."""

    def __init__(self, reason: str):
        self.reason = reason

    def find_spec(self, fullname, path, target=None):
        if fullname == "vllm":
            raise ImportError(self.reason, name=fullname)
        return None


class RoutingLoader(importlib.abc.Loader):
    """Loads `ROUTING_MODULE` with its own loader, then lets `routing.py` replace
    the one function it replaces."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        from vllm_transformers_overlay.routing import install_routing

        install_routing(module)


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Resolves `PACKAGE` to `project_dir()`; its submodules follow its `__path__`.
    `ROUTING_MODULE` is found as usual and loaded through a `RoutingLoader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname == ROUTING_MODULE:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = RoutingLoader(spec.loader)
            return spec
        if fullname != PACKAGE:
            return None
        directory = project_dir()
        return importlib.util.spec_from_file_location(
            fullname,
            directory / "__init__.py",
            submodule_search_locations=[str(directory)],
        )


def install() -> None:
    """Put the finder first on `sys.meta_path` unless the stock backend is asked for.

    Runs at interpreter start, where an exception would only be printed and the
    stock subpackage would then load: an invalid `VLLM_TRANSFORMERS_BACKEND` installs
    a `RefusingFinder` instead, so that vLLM fails to import with the reason."""
    if any(isinstance(f, OverlayFinder | RefusingFinder) for f in sys.meta_path):
        return
    try:
        choice = requested()
    except ValueError as error:
        sys.meta_path.insert(
            0,
            RefusingFinder(
                f"{error}. vLLM does not start rather than guess which "
                "Transformers modeling backend is meant."
            ),
        )
        return
    if choice == PROJECT:
        sys.meta_path.insert(0, OverlayFinder())


def active() -> str:
    """`"project"` or `"stock"`: which implementation `import PACKAGE` loads here."""
    spec = importlib.util.find_spec(PACKAGE)
    origin = Path(spec.origin).resolve().parent if spec and spec.origin else None
    try:
        ours = project_dir().resolve()
    except ImportError:
        return STOCK
    return PROJECT if origin == ours else STOCK


def describe() -> str:
    """One line naming the active implementation and where its files are."""
    spec = importlib.util.find_spec(PACKAGE)
    location = Path(spec.origin).parent if spec and spec.origin else "?"
    return f"Transformers modeling backend: {active()} ({location})"
