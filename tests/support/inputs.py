"""The kit's input generator and metric under their old import path (tests written against
``tests.support.inputs`` keep working); new code imports :mod:`gdn2_conformance`."""

from gdn2_conformance import Case, Decay, Inputs, make_inputs, rel_err

__all__ = ["Case", "Decay", "Inputs", "make_inputs", "rel_err"]
