"""How gdn2's own distributions are installed from outside the repository: the hints every error
message gives, built from one constant so that they match the commands in the README."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Final

#: Where the gdn2 repository is published. PLACEHOLDER: replace ``<org>`` with the real owner when
#: the repository is published; the README shows the same URL.
REPOSITORY: Final = "git+https://github.com/<org>/gdn2.git"

#: gdn2's own backends: each is the folder ``backends/NAME`` of the repository and the
#: distribution ``gdn2-NAME`` (``_`` as ``-``). A pip command is offered for these names only.
#: The first is the pure-JAX fallback that runs everywhere. The only backend names in the core's
#: code (``tests/core/test_layout.py`` allows them here alone).
OWN_BACKENDS: Final = ("jax_ref", "pallas_tpu", "scan_baseline")


def pip_command(distribution: str, subdirectory: str, extra: str = "") -> str:
    """The pip command that installs one of gdn2's distributions from the repository.

    Args:
        distribution: the distribution name (e.g. ``"gdn2-tools"``).
        subdirectory: its folder in the repository (e.g. ``"tools"``).
        extra: an optional extra (e.g. ``"plot"``).

    Returns:
        ``pip install "NAME[EXTRA] @ git+...#subdirectory=FOLDER"``.
    """
    extras = f"[{extra}]" if extra else ""
    return f'pip install "{distribution}{extras} @ {REPOSITORY}#subdirectory={subdirectory}"'


def own_backend_command(name: str) -> str:
    """The pip command of one of gdn2's own backends.

    Args:
        name: one of :data:`OWN_BACKENDS`.

    Returns:
        Its ``pip install`` command.

    Raises:
        ValueError: ``name`` is not one of gdn2's own backends (there is no folder to install).
    """
    if name not in OWN_BACKENDS:
        raise ValueError(f"name: expected one of gdn2's own backends {OWN_BACKENDS}, got {name!r}")
    return pip_command(f"gdn2-{name.replace('_', '-')}", f"backends/{name}")


def _closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (case, ``-`` and ``_`` aside), or None when none is close."""
    by_key = {c.lower().replace("-", "_"): c for c in candidates}
    found = difflib.get_close_matches(name.lower().replace("-", "_"), list(by_key), n=1)
    return by_key[found[0]] if found else None


def backend_hint(name: str, installed: Iterable[str] = ()) -> str:
    """How to get the backend called ``name``, for an error that says it is not installed.

    Args:
        name: the backend name that was asked for.
        installed: the names of the installed backends (a close one is offered first).

    Returns:
        One sentence: the closest installed name ("did you mean 'jax_ref'?"); the pip command when
        ``name`` (or the closest name) is one of gdn2's own backends (:data:`OWN_BACKENDS`), which
        are the only folders of the repository that hold one; else to install the package that
        provides it.
    """
    installed = list(installed)
    if name in OWN_BACKENDS:
        return f"{name!r} is one of gdn2's own backends: {own_backend_command(name)}"
    close = _closest(name, installed)
    if close is not None:
        return f"did you mean {close!r}? (else install the package that provides {name!r})"
    own = _closest(name, OWN_BACKENDS)
    if own is not None:
        return (
            f"did you mean {own!r}, one of gdn2's own backends? {own_backend_command(own)}; "
            f"otherwise install the package that provides {name!r}"
        )
    return f"{name!r} is not one of gdn2's own backends: install the package that provides it"


def any_backend_hint() -> str:
    """What to install when no backend at all can run a call.

    Returns:
        One sentence with the command of jax_ref (the first of :data:`OWN_BACKENDS`: pure JAX,
        every platform) and the names of gdn2's other backends.
    """
    fallback, *others = OWN_BACKENDS
    return (
        f"install a backend, e.g. {fallback} (pure JAX, every platform): "
        f"{own_backend_command(fallback)}; gdn2's others: {', '.join(others)} (README, section "
        "Install); `gdn2 info` lists what is installed"
    )
