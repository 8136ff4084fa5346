"""Which compiled binary a launch runs: its constexprs, options and the JIT's specialization of
every other argument."""

from __future__ import annotations

from dataclasses import dataclass

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from inferline.kernels.triton.launch import LaunchPlan


@dataclass(frozen=True)
class Variant:
    kernel: str
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int
    args: tuple[tuple[str, str], ...]  # (name, "type", "type:16" or "constexpr=value")


def exemptions(kernel) -> tuple[frozenset, frozenset]:
    """(not specialized, not specialized on alignment) argument names, for a JITFunction or the
    interpreter's InterpretedFunction."""
    options = getattr(kernel, "kwargs", None) or {}
    names = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ()
    unaligned = (
        getattr(kernel, "do_not_specialize_on_alignment", None)
        or options.get("do_not_specialize_on_alignment")
        or ()
    )
    return frozenset(names), frozenset(unaligned)


def variant_of(kernel, plan: LaunchPlan, args: tuple) -> Variant:
    """The binary `launch(kernel, plan, *args)` runs."""
    fixed = dict(plan.constexprs)
    names = [n for n in kernel.arg_names if n not in fixed]
    assert len(names) == len(args), (plan.kernel, names, len(args))
    exempt, unaligned = exemptions(kernel)
    specs = []
    for name, value in zip(names, args):
        type_, attr = native_specialize_impl(
            BaseBackend, value, False, name not in exempt, name not in unaligned
        )[:2]
        specs.append(
            (
                name,
                f"constexpr={attr}"
                if type_ == "constexpr"
                else type_ + (":16" if attr == "D" else ""),
            )
        )
    return Variant(plan.kernel, plan.constexprs, plan.num_warps, plan.num_stages, tuple(specs))
