"""The kit's input generator and metric under their old import path (tests written against
``tests.support.inputs`` keep working); new code imports :mod:`gdn2core.testing`."""

from gdn2core.testing import Case, Decay, Inputs, make_inputs, rel_err

__all__ = ["Case", "Decay", "Inputs", "make_inputs", "rel_err"]
