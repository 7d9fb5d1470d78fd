"""A third-party gdn2 backend: the token-serial recurrence, only for small key head sizes; and a
``gdn2`` subcommand of its own.

Its high priority and narrow capabilities let the tests see ``backend="auto"`` pick it when it
fits and pass over it (to the next backend) when it does not.
"""

from gdn2_conformance import ReferenceBackend
from gdn2core.plugin import Capabilities, Command, hookimpl


class ToySerialBackend(ReferenceBackend):
    name = "toy_serial"
    priority = 1000
    capabilities = Capabilities(dk=(4, 8), dtypes=("float32",))


@hookimpl
def gdn2_backend():
    return ToySerialBackend()


@hookimpl
def gdn2_commands():
    return [Command("toy-hello", "say hello from the toy backend", f"{__name__}:hello_main")]


def hello_main(argv):
    print("hello from toy_serial", *argv)
    return 0
