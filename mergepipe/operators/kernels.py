"""The CPU float kernel sets torch dispatches to (ATEN_CPU_CAPABILITY): the one this process
uses, recorded with a merge (its bytes do not depend on it), and the ones this CPU offers, for
the tests and scripts that check so."""

from __future__ import annotations

from mergepipe import torch

# torch's capability names, from plainest to widest; x86 machines have a ladder of them.
X86_LADDER = ("default", "avx2", "avx512")


def kernel_set() -> str:
    """This process's kernel set, lower case as ATEN_CPU_CAPABILITY names it."""
    return torch.backends.cpu.get_cpu_capability().lower()


def kernel_sets() -> list[str]:
    """Every kernel set this CPU can run, the plain one first: the values of
    ATEN_CPU_CAPABILITY that give this process's set or a plainer one."""
    widest = kernel_set()
    if widest in X86_LADDER:
        return list(X86_LADDER[: X86_LADDER.index(widest) + 1])
    return ["default", widest] if widest != "default" else ["default"]
