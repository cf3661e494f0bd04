"""Family declarations and their discovery through the ``vlenvoys.families`` entry points.

A family package holds declarations, not machinery: for each vLLM
architecture it serves, which envoy classes wrap its blocks, attention and
MLP modules, and how its module names map to the standard ones. It registers
one `Family` under the entry-point group ``vlenvoys.families``; core finds it
when a model loads, in the client and in every vLLM worker process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .envoys import Attention, Blocks, Layer, Mlp
from ..errors import UnknownArchitecture, UnsupportedVLLM

__all__ = [
    "BACKBONE_NAMES", "TIED_BACKBONE_NAMES", "Architecture", "ByConfig", "Family", "InstalledFamily", "architectures_of",
    "config_of", "families", "resolve", "resolve_checkpoint",
]

GROUP = "vlenvoys.families"

#: Architectures the published family packages serve, for the error a model no
#: installed family knows gets: it names the package to install.
PUBLISHED = {
    "vlenvoys-llama": (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
        "MixtralForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM",
    ),
    "vlenvoys-gpt2": ("GPT2LMHeadModel",),
    "vlenvoys-gemma": ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    "vlenvoys-exaone": ("Exaone4ForCausalLM", "ExaoneForCausalLM", "Olmo2ForCausalLM"),
    "vlenvoys-neox": ("GPTNeoXForCausalLM", "GPTJForCausalLM", "CohereForCausalLM"),
}


#: The standard names of vLLM's most common layout, a ``model.model`` backbone
#: (Llama, Qwen, Mistral, Gemma, Granite, EXAONE 4): the default renames.
BACKBONE_NAMES = {"model.layers": "layers", "model.norm": "ln_final", "model.embed_tokens": "embed_tokens"}
#: `BACKBONE_NAMES` for a model that unembeds with its embedding module itself (no ``lm_head``
#: child; vLLM's Gemma 2, Cohere): the embedding carries both names.
TIED_BACKBONE_NAMES = {**BACKBONE_NAMES, "model.embed_tokens": ["embed_tokens", "lm_head"]}


@dataclass(frozen=True, eq=False)
class Architecture:
    """How one vLLM architecture's modules map to the standard envoys and names.

    Attributes:
        layer: The envoy class of its decoder blocks (a `Layer` or `FusedLayer`
            subclass carrying the block's declarations).
        attention: The envoy class of each block's attention module.
        mlp: The envoy class of each block's MLP.
        rename: nnsight ``rename=`` aliases from vLLM's module names to the
            standard ones (``layers``, ``self_attn``, ``mlp``, ``embed_tokens``,
            ``ln_final``, ``lm_head``), as nnterp renames transformers' modules;
            `BACKBONE_NAMES` by default.
    """

    layer: type[Layer]
    attention: type[Attention] = Attention
    mlp: type[Mlp] = Mlp
    rename: Mapping[str, str] = field(default_factory=lambda: dict(BACKBONE_NAMES))

    def envoys(self) -> dict[str, type]:
        """The ``envoys=`` map for nnsight, keyed by standard path suffixes."""
        return {
            "layers": Blocks,
            "layers.*": self.layer,
            "layers.*.self_attn": self.attention,
            "layers.*.mlp": self.mlp,
        }


_UNSET: Any = object()


@dataclass(frozen=True, eq=False)
class ByConfig:
    """Declarations of one architecture chosen by a setting of the model's config.

    Where one architecture builds different blocks by a config attribute
    (GPT-NeoX's ``use_parallel_residual``: parallel or sequential), a family
    maps the attribute's values to their declarations; core chooses when the
    model loads, in the client and in every worker, from the checkpoint's
    config.

    Attributes:
        attribute: The config attribute (``"use_parallel_residual"``).
        choices: Its values to the `Architecture` each gets.
        default: The value a config without the attribute has (the
            transformers config class's default); unset, such a config is refused.
    """

    attribute: str
    choices: Mapping[Any, Architecture]
    default: Any = _UNSET

    def choose(self, config: Any) -> Architecture:
        """The declarations for ``config`` (a transformers config, or a ``config.json`` as a dict).

        Raises:
            UnknownArchitecture: the config's value has no declarations (or it
                names none and there is no default).
        """
        if isinstance(config, Mapping):
            value = config.get(self.attribute, self.default)
        else:
            value = getattr(config, self.attribute, self.default)
        if value is _UNSET or value not in self.choices:
            shown = "no value" if value is _UNSET else repr(value)
            raise UnknownArchitecture(
                f"the config's {self.attribute} has {shown}; the family declares "
                f"{', '.join(repr(choice) for choice in self.choices)}"
            )
        return self.choices[value]


@dataclass(frozen=True, eq=False)
class Family:
    """What a family package registers: the architectures it serves.

    Attributes:
        name: Short name (``"llama"``).
        architectures: vLLM architecture names (a config's ``architectures``
            strings, as vLLM's model registry keys them) to their declarations
            (an `Architecture`, or a `ByConfig` choosing one by the config).
        vllm: The vLLM versions the family was verified against, as a PEP 440
            specifier; another installed version loads with a warning.
        transformers_backend: Declarations for the same architectures run
            through vLLM's transformers backend (``model_impl="transformers"``):
            transformers' own modules inside the engine, with transformers'
            names and ``BATCHED`` envoys.
    """

    name: str
    architectures: Mapping[str, Architecture | ByConfig]
    vllm: str = ""
    transformers_backend: Mapping[str, Architecture | ByConfig] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class InstalledFamily:
    """A `Family` found installed, with the distribution that provides it."""

    family: Family
    distribution: str
    version: str

    @property
    def name(self) -> str:
        return self.family.name


#: Family entry points that failed to load: "distribution (entry point): error", for UnknownArchitecture's message.
BROKEN: list[str] = []


@functools.cache
def _discover() -> tuple[InstalledFamily, ...]:
    found = []
    for entry in importlib.metadata.entry_points(group=GROUP):
        dist = entry.dist
        try:
            family = entry.load()
            if not isinstance(family, Family):
                raise TypeError(f"{entry.value} is not a vlenvoys.Family")
        except Exception as error:
            # One broken package (built for another vlenvoys-core, half-installed) must not take the
            # other families down with it: it is skipped, said once, and named where a model needs it.
            broken = f"{dist.name if dist else '?'} (entry point {entry.name} = {entry.value}): {type(error).__name__}: {error}"
            BROKEN.append(broken)
            warnings.warn(f"vlenvoys: a family package failed to load and is skipped: {broken}", stacklevel=2)
            continue
        found.append(InstalledFamily(family, dist.name if dist else "?", dist.version if dist else "?"))
    return tuple(sorted(found, key=lambda installed: installed.name))


def families() -> list[InstalledFamily]:
    """Every installed family package, by name, with its distribution and version."""
    return list(_discover())


def resolve(
    architectures: Iterable[str], backend: bool = False, config: Any = None
) -> tuple[InstalledFamily, str, Architecture]:
    """The installed family that declares one of ``architectures``, and its declarations.

    With ``backend``, the declarations for vLLM's transformers backend.
    ``config`` (a transformers config or a ``config.json`` dict) chooses
    among declarations a family made `ByConfig`; without it, such a
    declaration is refused.

    Raises:
        UnknownArchitecture: no installed family declares any of them; the
            message names the architectures and the packages that would serve them.
        UnsupportedVLLM: the installed vLLM is outside the family's verified range (`_check_vllm`).
    """
    architectures = list(architectures or [])
    for name in architectures:
        for installed in _discover():
            declared = installed.family.transformers_backend if backend else installed.family.architectures
            if name in declared:
                _check_vllm(installed)
                chosen = declared[name]
                if isinstance(chosen, ByConfig):
                    if config is None:
                        raise TypeError(f"{installed.name} declares {name} by its config's {chosen.attribute}: pass config=")
                    chosen = chosen.choose(config)
                return installed, name, chosen
    if backend:
        raise UnknownArchitecture(
            f"no installed vlenvoys family declares {' / '.join(architectures)} on vLLM's transformers backend "
            "(model_impl='transformers'); load it without model_impl to use vLLM's own implementation"
        )
    packages = sorted({package for name in architectures for package, served in PUBLISHED.items() if name in served})
    installed = ", ".join(f"{i.name} ({', '.join(i.family.architectures)})" for i in _discover()) or "none"
    hint = (
        f"install {' or '.join(packages)} to serve it"
        if packages
        else "no published family serves it; a family package is a short list of declarations (see the README)"
    )
    broken = f" Failed to load (skipped): {'; '.join(BROKEN)}." if BROKEN else ""
    raise UnknownArchitecture(
        f"no installed vlenvoys family declares architecture {' / '.join(architectures) or '(none in the config)'}: "
        f"{hint}. Installed families: {installed}.{broken}"
    )


#: Set to 1 to start a model on a vLLM outside its family's verified range: a warning instead of `UnsupportedVLLM`.
ALLOW_UNVERIFIED = "VLENVOYS_ALLOW_UNVERIFIED_VLLM"


@functools.cache
def _warned(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def _check_vllm(installed: InstalledFamily) -> None:
    """Refuse a vLLM outside the range ``installed``'s family declares (``Family.vllm``), unless allowed.

    Raises:
        UnsupportedVLLM: the installed vLLM's version is outside the range and
            ``VLENVOYS_ALLOW_UNVERIFIED_VLLM`` is not 1 (with it: a warning, once).
    """
    spec = installed.family.vllm
    if not spec:
        return
    import vllm
    from packaging.specifiers import SpecifierSet

    version = vllm.__version__
    if SpecifierSet(spec).contains(version, prereleases=True):
        return
    said = f"{installed.distribution} {installed.version} is verified against vLLM {spec}; vLLM {version} is installed"
    if os.environ.get(ALLOW_UNVERIFIED) == "1":
        _warned(f"{said}, so its values have not been checked against transformers here ({ALLOW_UNVERIFIED}=1)")
        return
    raise UnsupportedVLLM(
        f"{said}: install a verified one (pip install 'vllm{spec}'), or set {ALLOW_UNVERIFIED}=1 to go on with "
        "values not checked against transformers on this version"
    )


def architectures_of(model: str | os.PathLike) -> list[str]:
    """The ``architectures`` a checkpoint's config.json declares.

    Raises:
        FileNotFoundError: ``model`` names a local path with no checkpoint.
    """
    path = Path(model).expanduser()
    config = path / "config.json"
    if config.is_file():
        return list(json.loads(config.read_text()).get("architectures") or [])
    if path.exists() or str(model).startswith(("/", ".", "~")) or str(model).count("/") > 1:
        raise FileNotFoundError(
            f"no checkpoint at {model}: expected a folder with a config.json (or a hub name such as org/model)"
        )
    from transformers import AutoConfig

    return list(AutoConfig.from_pretrained(str(model)).architectures or [])


def config_of(model: str | os.PathLike) -> Any:
    """A checkpoint's config: its ``config.json`` as a dict, or the hub's transformers config."""
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        return json.loads(config.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model))


#: The module of vLLM's transformers backend, where its registry sends the architectures it has no module of its own for.
BACKEND_MODULE = "vllm.model_executor.models.transformers"


def on_transformers_backend_alone(architectures: Iterable[str]) -> bool:
    """Whether vLLM runs ``architectures`` on its transformers backend alone, having no module of its own for them.

    Read from vLLM's model registry, as vLLM reads it: the first of
    ``architectures`` registered there (vLLM's plugins loaded first) is the
    one it runs. True for OLMo 2 and GPT-NeoX on vLLM 0.32, and for Gemma 1
    from 0.34, which dropped its own. False where the registry names none of
    them (vLLM's own error then says so).
    """
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # a plugin may register a module of its own (vLLM loads them later, as the engine starts)
    registered = next((ModelRegistry.models[name] for name in architectures if name in ModelRegistry.models), None)
    if registered is None:
        return False
    module = getattr(registered, "module_name", None) or getattr(getattr(registered, "model_cls", None), "__module__", "")
    return module == BACKEND_MODULE


def resolve_checkpoint(model: str | os.PathLike, engine_kwargs: dict) -> tuple[InstalledFamily, str, Architecture]:
    """The family and declarations that serve checkpoint ``model`` with ``engine_kwargs``.

    An architecture vLLM runs on its transformers backend alone (GPT-NeoX on
    vLLM 0.32, Gemma 1 on 0.34: `on_transformers_backend_alone`), or one no
    family declares for vLLM's own module, is served by the family's
    declarations for that backend, whatever ``model_impl`` other than
    ``"transformers"`` names (vLLM then runs the backend's module anyway):
    unset or ``"auto"``, ``model_impl="transformers"`` is set in
    ``engine_kwargs``, as vLLM itself would fall back to it. Declarations
    `ByConfig` are chosen by the checkpoint's config.

    Raises:
        UnknownArchitecture: no installed family declares the architecture,
            or vLLM runs it on its transformers backend alone and the family
            declares it for vLLM's own module only.
        UnsupportedVLLM: the installed vLLM is outside the family's verified range.
    """
    architectures, config = architectures_of(model), config_of(model)
    impl = engine_kwargs.get("model_impl")
    if impl != "transformers" and on_transformers_backend_alone(architectures):
        try:
            found = resolve(architectures, backend=True, config=config)
        except UnknownArchitecture:
            # Declared for vLLM's own module only (else no family declares it, and that is raised): said so,
            # rather than envoys that fit no module of the engine.
            installed, name, _ = resolve(architectures, config=config)
            import vllm

            raise UnknownArchitecture(
                f"vLLM {vllm.__version__} runs {name} on its transformers backend alone (it has no module of its own "
                f"for it), and {installed.distribution} {installed.version} declares {name} for vLLM's own module only: "
                f"install a {installed.distribution} that declares it on the backend, or a vLLM verified for it "
                f"({installed.family.vllm or 'any'})"
            ) from None
        if impl in (None, "auto"):
            engine_kwargs["model_impl"] = "transformers"
        return found
    try:
        return resolve(architectures, backend=impl == "transformers", config=config)
    except UnknownArchitecture:
        if impl not in (None, "auto"):
            raise
        try:
            found = resolve(architectures, backend=True, config=config)
        except UnknownArchitecture:
            pass
        else:
            engine_kwargs["model_impl"] = "transformers"
            return found
        raise
