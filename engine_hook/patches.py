"""A registry of patches on SGLang that fails loudly when SGLang changed under it.

Each patch names its site (``module.attr`` or ``module.Class.method``), the parameters it relies
on, and the SGLang versions it was verified on. Before anything is applied every site is resolved
and its signature compared; one missing site or changed signature stops start-up with a message
that names the site and the running version, and nothing is patched. Patches go through SGLang's
own hook registry (``sglang.srt.plugins.hook_registry``), which also rebinds ``from X import Y``
copies; since that registry only logs its failures, every site is checked again afterwards.
"""

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Callable

__all__ = ["Patch", "PatchError", "check", "apply", "sglang_version", "signature_of"]

KINDS = ("before", "after", "around", "replace")


class PatchError(RuntimeError):
    """A site vcap cannot patch safely; the message names the site and SGLang's version."""


@dataclass(frozen=True, slots=True)
class Patch:
    target: str                    # "pkg.module.attr" or "pkg.module.Class.method"
    hook: Callable
    kind: str                      # before, after, around, replace
    parameters: tuple[str, ...]    # the site's parameters as verified: name, kind and default (see signature_of)
    verified_on: tuple[str, ...]   # SGLang versions the patch was checked against
    why: str                       # one line: what the patch does

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def sglang_version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:  # not installed as a distribution (a source checkout)
        return "unknown"


def _resolve(target: str):
    module_path, _, attr = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(module_path)
        return inspect.getattr_static(owner, attr), getattr(owner, attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise PatchError(f"{target}: not found in SGLang {sglang_version()} ({error})") from None


def signature_of(function) -> tuple[str, ...]:
    """The parameters as Python writes them, annotations left out: ``"topk"``, ``"scoring_func='sigmoid'"``,
    a bare ``"*"`` before keyword-only ones, ``"/"`` after positional-only ones, ``"*args"``, ``"**kwargs"``.
    Names, kinds and defaults all count: a changed default or a parameter made keyword-only is a change."""
    parameters = list(inspect.signature(function).parameters.values())
    rendered, kind = [], None
    for parameter in parameters:
        if kind is inspect.Parameter.POSITIONAL_ONLY and parameter.kind is not kind:
            rendered.append("/")
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and kind not in (
                inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_POSITIONAL):
            rendered.append("*")
        rendered.append(str(parameter.replace(annotation=inspect.Parameter.empty)))
        kind = parameter.kind
    if kind is inspect.Parameter.POSITIONAL_ONLY:
        rendered.append("/")
    return tuple(rendered)


def check(patch: Patch) -> None:
    """Raises PatchError when the site is missing or its parameters (names, kinds, defaults) differ."""
    static, bound = _resolve(patch.target)
    function = static.__func__ if isinstance(static, (classmethod, staticmethod)) else bound
    function = inspect.unwrap(function)  # SGLang's own decorators (debug_kernel_api)
    try:
        found = signature_of(function)
    except (TypeError, ValueError) as error:
        raise PatchError(f"{patch.target}: no signature to check in SGLang {sglang_version()} ({error})") from None
    if found != patch.parameters:
        raise PatchError(
            f"{patch.target}: SGLang {sglang_version()} has parameters ({', '.join(found)}); vcap's "
            f"patch expects ({', '.join(patch.parameters)}), verified on SGLang "
            f"{', '.join(patch.verified_on)}. Refusing to start rather than patch it blindly.")


def apply(patches: list[Patch]) -> None:
    """Check every site, then register and apply them all through SGLang's hook registry.

    Raises:
        PatchError: a site is missing, changed, or SGLang's registry did not patch it.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for patch in patches:
        check(patch)
    for patch in patches:
        HookRegistry.register(patch.target, patch.hook, HookType(patch.kind))
    HookRegistry.apply_hooks()
    for patch in patches:
        _, current = _resolve(patch.target)
        if not _wraps(current, patch.hook):
            raise PatchError(f"{patch.target}: SGLang {sglang_version()}'s hook registry did not "
                             "apply vcap's patch (see its log for the reason)")


def _wraps(function, hook) -> bool:
    """True when ``function`` is a wrapper chain that contains ``hook``."""
    function = getattr(function, "__func__", function)
    seen = 0
    while function is not None and seen < 32:
        if function is hook or any(getattr(cell, "cell_contents", None) is hook for cell in (function.__closure__ or ())):
            return True
        function = getattr(function, "__wrapped__", None)
        seen += 1
    return False
