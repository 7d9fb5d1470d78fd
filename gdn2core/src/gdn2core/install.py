"""How gdn2's own distributions are installed from outside the repository: the hints every error
message gives, built from one constant so that they match the commands in the README."""

from __future__ import annotations

from typing import Final

#: Where the gdn2 repository is published. PLACEHOLDER: replace ``<org>`` with the real owner when
#: the repository is published; the README shows the same URL.
REPOSITORY: Final = "git+https://github.com/<org>/gdn2.git"


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


def backend_hint(name: str) -> str:
    """How to install the backend called ``name``, for an error that says it is missing.

    Args:
        name: the backend name that was asked for.

    Returns:
        One sentence: the command for one of gdn2's own backends (their folders are named after
        them), and what to do for any other.
    """
    command = pip_command(f"gdn2-{name.replace('_', '-')}", f"backends/{name}")
    return (
        f"if {name!r} is one of gdn2's own backends: {command}; otherwise install the package "
        "that provides it"
    )


def any_backend_hint() -> str:
    """What to install when no backend at all can run a call.

    Returns:
        One sentence naming the README section and the command pattern.
    """
    return (
        f"install a backend, for one of gdn2's own: "
        f"{pip_command('gdn2-<name>', 'backends/<name>')} (README, section Install); "
        "`gdn2 info` lists what is installed"
    )
